"""Op functions used by the model, one package per op family (norms, rope, conv, gdn, attention,
qmatmul), each with its plain-MLX reference twins (what the CPU back-end runs), its portable kernel
bodies and its dispatchers. Every dispatcher goes through `dispatch.kernel_op`: the custom kernel on GPU
back-ends, the fallback when it does not cover a shape or fails (one warning, the request goes on)."""

from .attention import (attention_prep, drafter_attention, drafter_attention_prep, drafter_context_write,
                        paged_attention, paged_attention_gated, write_kv, write_kv_inplace)
from .backend import force_reference, gpu_backend, use_kernels
from .conv import causal_conv1d
from .gdn import (
    gated_delta,
    gated_delta_candidates,
    gated_delta_packed,
    gated_delta_packed_candidates,
    gated_delta_packed_candidates_normed,
    gated_delta_packed_normed,
    gated_head_norm,
    split_qkv,
)
from .moe import moe_combine, moe_experts, moe_experts_add_rms_norm, moe_route, moe_router_route
from .norms import add_rms_norm, gated_rms_norm, rms_norm
from .qmatmul import LinearParams, gather_linear, gdn_in_proj_conv, linear, linear_add_rms_norm, linear_multi, swiglu_linear
from .rope import RopeTables, apply_rope, head_norm_rope
from .seqs import SeqLayout

__all__ = [
    "attention_prep", "LinearParams", "RopeTables", "SeqLayout", "add_rms_norm", "apply_rope", "causal_conv1d", "drafter_attention",
    "drafter_attention_prep", "drafter_context_write",
    "force_reference", "gated_delta", "gated_delta_candidates", "gated_delta_packed", "gated_delta_packed_candidates",
    "gated_delta_packed_candidates_normed", "gated_delta_packed_normed", "gated_head_norm",
    "gated_rms_norm", "gather_linear", "gdn_in_proj_conv", "gpu_backend", "head_norm_rope", "linear", "linear_add_rms_norm",
    "linear_multi", "moe_combine", "moe_experts", "moe_experts_add_rms_norm", "moe_route", "moe_router_route", "paged_attention", "paged_attention_gated", "rms_norm", "split_qkv", "swiglu_linear",
    "use_kernels", "write_kv", "write_kv_inplace",
]
