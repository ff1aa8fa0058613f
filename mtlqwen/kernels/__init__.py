"""Op functions used by the model. Each op module holds a plain-MLX reference twin (what the CPU
back-end runs) and a dispatcher that picks a custom kernel on GPU back-ends."""

from .backend import force_reference, gpu_backend, use_kernels
from .conv1d import causal_conv1d
from .gated_delta import gated_delta
from .linear import LinearParams, gather_linear, linear
from .norms import gated_rms_norm, rms_norm
from .paged_attention import paged_attention, write_kv, write_kv_inplace
from .rope import RopeTables, apply_rope
from .seqs import SeqLayout

__all__ = [
    "LinearParams", "RopeTables", "SeqLayout", "apply_rope", "causal_conv1d", "force_reference",
    "gated_delta", "gated_rms_norm", "gather_linear", "gpu_backend", "linear", "paged_attention", "rms_norm",
    "use_kernels", "write_kv", "write_kv_inplace",
]
