"""Packing a step plan into the model's inputs: token ids, a SeqLayout and the rows to score.

Anchors sampled by the step still in flight are not on the host yet: their ids are gathered on the
device from that step's token array, so building step N+1 never waits for step N.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..kernels import SeqLayout
from .block_pool import BlockPool
from .scheduler import ScheduledSeq, StepPlan
from .sequence import Sequence


def token_buckets(step_tokens: int) -> list[int]:
    """Padded step sizes: powers of two below the budget, then the budget (so padding < 2x)."""
    out, n = [], 1
    while n < step_tokens:
        out.append(n)
        n *= 2
    return out + [step_tokens]


@dataclass
class PackedBatch:
    input_ids: mx.array  # [T (+ padding)] int32
    layout: SeqLayout
    logits_rows: mx.array | None  # [R] packed rows to score, None when no sequence samples
    sampling: list[ScheduledSeq]  # one per logits row
    reset_slots: list[int]  # slots whose GDN state is zeroed before the step
    num_tokens: int  # real tokens
    padding: int = 0


def pack(
    plan: StepPlan,
    block_tokens: int,
    prev_rows: dict[Sequence, int] | None = None,
    prev_tokens: mx.array | None = None,
    buckets: list[int] | None = None,
    scratch: tuple[int, int] | None = None,
    boundaries=None,
) -> PackedBatch:
    """prev_rows / prev_tokens: the in-flight step's sampled tokens and each sequence's row in them.
    buckets + scratch (slot, block): pad T up to a bucket with a dummy sequence that owns the scratch
    slot and block, so the padding writes only there and no real sequence sees it. boundaries(start, end):
    the snapshot boundaries inside a chunk whose GDN states the step must leave (KVManager.boundaries_in,
    when the cache takes them in the step), set as the layout's state_taps."""
    ids: list[int] = []
    anchor_at, anchor_src = [], []
    qsl, kv_valid, tables, rows = [0], [], [], []
    logits_rows, sampling, reset = [], [], []
    for s in plan.scheduled:
        seq = s.seq
        for p in range(s.start, s.start + s.num_tokens - s.drafts):
            if p < len(seq.tokens):
                ids.append(seq.tokens[p])
            else:  # the anchor the in-flight step is sampling
                anchor_at.append(len(ids))
                anchor_src.append(prev_rows[seq])
                ids.append(0)
        ids.extend([0] * s.drafts)  # a verification's draft slots: speculative.py scatters the proposals in
        qsl.append(len(ids))
        kv_valid.append(s.start)
        tables.append(list(seq.block_table))
        rows.append(seq.slot)
        if s.fresh:
            reset.append(seq.slot)
        if s.samples and not s.drafts:  # a verification's rows are scored by speculative.py
            logits_rows.append(len(ids) - 1)
            sampling.append(s)
    num_tokens, pad = len(ids), 0
    if buckets and scratch is not None:
        pad = next((b for b in buckets if b >= num_tokens), num_tokens) - num_tokens
    if pad:
        slot, block = scratch
        ids.extend([0] * pad)
        qsl.append(len(ids))
        kv_valid.append(0)
        tables.append([block] * BlockPool.blocks_for(pad, block_tokens))
        rows.append(slot)
        reset.append(slot)  # keeps the scratch state from drifting over many steps
    input_ids = mx.array(ids, dtype=mx.int32)
    if anchor_at:
        input_ids[mx.array(anchor_at)] = prev_tokens[mx.array(anchor_src)]
    layout = SeqLayout(qsl, kv_valid, tables, rows, block_tokens)
    if boundaries is not None:
        taps = [[b - s.start for b in boundaries(s.start, s.start + s.num_tokens)] for s in plan.scheduled]
        if any(taps):
            layout.state_taps = taps + [[]] * (len(kv_valid) - len(plan.scheduled))
    if any(s.drafts for s in plan.scheduled):
        layout.verify = [s.drafts > 0 for s in plan.scheduled] + [False] * (len(kv_valid) - len(plan.scheduled))
    lr = mx.array(logits_rows, dtype=mx.int32) if logits_rows else None
    return PackedBatch(input_ids, layout, lr, sampling, reset, num_tokens, pad)
