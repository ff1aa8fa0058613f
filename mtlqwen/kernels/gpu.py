"""Imports every module that declares portable kernels, so that `portable.REGISTRY` lists them all
(check_metal / check_cuda enumerate it). Nothing else imports this module; keep it a plain list."""

from .attention import kernels as attention_kernels  # noqa: F401
from .attention import kv_write  # noqa: F401
from .conv import kernels as conv_kernels  # noqa: F401
from .gdn import kernels as gdn_kernels  # noqa: F401
from .gdn import normed  # noqa: F401
from .moe import kernels as moe_kernels  # noqa: F401
from .norms import kernels as norm_kernels  # noqa: F401
from .qmatmul import dequant, gemv, qgemm, residual  # noqa: F401
from .rope import kernels as rope_kernels  # noqa: F401
