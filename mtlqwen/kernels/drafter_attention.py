"""DFlash drafter attention (dflash.md §1.4, §1.5): block queries over paged context K/V + the block's own K/V.

Unlike `paged_attention`, the newest keys (the block's) are not in the pools: they are transient, passed
in as arrays, and the block is non-causal unless the layer says otherwise. The context part is read from
the same paged bundles as the target's KV, through the sequence's block table.
"""

from __future__ import annotations

import mlx.core as mx

from .backend import kernel_for
from .seqs import SeqLayout


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
    """q [T, nH, hd], k_blk / v_blk [T, nKV, hd] (the packed blocks), pools [num_blocks, block_tokens, nKV, hd]
    -> [T, nH, hd].

    Sequence i's block occupies rows query_start_loc[i]:query_start_loc[i+1] at positions P + j with
    P = kv_valid[i]; its committed context is pool rows 0..P-1 (via block_tables[i]). Key index = key
    position (context 0..P-1, then the block at P..). Masks: `causal` hides block keys after the query;
    `window` hides keys with query_pos - key_pos >= window (sliding layers). Head h reads KV head h // rep.
    """
    nH, hd = q.shape[1], q.shape[2]
    nKV = k_pool.shape[2]
    rep = nH // nKV
    bt = layout.block_tokens
    outs = []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        T, P = e - s, layout.kv_valid[i]
        kk = k_blk[s:e].astype(mx.float32)  # [T, nKV, hd]
        vv = v_blk[s:e].astype(mx.float32)
        if P > 0:
            table = mx.array(layout.block_tables[i][: (P + bt - 1) // bt], dtype=mx.int32)
            kc = k_pool[table].reshape(-1, nKV, hd)[:P].astype(mx.float32)  # [P, nKV, hd]
            vc = v_pool[table].reshape(-1, nKV, hd)[:P].astype(mx.float32)
            kk, vv = mx.concatenate([kc, kk], axis=0), mx.concatenate([vc, vv], axis=0)
        L = P + T
        qq = q[s:e].astype(mx.float32).reshape(T, nKV, rep, hd)
        scores = mx.einsum("tgrd,lgd->grtl", qq, kk) * scale  # [nKV, rep, T, L]
        qpos, kpos = (P + mx.arange(T))[:, None], mx.arange(L)[None, :]
        allowed = mx.ones((T, L), dtype=mx.bool_)
        if causal:
            allowed = allowed & (kpos <= qpos)
        if window is not None:
            allowed = allowed & (qpos - kpos < window)
        scores = mx.where(allowed, scores, -mx.inf)
        probs = mx.softmax(scores, axis=-1)
        o = mx.einsum("grtl,lgd->tgrd", probs, vv).reshape(T, nH, hd)
        outs.append(o.astype(q.dtype))
    return mx.concatenate(outs, axis=0)


def drafter_attention(
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
    kern = kernel_for("drafter_attention")
    out = kern(q, k_blk, v_blk, k_pool, v_pool, layout, scale, causal, window) if kern is not None else None
    return out if out is not None else drafter_attention_ref(q, k_blk, v_blk, k_pool, v_pool, layout, scale, causal, window)
