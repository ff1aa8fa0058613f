"""Gated DeltaNet: references (reference.py), the recurrent and chunk kernels (kernels.py), the recurrence
with its gated RMSNorm fused (normed.py), the recurrence with a block of tokens read ahead (staged.py), the
kernels' shared text (pieces.py), dispatchers (ops.py)."""

from .ops import (
    gated_delta,
    gated_delta_candidates,
    gated_delta_packed,
    gated_delta_packed_candidates,
    gated_delta_packed_candidates_normed,
    gated_delta_packed_normed,
    gated_head_norm,
)
from .reference import (
    gated_delta_candidates_ref,
    gated_delta_packed_candidates_normed_ref,
    gated_delta_packed_normed_ref,
    gated_delta_ref,
    gdn_gates,
    l2_normalize,
    split_qkv,
)

__all__ = ["gated_delta", "gated_delta_candidates", "gated_delta_candidates_ref", "gated_delta_packed",
           "gated_delta_packed_candidates", "gated_delta_packed_candidates_normed",
           "gated_delta_packed_candidates_normed_ref", "gated_delta_packed_normed", "gated_delta_packed_normed_ref",
           "gated_delta_ref", "gated_head_norm", "gdn_gates", "l2_normalize", "split_qkv"]
