"""A GDN layer over a prefill chunk that crosses prefix-cache snapshot boundaries (SeqLayout.state_taps).

Why: the prefix cache snapshots the GDN state every `interval` tokens, and a step's kernels leave that
state only at the chunk's end. So without this every prefill chunk stops at the next boundary, which caps
chunks at the interval (512 tokens by default). That cap costs the 9B a quarter of its 4096-token prefill
rate and the 35B-A3B its larger grouped-GEMM tiles (benchmarks/prefix_cache.md).

Here the chunk runs whole through the projections, the conv, attention and the MLP. Only the delta rule runs
in pieces split at the taps:
  - each piece starts from the states the previous piece returned, and those states are the snapshots;
  - the conv state at a tap is the K-1 conv inputs before it (with the step's old conv rows when the tap lies
    fewer than K-1 tokens into the chunk).
The taps land in cache.gdn_taps[(state row, position)] as {"conv": {GDN layer: [1, K-1, C]}, "rec": {GDN
layer: [1, Hv, dv, dk]}}, for the step's snapshots (runtime/kv_manager.py StepSnapshots) to take.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels import SeqLayout, causal_conv1d, gated_delta_packed, gated_head_norm


def has_taps(layout: SeqLayout) -> bool:
    return layout.state_taps is not None and any(layout.state_taps)


def tapped_gdn(mixer, mixed: mx.array, z: mx.array, a: mx.array, b: mx.array, layout: SeqLayout, cache) -> mx.array:
    """GDNMixer's conv + delta rule + gated norm of a batch with taps -> out_proj's input [T, value_dim]; the
    pools get every sequence's state after its last token, cache.gdn_taps the states at the taps."""
    c, idx = mixer.c, mixer.idx
    conv_pool, rec_pool = cache.conv_states[idx], cache.rec_states[idx]
    slots = layout.array("state_rows")
    old_conv = conv_pool[slots]  # [B, K-1, C]: read before this step's write below
    y, conv_new = causal_conv1d(mixed, mixer.conv_w, conv_pool, layout)  # y [T, C]; conv_new [B, K-1, C]
    o = _delta_in_pieces(mixer, y, a, b, rec_pool, layout, cache)
    conv_pool[slots] = conv_new
    qsl, K1 = layout.query_start_loc, old_conv.shape[1]
    for i, taps in enumerate(layout.state_taps):
        for t in taps:  # the last K-1 conv inputs before the tap: old rows, then the chunk's own
            own = mixed[qsl[i] + max(0, t - K1) : qsl[i] + t].astype(old_conv.dtype)
            src = own if t >= K1 else mx.concatenate([old_conv[i], own])[-K1:]  # a graph node costs host time
            _tap(cache, layout, i, t, "conv", idx, src[None])
    return gated_head_norm(o, z, mixer.norm_w, c.rms_norm_eps, mixer.heads)


def _tap(cache, layout: SeqLayout, i: int, t: int, kind: str, idx: int, state: mx.array) -> None:
    """Sequence i's `kind` state of GDN layer idx after t tokens of its chunk, keyed by (state row, position)."""
    key = (layout.state_rows[i], layout.kv_valid[i] + t)
    cache.gdn_taps.setdefault(key, {"conv": {}, "rec": {}})[kind][idx] = state


@dataclass
class _Round:
    """Round j of the pieces: which sequences run their j-th piece, the packed rows it reads (a slice when
    one sequence runs), its layout (state rows: the pool's in round 0, the previous round's outputs after),
    and which members tap their state (another piece follows) or write it to the pool (their last)."""

    members: list[int]
    start: int  # the first packed row, when `rows` is None
    n: int  # rows in the round
    rows: mx.array | None  # [n] int32 packed rows (several sequences), None: contiguous from `start`
    layout: SeqLayout
    go_on: list[int]  # indices into members
    done: list[int]
    done_pool_rows: mx.array | None  # [len(done)] int32: the pool rows their final states go to
    done_idx: mx.array | None  # [len(done)] int32: their rows of the round's state output


def _rounds(layout: SeqLayout) -> tuple[list[_Round], mx.array | None]:
    """The rounds of `layout`'s taps and the gather that puts their outputs back in packed order (None: they
    are in order). The same for every GDN layer of the forward: built once (a graph node costs host time)."""
    qsl, B = layout.query_start_loc, layout.num_seqs
    cuts = [[0, *layout.state_taps[i], layout.q_len(i)] for i in range(B)]
    members, src_rows, j = list(range(B)), list(layout.state_rows), 0
    rounds, order = [], []
    while members:
        rows = [qsl[i] + t for i in members for t in range(cuts[i][j], cuts[i][j + 1])]
        q = [0]
        for i in members:
            q.append(q[-1] + cuts[i][j + 1] - cuts[i][j])
        lay = SeqLayout(q, [layout.kv_valid[i] + cuts[i][j] for i in members],
                        [layout.block_tables[i] for i in members], src_rows, layout.block_tokens)
        go_on = [n for n, i in enumerate(members) if j + 2 < len(cuts[i])]  # another piece follows
        done = [n for n, i in enumerate(members) if j + 2 >= len(cuts[i])]
        rounds.append(_Round(
            list(members), rows[0] if rows else 0, len(rows),
            None if len(members) == 1 else mx.array(rows, dtype=mx.int32), lay, go_on, done,
            mx.array([layout.state_rows[members[n]] for n in done], dtype=mx.int32) if done else None,
            mx.array(done, dtype=mx.int32) if done else None))
        order += rows
        members, src_rows, j = [members[n] for n in go_on], go_on, j + 1
    if order == list(range(len(order))):  # one sequence: the rounds' rows are in packed order already
        return rounds, None
    inverse = [0] * len(order)
    for k, row in enumerate(order):
        inverse[row] = k
    return rounds, mx.array(inverse, dtype=mx.int32)


def _delta_in_pieces(mixer, y, a, b, rec_pool, layout: SeqLayout, cache) -> mx.array:
    """The delta rule over the chunk, one launch per round of pieces: round j runs every sequence's j-th piece
    from the states of round j - 1 (round 0: the pool rows). -> o [T, Hv, dv]; final states into rec_pool."""
    rounds, inverse = layout.derived("gdn_tap_rounds", lambda: _rounds(layout))
    cuts_at = [[0, *layout.state_taps[i]] for i in range(layout.num_seqs)]
    src, outs = rec_pool, []
    for j, rd in enumerate(rounds):
        if rd.rows is None:  # one sequence's piece: contiguous rows, read through slices (views)
            yj, aj, bj = (x[rd.start : rd.start + rd.n] for x in (y, a, b))
        else:
            yj, aj, bj = y[rd.rows], a[rd.rows], b[rd.rows]
        o_j, st = gated_delta_packed(yj, aj, bj, mixer.A_log, mixer.dt_bias, src, rd.layout, mixer.heads)
        outs.append(o_j)
        for n in rd.go_on:
            i = rd.members[n]
            _tap(cache, layout, i, cuts_at[i][j + 1], "rec", mixer.idx, st[n : n + 1])
        if rd.done:
            rec_pool[rd.done_pool_rows] = st[rd.done_idx]
        src = st
    o = mx.concatenate(outs) if len(outs) > 1 else outs[0]
    return o if inverse is None else o[inverse]
