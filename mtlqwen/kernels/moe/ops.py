"""The MoE ops: routing and the expert MLPs, on the kernels of kernels.py where they serve (selection.py's
moe_* rows), MLX's own ops (the references) otherwise."""

from __future__ import annotations

import mlx.core as mx

from ..dispatch import kernel_op
from ..qmatmul.ops import linear, swiglu_linear
from ..selection import SELECT
from . import grouped, kernels
from .reference import moe_experts_ref, moe_experts_sorted, moe_route_ref


def _route_gpu(logits, k, renorm=True, shared_logit=None):
    return kernels.route(logits, k, renorm, shared_logit) if SELECT["moe_route_kernel"] else None


@kernel_op("moe_route", _route_gpu, reference=moe_route_ref)
def moe_route(logits: mx.array, k: int, renorm: bool = True, shared_logit: mx.array | None = None):
    """Router logits [T, E] -> (expert ids [T, k] int32, weights [T, k (+1 shared gate)] fp32): one launch."""
    return moe_route_ref(logits, k, renorm, shared_logit)


def shared_mlp(x: mx.array, shared) -> mx.array:
    """The shared expert on the dense projections' ops (their GEMV / GEMM kernels where they run)."""
    gate, up, down = shared
    return linear(swiglu_linear(x, gate, up), down)


def _experts_gpu(x, gate, up, down, inds, weights, shared=None):
    """Decode sizes: the fused expert kernels; prefill sizes: pairs grouped by expert, on the grouped
    tensor-core GEMM (CUDA, shapes it covers) or else sorted gather_qmm; between them (None): the
    reference's unsorted gather_qmm."""
    T, k = inds.shape
    if kernels.fused_supported(x, gate, up, down, inds):
        if shared is None or kernels.shared_fusable(shared, gate, x):
            return kernels.fused_experts(x, gate, up, down, inds, weights, shared)
        return kernels.fused_experts(x, gate, up, down, inds, weights) + \
            shared_mlp(x, shared) * weights[:, k:].astype(x.dtype)
    if 0 < SELECT["moe_grouped_min_pairs"] <= T * k and grouped.supported(x, gate, up, down, inds):
        return grouped.grouped_experts(x, gate, up, down, inds, weights, shared, shared_mlp)
    if T * k >= SELECT["moe_sort_min_pairs"] and gate.quantized == up.quantized == down.quantized:
        return moe_experts_sorted(x, gate, up, down, inds, weights, shared, shared_mlp)
    return None


@kernel_op("moe_experts", _experts_gpu, reference=moe_experts_ref)
def moe_experts(x: mx.array, gate, up, down, inds: mx.array, weights: mx.array, shared: tuple | None = None):
    """x [T, H] -> sum_j weights[:, j] * expert_{inds[:, j]}(x) (+ weights[:, k] * shared(x)) [T, H];
    gate / up / down: the stacked experts' LinearParams ([E, Im, H], [E, Im, H], [E, H, Im]); shared:
    the shared expert's (gate, up, down) or None."""
    return moe_experts_ref(x, gate, up, down, inds, weights, shared, shared_mlp)
