"""Attention over paged KV: K/V of sequence i live in the blocks of its block table."""

from __future__ import annotations

import os

import mlx.core as mx

from .backend import kernel_for
from .seqs import SeqLayout


def write_kv(
    k_pool: mx.array, v_pool: mx.array, k: mx.array, v: mx.array, layout: SeqLayout
) -> tuple[mx.array, mx.array]:
    """Scatter the new tokens' k, v [T, nKV, hd] into pools [num_blocks, block_tokens, nKV, hd].
    The scatter reuses the pool's buffer when the caller holds the only reference (no pool copy)."""
    blocks, offsets = layout.array("write_blocks"), layout.array("write_offsets")
    k_pool[blocks, offsets] = k.astype(k_pool.dtype)
    v_pool[blocks, offsets] = v.astype(v_pool.dtype)
    return k_pool, v_pool


def gather_context(pool: mx.array, table: list[int], n: int, block_tokens: int) -> mx.array:
    """The first n cached rows of one sequence, fp32: [n, nKV, hd] from pool [num_blocks, bt, nKV, hd]."""
    blocks = mx.array(table[: (n + block_tokens - 1) // block_tokens], dtype=mx.int32)
    return pool[blocks].reshape(-1, *pool.shape[2:])[:n].astype(mx.float32)


def masked_gqa_attention(q: mx.array, k: mx.array, v: mx.array, allowed: mx.array, scale: float) -> mx.array:
    """q [T, nH, hd], k / v [L, nKV, hd], allowed [T, L] -> [T, nH, hd] in q's dtype; softmax in fp32.
    Query head h reads KV head h // (nH / nKV)."""
    T, nH, hd = q.shape
    nKV = k.shape[1]
    qq = q.astype(mx.float32).reshape(T, nKV, nH // nKV, hd)
    scores = mx.einsum("tgrd,lgd->grtl", qq, k) * scale  # [nKV, rep, T, L]
    probs = mx.softmax(mx.where(allowed, scores, -mx.inf), axis=-1)
    return mx.einsum("grtl,lgd->tgrd", probs, v).reshape(T, nH, hd).astype(q.dtype)


def paged_attention_ref(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, layout: SeqLayout, scale: float
) -> mx.array:
    """q [T, nH, hd] -> [T, nH, hd]. Sequence i's queries sit at positions kv_valid[i] + t and see keys
    0 .. kv_valid[i] + t (causal inside the new tokens); query head h reads KV head h // (nH / nKV)."""
    if layout.traced:
        return _paged_attention_traced(q, k_pool, v_pool, layout, scale)
    outs = []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        T, past = e - s, layout.kv_valid[i]
        L = past + T
        kk = gather_context(k_pool, layout.block_tables[i], L, layout.block_tokens)
        vv = gather_context(v_pool, layout.block_tables[i], L, layout.block_tokens)
        allowed = mx.arange(L)[None, :] <= (past + mx.arange(T))[:, None]  # [T, L]
        outs.append(masked_gqa_attention(q[s:e], kk, vv, allowed, scale))
    return mx.concatenate(outs, axis=0)


def _paged_attention_traced(q, k_pool, v_pool, layout: SeqLayout, scale: float) -> mx.array:
    """`paged_attention_ref` with shapes that do not depend on kv_valid (for `mx.compile`): each sequence
    reads every block of its (padded) table row and masks keys past kv_valid + t."""
    tables, kv_valid = layout.array("block_tables"), layout.array("kv_valid")
    outs = []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        kk = k_pool[tables[i]].reshape(-1, *k_pool.shape[2:]).astype(mx.float32)  # [W * bt, nKV, hd]
        vv = v_pool[tables[i]].reshape(-1, *v_pool.shape[2:]).astype(mx.float32)
        allowed = mx.arange(kk.shape[0])[None, :] <= (kv_valid[i] + mx.arange(e - s))[:, None]
        outs.append(masked_gqa_attention(q[s:e], kk, vv, allowed, scale))
    return mx.concatenate(outs, axis=0)


def paged_attention(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, layout: SeqLayout, scale: float, after: mx.array | None = None
) -> mx.array:
    """`after`: the token of `write_kv_inplace` (given only when `write_kv_inplace` returned one)."""
    kern = kernel_for("paged_attention")
    out = kern(q, k_pool, v_pool, layout, scale, after) if kern is not None else None
    return out if out is not None else paged_attention_ref(q, k_pool, v_pool, layout, scale)


def paged_attention_gated_ref(q, k_pool, v_pool, layout: SeqLayout, scale: float, gate: mx.array) -> mx.array:
    """Attention, then the output gate of docs/qwen35.md §3.6: o * sigmoid(gate), gate [T, nH*hd] or
    the q|gate projection [T, nH, 2*hd] (gate = each head's second half)."""
    o = paged_attention_ref(q, k_pool, v_pool, layout, scale)
    if gate.ndim == 3 and gate.shape[-1] == 2 * q.shape[-1]:
        gate = gate[..., q.shape[-1]:]
    g = gate.reshape(o.shape).astype(mx.float32)
    return (o.astype(mx.float32) * mx.sigmoid(g)).astype(q.dtype)


def paged_attention_gated(
    q, k_pool, v_pool, layout: SeqLayout, scale: float, gate: mx.array, after: mx.array | None = None
) -> mx.array:
    """`paged_attention` with the sigmoid output gate applied inside the kernel (no separate ops)."""
    kern = kernel_for("paged_attention_gated")
    out = kern(q, k_pool, v_pool, layout, scale, gate, after) if kern is not None else None
    return out if out is not None else paged_attention_gated_ref(q, k_pool, v_pool, layout, scale, gate)


def write_kv_inplace(
    k_pool: mx.array, v_pool: mx.array, k: mx.array, v: mx.array, layout: SeqLayout, q_shape, q_dtype
) -> mx.array | None:
    """On GPU back-ends: write k, v [T, nKV, hd] into the pools' own buffers (no pool copy) and return a
    token that `paged_attention(..., after=token)` takes so it runs after the write. None when that path
    does not apply (CPU, or an attention the kernel does not cover): then use `write_kv`."""
    if os.environ.get("MTLQWEN_KV_INPLACE", "1") == "0":  # debugging switch: the functional scatter
        return None
    kern, covers = kernel_for("write_kv_inplace"), kernel_for("paged_attention_covers")
    if kern is None or covers is None or not covers(q_shape, q_dtype, k_pool, v_pool, layout):
        return None
    return kern(k_pool, v_pool, k, v, layout)
