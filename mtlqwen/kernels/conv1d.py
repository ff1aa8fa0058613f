"""Causal depthwise conv1d + SiLU over the GDN qkv channels, carrying the last K-1 raw rows as state."""

from __future__ import annotations

import mlx.core as mx

from .backend import kernel_for
from .seqs import SeqLayout


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


def causal_conv1d(x: mx.array, w: mx.array, conv_pool: mx.array, layout: SeqLayout,
                  write_state: bool = False) -> tuple[mx.array, mx.array | None]:
    """-> (y, new states [B, K-1, C]) for the caller's scatter, or -- write_state, and the GPU kernel with
    SELECT["conv_state_inplace"] took it (as `gated_delta_packed`'s write_state) -- (y, None): the states
    are already in conv_pool's rows. The pool array is then unchanged as a graph node while its contents
    changed, and MLX orders kernels only through data: the caller makes every later reader of the pool
    depend on this launch (GDNMixer rebinds the pool to `mx.depends(pool, y)`)."""
    kern = kernel_for("causal_conv1d")
    out = kern(x, w, conv_pool, layout, write_state) if kern is not None else None
    return out if out is not None else causal_conv1d_ref(x, w, conv_pool, layout)
