"""The MoE ops: routing and the expert MLPs, on the kernels of kernels.py where they serve (selection.py's
moe_* rows), MLX's own ops (the references) otherwise."""

from __future__ import annotations

import mlx.core as mx

from ..dispatch import kernel_op
from ..norms.ops import add_rms_norm
from ..norms.reference import add_rms_norm_ref
from ..qmatmul.ops import linear, linear_multi, swiglu_linear
from ..selection import SELECT
from . import combine as combine_launch
from . import grouped, kernels
from . import router as router_launch
from .reference import (combine_ref, moe_experts_ref, moe_experts_sorted, moe_route_exact_ref, moe_route_ref,
                        plus_shared)


def _route_gpu(logits, k, renorm=True, shared_logit=None):
    return kernels.route(logits, k, renorm, shared_logit) if SELECT["moe_route_kernel"] else None


@kernel_op("moe_route", _route_gpu, reference=moe_route_exact_ref)
def moe_route(logits: mx.array, k: int, renorm: bool = True, shared_logit: mx.array | None = None):
    """Router logits [T, E] -> (expert ids [T, k] int32, weights [T, k (+1 shared gate)] fp32): one launch."""
    return moe_route_ref(logits, k, renorm, shared_logit)


def _router_route_gpu(x, router, shared_gate, k, renorm=True):
    if router_launch.supported(x, router, shared_gate, k):
        return router_launch.router_route(x, router, shared_gate, k, renorm)
    return None


def _router_logits(x, router, shared_gate):
    outs = linear_multi(x, [router] + ([shared_gate] if shared_gate is not None else []))
    return outs[0], (outs[1] if shared_gate is not None else None)


def moe_router_route_check(x, router, shared_gate, k, renorm=True):
    """The self-check's reference: the routing on the projection ops' logits, equal logits in the kernels'
    order. Not on linear_ref's logits: the routing of bf16 logits flips at near-ties (several a prompt over
    256 experts), so logits rounded apart would fail a correct kernel."""
    logits, sgl = _router_logits(x, router, shared_gate)
    return moe_route_exact_ref(logits, k, renorm, sgl)


# tests/test_kernels_moe.py's router tests passed on the H200 (benchmarks/moe.md)
@kernel_op("moe_router_route", _router_route_gpu, reference=moe_router_route_check)
def moe_router_route(x: mx.array, router, shared_gate, k: int, renorm: bool = True):
    """x [T, H] -> moe_route(x @ router^T, k, renorm, x @ shared_gate^T): the router projection (and the
    shared expert's gate, or None) and the routing; at decode sizes on GPUs one launch (moe/router.py)."""
    logits, sgl = _router_logits(x, router, shared_gate)
    return moe_route(logits, k, renorm, sgl)


def shared_mlp(x: mx.array, shared) -> mx.array:
    """The shared expert on the dense projections' ops (their GEMV / GEMM kernels where they run)."""
    gate, up, down = shared
    return linear(swiglu_linear(x, gate, up), down)


def _combine_gpu(y, dest, weights, k, shared_y=None, dtype=None):
    if not SELECT["moe_combine_kernel"] or (dtype is not None and dtype != y.dtype):
        return None
    if not combine_launch.covers(y, dest, weights, k, shared_y):
        return None
    return combine_launch.combine(y, dest, weights, k, shared_y)


# tests/test_kernels_moe_combine.py passed on the H200 (benchmarks/results/gpu-tests-moe-combine.log)
@kernel_op("moe_combine", _combine_gpu)
def moe_combine(y: mx.array, dest: mx.array, weights: mx.array, k: int, shared_y: mx.array | None = None,
                dtype=None) -> mx.array:
    """y [R, H] the experts' down rows in a path's order, dest [T*k] each pair's row, weights [T, k (+1)]
    -> the pairs' weighted sum (+ weights[:, k] * shared_y) [T, H] (reference.combine_ref)."""
    return combine_ref(y, dest, weights, k, shared_y, dtype)


def _experts_gpu(x, gate, up, down, inds, weights, shared=None):
    """Decode sizes: the fused expert kernels; prefill sizes: pairs grouped by expert, on the grouped
    tensor-core GEMM (CUDA, shapes it covers) or else sorted gather_qmm; between them (None): the
    reference's unsorted gather_qmm."""
    T, k = inds.shape
    if kernels.fused_supported(x, gate, up, down, inds):
        if shared is None or kernels.shared_fusable(shared, gate, x):
            return kernels.fused_experts(x, gate, up, down, inds, weights, shared)
        return plus_shared(kernels.fused_experts(x, gate, up, down, inds, weights), shared_mlp(x, shared), weights,
                           k, x.dtype)
    if 0 < SELECT["moe_grouped_min_pairs"] <= T * k and grouped.supported(x, gate, up, down, inds):
        return grouped.grouped_experts(x, gate, up, down, inds, weights, shared, shared_mlp, combine=moe_combine)
    if T * k >= SELECT["moe_sort_min_pairs"] and gate.quantized == up.quantized == down.quantized:
        return moe_experts_sorted(x, gate, up, down, inds, weights, shared, shared_mlp, combine=moe_combine)
    return None


@kernel_op("moe_experts", _experts_gpu, reference=moe_experts_ref)
def moe_experts(x: mx.array, gate, up, down, inds: mx.array, weights: mx.array, shared: tuple | None = None):
    """x [T, H] -> sum_j weights[:, j] * expert_{inds[:, j]}(x) (+ weights[:, k] * shared(x)) [T, H];
    gate / up / down: the stacked experts' LinearParams ([E, Im, H], [E, Im, H], [E, H, Im]); shared:
    the shared expert's (gate, up, down) or None."""
    return moe_experts_ref(x, gate, up, down, inds, weights, shared, shared_mlp)


def _experts_add_norm_gpu(x, gate, up, down, inds, weights, shared, h, w, eps):
    """Decode sizes: the fused expert kernels with the residual add + norm in down's epilogue (one
    add_rms_norm launch fewer a layer); None elsewhere (the experts and the norm apart)."""
    if kernels.fused_add_norm_supported(x, gate, up, down, inds, shared, h, w):
        return kernels.fused_experts_add_rms_norm(x, gate, up, down, inds, weights, shared, h, w, eps)
    return None


def moe_experts_add_rms_norm_ref(x, gate, up, down, inds, weights, shared, h, w, eps):
    return add_rms_norm_ref(h, moe_experts_ref(x, gate, up, down, inds, weights, shared, shared_mlp), w, eps)


# tests/test_kernels_moe.py's add_rms_norm test passed on the H200 (benchmarks/moe.md)
@kernel_op("moe_experts_add_rms_norm", _experts_add_norm_gpu, reference=moe_experts_add_rms_norm_ref)
def moe_experts_add_rms_norm(x: mx.array, gate, up, down, inds: mx.array, weights: mx.array, shared: tuple | None,
                             h: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(h + moe_experts(...), rms_norm(h + moe_experts(...)) * w), both [T, H]: the MoE block's output, the
    residual add and the next norm, as add_rms_norm returns them."""
    return add_rms_norm(h, moe_experts(x, gate, up, down, inds, weights, shared), w, eps)
