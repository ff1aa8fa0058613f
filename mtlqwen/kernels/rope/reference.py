"""Partial rotary embedding (NeoX rotate-half) over the first `rotary_dim` dims of each head, and the
per-head RMSNorm that precedes it in gated attention (§3.3-3.4): the reference twins."""

from __future__ import annotations

import mlx.core as mx

from ..norms.reference import rms_norm_ref


class RopeTables:
    """cos/sin [max_pos, rotary_dim / 2] in fp32, grown by doubling when a longer position arrives."""

    def __init__(self, rotary_dim: int, theta: float, initial: int = 4096):
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (mx.arange(0, rotary_dim, 2, dtype=mx.float32) / rotary_dim))
        self.size = 0
        self._grow(initial)

    def _grow(self, n: int) -> None:
        phase = mx.arange(n, dtype=mx.float32)[:, None] * self.inv_freq[None, :]
        self.cos, self.sin = mx.cos(phase), mx.sin(phase)
        mx.eval(self.cos, self.sin)
        self.size = n

    def ensure(self, max_position: int) -> None:
        if max_position >= self.size:
            n = self.size
            while n <= max_position:
                n *= 2
            self._grow(n)


def apply_rope_ref(x: mx.array, positions: mx.array, tables: RopeTables) -> mx.array:
    """x [T, H, D], positions [T] -> x with dims [0, rotary_dim) rotated, the rest passed through."""
    rd, half = tables.rotary_dim, tables.rotary_dim // 2
    cos = tables.cos[positions][:, None, :]  # [T, 1, rd/2]
    sin = tables.sin[positions][:, None, :]
    xf = x.astype(mx.float32)
    x1, x2 = xf[..., :half], xf[..., half:rd]
    rot = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return mx.concatenate([rot, x[..., rd:]], axis=-1) if rd < x.shape[-1] else rot


def head_norm_rope_ref(x: mx.array, w: mx.array, eps: float, positions: mx.array, tables: RopeTables,
                       head_dim: int) -> mx.array:
    """x [T, H, RS] (RS >= head_dim: each head's first head_dim values are used) -> [T, H, head_dim]."""
    return apply_rope_ref(rms_norm_ref(heads_of(x, head_dim), w, eps), positions, tables)


def heads_of(x: mx.array, head_dim: int) -> mx.array:
    """Each head's first head_dim values of x [..., RS]."""
    return x if x.shape[-1] == head_dim else x[..., :head_dim]  # a slice is a graph node even when whole
