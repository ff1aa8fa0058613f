"""The RoPE ops: the table kernel and the fused norm + RoPE kernel (kernels.py) where they run."""

from __future__ import annotations

import mlx.core as mx

from ..dispatch import kernel_op
from ..norms.ops import rms_norm
from . import kernels
from .reference import RopeTables, apply_rope_ref, head_norm_rope_ref, heads_of


@kernel_op("rope", kernels.rope_kernel)
def apply_rope(x: mx.array, positions: mx.array, tables: RopeTables) -> mx.array:
    return apply_rope_ref(x, positions, tables)


@kernel_op("head_norm_rope", kernels.head_norm_rope_kernel, reference=head_norm_rope_ref, row="head_norm_rope")
def head_norm_rope(x: mx.array, w: mx.array, eps: float, positions: mx.array, tables: RopeTables,
                   head_dim: int) -> mx.array:
    """The fused kernel where `SELECT["head_norm_rope"]` switches it on, else the norm and RoPE ops one
    after the other (each a kernel of its own on the GPU)."""
    return apply_rope(rms_norm(heads_of(x, head_dim), w, eps), positions, tables)
