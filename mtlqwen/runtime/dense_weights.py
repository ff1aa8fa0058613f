"""Dequantized copies of the decoder's quantized projections, kept in memory for the GEMMs that run past
qgemm's rows (prefill chunks, wide verifications).

Such a GEMM dequantizes its weights at every step (kernels/qmatmul/gemv.py: one launch per projection group
of one input, then cuBLAS): on the 9B at 4-bit that is ~130 launches and ~6 ms of device time a step,
whatever the step's tokens, so it weighs most on short prefill steps (a prefix-cache hit's remainder). The
copies cost memory instead: the dequantized size of every projection (bf16: 4x the 4-bit weights). They
are built with the kernel the step would run (bit-identical GEMM inputs) in the order the model stacks
them: a GDN layer's four input projections, attention's q / k / v, an MLP's gate + up.

Engine(dense_weights=None) keeps them where it measured the gain (the CUDA kernels) and they fit in
DENSE_SHARE of the device memory the weights leave; True / False force it where the GPU kernels run.
"""

from __future__ import annotations

import mlx.core as mx

from ..kernels import LinearParams, gpu_backend, use_kernels
from ..kernels.qmatmul import dequant
from ..model.qwen35 import DenseMLP, GDNMixer
from .memory import GPU_MEMORY_FRACTION, device_memory

DENSE_SHARE = 1 / 3  # of the device memory left after the weights: the rest stays for the KV pool and activations


def projection_groups(model) -> list[list[LinearParams]]:
    """The quantized projections the decoder's layers call with one input, in their call order (gemv's stacks
    must match it): GDN in_proj qkv | z | b | a, attention q | k | v, an MLP's gate | up; out / o / down
    alone. An MoE block's experts are not in it (their own grouped kernels never dequantize a whole matrix)."""
    groups = []
    for layer in model.layers:
        m = layer.mixer
        if isinstance(m, GDNMixer):
            groups += [[m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a], [m.out_proj]]
        else:
            groups += [[m.q_proj, m.k_proj, m.v_proj], [m.out_proj]]
        if isinstance(layer.mlp, DenseMLP):
            groups += [[layer.mlp.gate_proj, layer.mlp.up_proj], [layer.mlp.down_proj]]
    return [g for g in groups if all(p.quantized for p in g)]


def dense_bytes(model) -> int:
    """Bytes the copies take (each in its scales' dtype)."""
    return sum(p.out_features * p.in_features * p.scales.dtype.size for g in projection_groups(model) for p in g)


def kept_bytes(model) -> int:
    """Bytes of the copies the model holds now."""
    return sum(p.dense.nbytes for g in projection_groups(model) for p in g if p.dense is not None)


def _dequantized(g: list[LinearParams]) -> list[mx.array]:
    """g's dense matrices as one step would dequantize them: stacked where gemv stacks them (one matrix)."""
    dt = g[0].scales.dtype
    kernel = gpu_backend() is not None and use_kernels()
    if len(g) > 1 and dequant.stackable(g, dt):  # off the kernels: MLX's dequantize, the reference's values
        return [dequant.dequantize_stack(g, dt) if kernel else mx.concatenate([p.dequantized() for p in g])]
    return [dequant.dequantize(p, dt) if kernel and dequant.supported(p, dt) else p.dequantized().astype(dt)
            for p in g]


def keep_dense_weights(model, on: bool) -> int:
    """Attach (on) or drop the copies; returns the bytes held. Idempotent: an engine built on a model that
    another engine equipped reuses its copies."""
    for g in projection_groups(model):
        if not on:
            for p in g:
                p.dense = p.dense_stack = p.dense_t = p.dense_stack_t = None
            continue
        if g[0].dense is not None:
            continue
        mats = _dequantized(g)
        mx.eval(mats)  # one group at a time: the peak is one group's matrices, not the model's
        attach(g, mats)
        mx.eval(views(g))
    return kept_bytes(model)


def attach(g: list[LinearParams], mats: list[mx.array]) -> None:
    """g's copies from one stacked matrix [sum out, in] (each projection a row range of it, a view of its
    buffer, with dense_stack naming its place) or one matrix a projection; and their transposes (views too:
    evaluate `views(g)` once, so no step builds them)."""
    if len(mats) == 1 and len(g) > 1:
        w, r = mats[0], 0
        wt = w.T
        for i, p in enumerate(g):
            p.dense, p.dense_stack = w[r:r + p.out_features], (w, i)
            p.dense_t, p.dense_stack_t = p.dense.T, wt
            r += p.out_features
        return
    for p, w in zip(g, mats):
        p.dense, p.dense_stack, p.dense_t, p.dense_stack_t = w, None, w.T, None


def views(g: list[LinearParams]) -> list[mx.array]:
    """The arrays attach() gave g: the copies and their transposes (to evaluate once)."""
    return [a for p in g for a in (p.dense, p.dense_t, p.dense_stack_t) if a is not None]


def resolve(model, setting: bool | None) -> bool:
    """Engine(dense_weights=setting): never off the GPU kernels (the CPU references read the quantized weights,
    so copies would only take memory); there True / False as given; None: on with the CUDA kernels when the
    copies fit in DENSE_SHARE of the usable device memory left after what is allocated now (the weights)."""
    if not use_kernels():
        return False
    if setting is not None:
        return setting
    if gpu_backend() != "cuda":
        return False
    total, free = device_memory()
    if total is None:
        return False
    left = total * GPU_MEMORY_FRACTION - mx.get_active_memory()
    if free is not None:
        left = min(left, free * GPU_MEMORY_FRACTION)
    return dense_bytes(model) - kept_bytes(model) <= DENSE_SHARE * left  # (0: kept already, by another engine)
