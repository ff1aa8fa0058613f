"""The MoE block's reference twins (docs/qwen35.md §4): the router's top-k and the expert MLPs in plain
MLX (MLX's gather_qmm per projection), what the CPU runs and every kernel is compared with."""

from __future__ import annotations

import mlx.core as mx

from ..qmatmul.params import LinearParams
from ..qmatmul.reference import gather_linear_ref, linear_ref


def moe_route_ref(logits: mx.array, k: int, renorm: bool = True,
                  shared_logit: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Router logits [T, E] -> (expert ids [T, k] int32, weights [T, k] fp32; [T, k + 1] with the shared
    expert's gate sigmoid(shared_logit [T, 1]) last). fp32 softmax over all E, the top k, renormalised to
    sum 1 when `renorm`. The k are ordered by decreasing probability (the kernel's order, so outputs
    compare position by position)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top-k routing needs 1 <= k <= experts, got k={k} for {logits.shape[-1]} experts")
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)  # [T, E]
    inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]  # [T, k], any order
    w = mx.take_along_axis(probs, inds, axis=-1)
    order = mx.argsort(-w, axis=-1)
    inds, w = mx.take_along_axis(inds, order, axis=-1).astype(mx.int32), mx.take_along_axis(w, order, axis=-1)
    if renorm:
        w = w / w.sum(axis=-1, keepdims=True)
    if shared_logit is not None:
        w = mx.concatenate([w, mx.sigmoid(shared_logit.astype(mx.float32))], axis=-1)
    return inds, w


def moe_route_exact_ref(logits: mx.array, k: int, renorm: bool = True,
                        shared_logit: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """moe_route_ref with the kernels' order for equal logits (bf16 logits tie often): the lower expert id
    first. Each expert's rank counts the experts before it, O(T * E^2); past 2^24 comparisons it is
    moe_route_ref (whose order among equal logits is unspecified). The self-checks' reference: an
    argpartition that puts a tied expert elsewhere would fail a correct kernel."""
    T, E = logits.shape
    if T * E * E > 2**24:
        return moe_route_ref(logits, k, renorm, shared_logit)
    lf = logits.astype(mx.float32)
    ids = mx.arange(E)
    before = (lf[:, None, :] > lf[:, :, None]) | ((lf[:, None, :] == lf[:, :, None]) & (ids[None, None, :] < ids[None, :, None]))
    rank = before.astype(mx.int32).sum(axis=-1)                        # [T, E]: distinct 0..E-1
    inds = mx.argsort(rank, axis=-1)[:, :k].astype(mx.int32)           # [T, k] in the kernels' order
    probs = mx.softmax(lf, axis=-1)
    w = mx.take_along_axis(probs, inds, axis=-1)
    if renorm:
        w = w / w.sum(axis=-1, keepdims=True)
    if shared_logit is not None:
        w = mx.concatenate([w, mx.sigmoid(shared_logit.astype(mx.float32))], axis=-1)
    return inds, w


def shared_expert_ref(x: mx.array, shared: tuple[LinearParams, LinearParams, LinearParams]) -> mx.array:
    """The shared expert's SwiGLU MLP, x [T, H] -> [T, H]."""
    gate, up, down = shared
    g = linear_ref(x, gate)
    return linear_ref(g * mx.sigmoid(g) * linear_ref(x, up), down)


def routed_sum(down: mx.array, weights: mx.array, k: int, dtype) -> mx.array:
    """down [T, k, H] weighted by weights[:, :k] in `dtype` and summed over k -> [T, H]."""
    return (down * weights[:, :k].astype(dtype)[..., None]).sum(axis=1)


def plus_shared(out: mx.array, shared_y: mx.array | None, weights: mx.array, k: int, dtype) -> mx.array:
    """out [T, H] + weights[:, k] * shared_y in `dtype` (the shared expert's gated term), or out without one."""
    return out if shared_y is None else out + shared_y * weights[:, k:].astype(dtype)


def combine_ref(y: mx.array, dest: mx.array, weights: mx.array, k: int, shared_y: mx.array | None = None,
                dtype=None) -> mx.array:
    """y [R, H] (the experts' down rows in a path's own order), dest [T*k] (each pair's row of y), weights
    [T, k (+1)] -> routed_sum of the pairs' rows (+ weights[:, k] * shared_y) [T, H] in `dtype` (y's)."""
    dtype = dtype or y.dtype
    return plus_shared(routed_sum(y[dest].reshape(weights.shape[0], k, -1), weights, k, dtype), shared_y, weights,
                       k, dtype)


def moe_experts_ref(x: mx.array, gate: LinearParams, up: LinearParams, down: LinearParams, inds: mx.array,
                    weights: mx.array, shared: tuple | None = None, shared_mlp=shared_expert_ref) -> mx.array:
    """x [T, H], experts' gate / up [E, Im, H], down [E, H, Im], inds [T, k], weights [T, k (+1)] ->
    sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x) (+ weights[:, k] * shared(x)) [T, H]."""
    T, k = inds.shape
    g = gather_linear_ref(x, gate, inds)  # [T, k, Im]
    h = g * mx.sigmoid(g) * gather_linear_ref(x, up, inds)
    # down per (token, expert): each (t, j) row of h is a token of its own
    y = gather_linear_ref(h.reshape(T * k, -1), down, inds.reshape(T * k, 1))[:, 0, :]
    out = routed_sum(y.reshape(T, k, -1), weights, k, x.dtype)
    return plus_shared(out, None if shared is None else shared_mlp(x, shared), weights, k, x.dtype)


def moe_experts_sorted(x: mx.array, gate: LinearParams, up: LinearParams, down: LinearParams, inds: mx.array,
                       weights: mx.array, shared: tuple | None = None, shared_mlp=shared_expert_ref,
                       combine=combine_ref) -> mx.array:
    """moe_experts_ref with the (token, expert) pairs grouped by expert on the device: the flattened
    [T*k] ids sorted, x's rows gathered in that order, gather_qmm told the indices are sorted (it then
    walks each expert's weights once per segment), each pair's row read back from sorted order by
    `combine` (combine_ref's signature; ops.py passes the combine op). Prefill sizes."""
    T, k = inds.shape
    flat = inds.reshape(-1)
    order = mx.argsort(flat)  # [T*k]: pairs by expert
    unsort = mx.argsort(order)
    ids = flat[order]
    xs = x[order // k][:, None, :]  # [T*k, 1, H]: each pair's token row

    def proj(v, p):
        if not p.quantized:
            return mx.gather_mm(v, p.weight.swapaxes(-1, -2), rhs_indices=ids, sorted_indices=True)
        return mx.gather_qmm(v, p.weight, p.scales, p.biases, rhs_indices=ids, transpose=True,
                             group_size=p.group_size, bits=p.bits, sorted_indices=True)

    g = proj(xs, gate)  # [T*k, 1, Im]
    h = g * mx.sigmoid(g) * proj(xs, up)
    y = proj(h, down)[:, 0, :]  # [T*k, H], sorted order: pair p's row is unsort[p]
    return combine(y, unsort.astype(mx.int32), weights, k, None if shared is None else shared_mlp(x, shared),
                   dtype=x.dtype)
