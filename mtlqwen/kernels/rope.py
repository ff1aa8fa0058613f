"""Partial rotary embedding (NeoX rotate-half) over the first `rotary_dim` dims of each head."""

from __future__ import annotations

import mlx.core as mx

from .backend import kernel_for


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


def apply_rope(x: mx.array, positions: mx.array, tables: RopeTables) -> mx.array:
    kern = kernel_for("rope")
    out = kern(x, positions, tables) if kern is not None else None
    if out is not None:
        return out
    return apply_rope_ref(x, positions, tables)
