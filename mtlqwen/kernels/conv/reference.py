"""Causal depthwise conv1d + SiLU over the GDN qkv channels, carrying the last K-1 raw rows as state: the
reference twin."""

from __future__ import annotations

import mlx.core as mx

from ..seqs import SeqLayout


def causal_conv1d_ref(
    x: mx.array, w: mx.array, conv_pool: mx.array, layout: SeqLayout
) -> tuple[mx.array, mx.array]:
    """x [T, C] packed raw projections, w [C, K], conv_pool [S, K-1, C] (rows = sequence slots).
    Returns silu(conv(x)) [T, C] and each sequence's new state [B, K-1, C] (its last K-1 raw rows)."""
    K = w.shape[1]
    wf = w.astype(mx.float32)
    outs, states = [], []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        xs = mx.concatenate([conv_pool[layout.array("state_rows")[i]].astype(x.dtype), x[s:e]], axis=0)  # [K-1+T, C]
        T = e - s
        acc = mx.zeros((T, x.shape[1]), dtype=mx.float32)
        for j in range(K):
            acc = acc + xs[j : j + T].astype(mx.float32) * wf[:, j]
        outs.append((acc * mx.sigmoid(acc)).astype(x.dtype))
        states.append(xs[T:].astype(conv_pool.dtype))
    return mx.concatenate(outs, axis=0), mx.stack(states)
