"""Attention over paged KV: K/V of sequence i live in the blocks of its block table."""

from __future__ import annotations

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


def paged_attention_ref(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, layout: SeqLayout, scale: float
) -> mx.array:
    """q [T, nH, hd] -> [T, nH, hd]. Sequence i's queries sit at positions kv_valid[i] + t and see keys
    0 .. kv_valid[i] + t (causal inside the new tokens); query head h reads KV head h // (nH / nKV)."""
    nH, hd = q.shape[1], q.shape[2]
    nKV = k_pool.shape[2]
    rep = nH // nKV
    outs = []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        T, past = e - s, layout.kv_valid[i]
        L = past + T
        nb = (L + layout.block_tokens - 1) // layout.block_tokens
        table = mx.array(layout.block_tables[i][:nb], dtype=mx.int32)
        kk = k_pool[table].reshape(-1, nKV, hd)[:L].astype(mx.float32)  # [L, nKV, hd]
        vv = v_pool[table].reshape(-1, nKV, hd)[:L].astype(mx.float32)
        qq = q[s:e].astype(mx.float32).reshape(T, nKV, rep, hd)
        scores = mx.einsum("tgrd,lgd->grtl", qq, kk) * scale  # [nKV, rep, T, L]
        allowed = mx.arange(L)[None, :] <= (past + mx.arange(T))[:, None]  # [T, L]
        scores = mx.where(allowed, scores, -mx.inf)
        probs = mx.softmax(scores, axis=-1)
        o = mx.einsum("grtl,lgd->tgrd", probs, vv).reshape(T, nH, hd)
        outs.append(o.astype(q.dtype))
    return mx.concatenate(outs, axis=0)


def paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, layout: SeqLayout, scale: float) -> mx.array:
    kern = kernel_for("paged_attention")
    out = kern(q, k_pool, v_pool, layout, scale) if kern is not None else None
    return out if out is not None else paged_attention_ref(q, k_pool, v_pool, layout, scale)
