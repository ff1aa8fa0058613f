"""Imports every GPU kernel module so that each registers its kernels (`backend.register_kernel`).
Imported lazily by `backend.kernel_for` on Metal / CUDA; keep it a plain list of imports."""

from . import conv_kernels  # noqa: F401
from . import dequant  # noqa: F401
from . import fused_small  # noqa: F401
from . import gdn_kernels  # noqa: F401
from . import gdn_normed_kernels  # noqa: F401
from . import head_norm_rope  # noqa: F401
from . import kv_write_kernels  # noqa: F401
from . import qmatmul, paged_attn_kernels  # noqa
from . import qmv_residual  # noqa: F401
