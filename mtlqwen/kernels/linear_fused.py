"""Fused projections: several projections of one input, gate+up with the SwiGLU epilogue, and a projection
followed by the residual add and the next RMSNorm.

On GPU back-ends both run as one quantized-GEMV launch for decode-sized inputs (qmatmul.py); the
references below define what they compute and run everywhere else.
"""

from __future__ import annotations

import mlx.core as mx

from .backend import kernel_for
from .fused_small import add_rms_norm, add_rms_norm_ref
from .linear import LinearParams, linear, linear_ref


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


def linear_multi(x: mx.array, ps: list[LinearParams]) -> list[mx.array]:
    kern = kernel_for("linear_multi")
    out = kern(x, ps) if kern is not None else None
    return out if out is not None else [linear(x, p) for p in ps]


def swiglu_linear(x: mx.array, gate: LinearParams, up: LinearParams) -> mx.array:
    kern = kernel_for("swiglu_linear")
    out = kern(x, gate, up) if kern is not None else None
    if out is not None:
        return out
    g, u = linear(x, gate), linear(x, up)
    return (g * mx.sigmoid(g)) * u


def linear_add_rms_norm(x: mx.array, p: LinearParams, h: mx.array, w: mx.array, eps: float):
    """A block's last projection, the residual add and the next norm: one launch at decode sizes on GPUs."""
    kern = kernel_for("linear_add_rms_norm")
    out = kern(x, p, h, w, eps) if kern is not None else None
    return out if out is not None else add_rms_norm(h, linear(x, p), w, eps)
