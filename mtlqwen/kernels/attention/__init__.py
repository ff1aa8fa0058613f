"""Attention over the paged KV pools: references (reference.py), the decode-attention kernel (kernels.py),
the in-place KV write (kv_write.py), dispatchers (ops.py)."""

from .ops import (attention_prep, drafter_attention, drafter_attention_prep, drafter_context_write, paged_attention,
                  paged_attention_gated, write_kv_inplace)
from .reference import (
    drafter_attention_ref,
    gather_context,
    masked_gqa_attention,
    paged_attention_gated_ref,
    paged_attention_ref,
    write_kv,
)

__all__ = ["attention_prep", "drafter_attention", "drafter_attention_prep", "drafter_attention_ref",
           "drafter_context_write", "gather_context", "masked_gqa_attention",
           "paged_attention", "paged_attention_gated", "paged_attention_gated_ref", "paged_attention_ref",
           "write_kv", "write_kv_inplace"]
