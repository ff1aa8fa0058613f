"""RMSNorm variants, computed in fp32 and cast back (docs/qwen35.md §4, §2.9): the reference twins."""

from __future__ import annotations

import mlx.core as mx


def rms_norm_ref(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """x [..., D] * rsqrt(mean(x^2) + eps) * w. Zero-centred norms arrive with +1 already folded into w."""
    xf = x.astype(mx.float32)
    y = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(mx.float32)).astype(x.dtype)


def gated_rms_norm_ref(x: mx.array, z: mx.array, w: mx.array, eps: float) -> mx.array:
    """GDN output norm: rms_norm(x) * w * silu(z), over the last dim (per value head)."""
    xf = x.astype(mx.float32)
    y = (xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = y.astype(mx.float32) * w.astype(mx.float32)
    zf = z.astype(mx.float32)
    return (y * (zf * mx.sigmoid(zf))).astype(x.dtype)


def add_rms_norm_ref(h: mx.array, delta: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(h + delta, rms_norm(h + delta)): the decoder block's residual add fused with the next pre-norm."""
    hs = h + delta.astype(h.dtype)
    return hs, rms_norm_ref(hs, w, eps)
