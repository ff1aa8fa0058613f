"""Linear projections and the fused projections (several of one input, gate+up with SwiGLU, a projection
with the residual add and the next RMSNorm): the reference twins, MLX's own ops."""

from __future__ import annotations

import mlx.core as mx

from ..norms.reference import add_rms_norm_ref
from .params import LinearParams


def linear_ref(x: mx.array, p: LinearParams) -> mx.array:
    """x [..., in] -> [..., out] with MLX's own ops."""
    if p.quantized:
        return mx.quantized_matmul(
            x, p.weight, p.scales, p.biases, transpose=True, group_size=p.group_size, bits=p.bits
        )
    return x @ p.weight.T


def gather_linear_ref(x: mx.array, p: LinearParams, inds: mx.array) -> mx.array:
    """Per-token expert projections. x [T, in], p.weight [E, out, in(packed)], inds [T, k] -> [T, k, out]."""
    xe = x[:, None, None, :]  # [T, 1, 1, in]: one row per token, broadcast over its k experts
    if p.quantized:
        y = mx.gather_qmm(
            xe, p.weight, p.scales, p.biases, rhs_indices=inds, transpose=True,
            group_size=p.group_size, bits=p.bits,
        )
    else:
        y = mx.gather_mm(xe, p.weight.swapaxes(-1, -2), rhs_indices=inds)
    return y[:, :, 0, :]


def linear_multi_ref(x: mx.array, ps: list[LinearParams]) -> list[mx.array]:
    """x [..., in] -> [x @ W_p.T for p in ps], each [..., out_p]."""
    return [linear_ref(x, p) for p in ps]


def swiglu_linear_ref(x: mx.array, gate: LinearParams, up: LinearParams) -> mx.array:
    """x [..., in] -> silu(x @ Wg.T) * (x @ Wu.T) [..., inter] (the MLP before down_proj, §4)."""
    g = linear_ref(x, gate)
    u = linear_ref(x, up)
    return (g * mx.sigmoid(g)) * u


def linear_add_rms_norm_ref(x: mx.array, p: LinearParams, h: mx.array, w: mx.array, eps: float):
    """x [M, in], residual h [M, out] -> (h + x @ W.T, rms_norm(h + x @ W.T) * w), both [M, out]."""
    return add_rms_norm_ref(h, linear_ref(x, p), w, eps)
