"""Partial RoPE and the fused per-head norm + RoPE: references, kernels, dispatchers."""

from .ops import apply_rope, head_norm_rope
from .reference import RopeTables, apply_rope_ref, head_norm_rope_ref

__all__ = ["RopeTables", "apply_rope", "apply_rope_ref", "head_norm_rope", "head_norm_rope_ref"]
