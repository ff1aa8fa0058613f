"""The projection ops: the quantized GEMV (gemv.py) and its residual-norm (residual.py) and conv
(conv_epilogue.py) epilogues where they run, MLX's own ops (the references) otherwise."""

from __future__ import annotations

import mlx.core as mx

from ..conv.ops import causal_conv1d
from ..conv.reference import causal_conv1d_ref
from ..dispatch import kernel_op
from ..norms.ops import add_rms_norm
from ..seqs import SeqLayout
from . import conv_epilogue, gemv, residual
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


def _in_proj_conv_ref(x, ps, conv_w, conv_pool, layout):
    mixed, *rest = linear_multi_ref(x, ps)
    y, new = causal_conv1d_ref(mixed, conv_w, conv_pool, layout)
    return [y, *rest], new


@kernel_op("gdn_in_proj_conv", conv_epilogue.gdn_in_proj_conv_kernel, reference=_in_proj_conv_ref,
           row="qmv_conv_epilogue", pools=("conv_pool",))
def gdn_in_proj_conv(x: mx.array, ps: list[LinearParams], conv_w: mx.array, conv_pool: mx.array,
                     layout: SeqLayout) -> tuple[list[mx.array], mx.array | None]:
    """A GDN layer's input projections and its causal conv + SiLU: ([silu(conv(x W_0^T)) [T, C], x W_1^T, ...],
    new conv states [B, K-1, C] for the caller's scatter, or None: already in conv_pool's rows). One launch
    where every sequence has one token (conv_epilogue.py); else the projections' and the conv's own ops.
    The caller makes every later reader of conv_pool depend on the first output (as causal_conv1d's)."""
    mixed, *rest = linear_multi(x, ps)
    y, new = causal_conv1d(mixed, conv_w, conv_pool, layout, write_state=True)
    return [y, *rest], new
