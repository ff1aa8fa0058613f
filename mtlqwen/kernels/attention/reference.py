"""Attention over paged KV (K/V of sequence i live in the blocks of its block table), the functional KV
write, and the DFlash drafter's attention: the reference twins."""

from __future__ import annotations

import mlx.core as mx

from ..seqs import SeqLayout


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


def paged_attention_gated_ref(q, k_pool, v_pool, layout: SeqLayout, scale: float, gate: mx.array) -> mx.array:
    """Attention, then the output gate of docs/qwen35.md §3.6: o * sigmoid(gate), gate [T, nH*hd] or
    the q|gate projection [T, nH, 2*hd] (gate = each head's second half)."""
    o = paged_attention_ref(q, k_pool, v_pool, layout, scale)
    if gate.ndim == 3 and gate.shape[-1] == 2 * q.shape[-1]:
        gate = gate[..., q.shape[-1]:]
    g = gate.reshape(o.shape).astype(mx.float32)
    return (o.astype(mx.float32) * mx.sigmoid(g)).astype(q.dtype)


def drafter_attention_ref(
    q: mx.array,
    k_blk: mx.array,
    v_blk: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    layout: SeqLayout,
    scale: float,
    causal: bool = False,
    window: int | None = None,
) -> mx.array:
    """DFlash drafter attention (dflash.md §1.4, §1.5): unlike `paged_attention_ref`, the newest keys (the
    block's) are not in the pools but passed in, and the block is non-causal unless the layer says so.
    q [T, nH, hd], k_blk / v_blk [T, nKV, hd] (the packed blocks), pools [num_blocks, block_tokens, nKV, hd]
    -> [T, nH, hd].

    Sequence i's block occupies rows query_start_loc[i]:query_start_loc[i+1] at positions P + j with
    P = kv_valid[i]; its committed context is pool rows 0..P-1 (via block_tables[i]). Key index = key
    position (context 0..P-1, then the block at P..). Masks: `causal` hides block keys after the query;
    `window` hides keys with query_pos - key_pos >= window (sliding layers). Head h reads KV head h // rep.
    """
    if layout.traced:
        return _drafter_attention_traced(q, k_blk, v_blk, k_pool, v_pool, layout, scale, causal, window)
    bt = layout.block_tokens
    outs = []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        T, P = e - s, layout.kv_valid[i]
        kk = k_blk[s:e].astype(mx.float32)  # [T, nKV, hd]
        vv = v_blk[s:e].astype(mx.float32)
        if P > 0:  # committed context first: key index = key position
            kk = mx.concatenate([gather_context(k_pool, layout.block_tables[i], P, bt), kk], axis=0)
            vv = mx.concatenate([gather_context(v_pool, layout.block_tables[i], P, bt), vv], axis=0)
        qpos, kpos = (P + mx.arange(T))[:, None], mx.arange(P + T)[None, :]
        allowed = mx.ones((T, P + T), dtype=mx.bool_)
        if causal:
            allowed = allowed & (kpos <= qpos)
        if window is not None:
            allowed = allowed & (qpos - kpos < window)
        outs.append(masked_gqa_attention(q[s:e], kk, vv, allowed, scale))
    return mx.concatenate(outs, axis=0)


def _drafter_attention_traced(q, k_blk, v_blk, k_pool, v_pool, layout: SeqLayout, scale: float, causal: bool,
                              window: int | None) -> mx.array:
    """`drafter_attention_ref` with shapes that do not depend on kv_valid (for `mx.compile`): each block reads
    every context row of its (padded) table row, masked from P = kv_valid on, then its own keys."""
    tables, kv_valid = layout.array("block_tables"), layout.array("kv_valid")
    outs = []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        T, P = e - s, kv_valid[i]
        ctx_k = k_pool[tables[i]].reshape(-1, *k_pool.shape[2:]).astype(mx.float32)  # [W * bt, nKV, hd]
        ctx_v = v_pool[tables[i]].reshape(-1, *v_pool.shape[2:]).astype(mx.float32)
        C = ctx_k.shape[0]
        kk = mx.concatenate([ctx_k, k_blk[s:e].astype(mx.float32)], axis=0)
        vv = mx.concatenate([ctx_v, v_blk[s:e].astype(mx.float32)], axis=0)
        j = mx.arange(T)[:, None]  # query j sits at P + j
        ctx_pos, blk = mx.arange(C)[None, :], mx.arange(T)[None, :]
        ctx_ok = ctx_pos < P
        blk_ok = blk <= j if causal else mx.ones((T, T), dtype=mx.bool_)
        if window is not None:
            ctx_ok = ctx_ok & (P + j - ctx_pos < window)
            blk_ok = blk_ok & (j - blk < window)
        allowed = mx.concatenate([mx.broadcast_to(ctx_ok, (T, C)), blk_ok], axis=1)
        outs.append(masked_gqa_attention(q[s:e], kk, vv, allowed, scale))
    return mx.concatenate(outs, axis=0)
