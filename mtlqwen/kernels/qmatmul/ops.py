"""The projection ops: the quantized GEMV (gemv.py) and its residual-norm epilogue (residual.py) where they
run, MLX's own ops (the references) otherwise."""

from __future__ import annotations

import mlx.core as mx

from ..dispatch import kernel_op
from ..norms.ops import add_rms_norm
from . import gemv, residual
from .params import LinearParams
from .reference import gather_linear_ref, linear_add_rms_norm_ref, linear_multi_ref, linear_ref, swiglu_linear_ref


@kernel_op("linear", gemv.linear_kernel)
def linear(x: mx.array, p: LinearParams) -> mx.array:
    """x [..., in] -> [..., out]."""
    return linear_ref(x, p)


@kernel_op("gather_linear", None)
def gather_linear(x: mx.array, p: LinearParams, inds: mx.array) -> mx.array:
    """Per-token expert projections (no GPU kernel of ours: MLX's gather_qmm / gather_mm everywhere)."""
    return gather_linear_ref(x, p, inds)


@kernel_op("linear_multi", gemv.linear_multi_kernel, reference=linear_multi_ref)
def linear_multi(x: mx.array, ps: list[LinearParams]) -> list[mx.array]:
    """x [..., in] -> [x @ W_p.T for p in ps]: one launch at decode sizes on GPUs."""
    return [linear(x, p) for p in ps]


@kernel_op("swiglu_linear", gemv.swiglu_linear_kernel, reference=swiglu_linear_ref)
def swiglu_linear(x: mx.array, gate: LinearParams, up: LinearParams) -> mx.array:
    """silu(x @ Wg.T) * (x @ Wu.T): one launch at decode sizes on GPUs."""
    g, u = linear(x, gate), linear(x, up)
    return (g * mx.sigmoid(g)) * u


@kernel_op("linear_add_rms_norm", residual.linear_add_rms_norm_kernel, reference=linear_add_rms_norm_ref)
def linear_add_rms_norm(x: mx.array, p: LinearParams, h: mx.array, w: mx.array, eps: float):
    """A block's last projection, the residual add and the next norm: one launch at decode sizes on GPUs
    (SELECT["qmv_residual_norm"])."""
    return add_rms_norm(h, linear(x, p), w, eps)
