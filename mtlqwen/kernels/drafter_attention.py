"""DFlash drafter attention (dflash.md §1.4, §1.5): block queries over paged context K/V + the block's own K/V.

Unlike `paged_attention`, the newest keys (the block's) are not in the pools: they are transient, passed
in as arrays, and the block is non-causal unless the layer says otherwise. The context part is read from
the same paged bundles as the target's KV, through the sequence's block table.
"""

from __future__ import annotations

import mlx.core as mx

from .backend import kernel_for
from .paged_attention import gather_context, masked_gqa_attention
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
