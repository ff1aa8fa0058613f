"""The drafter's context rows of plain decode steps, held back while nobody drafts (speculative.py).

Each row a step computes becomes drafter context: the target's taps there, projected into every drafter
layer's K/V at that position (Drafter.write_context). Written every step, that is a graph of its own beside
each plain decode step, and a step with the drafter loaded and nobody drafting cost 1.1-2.2 ms more than the
plain engine's on the H200 (benchmarks/spec.md). While the steps are plain decodes, the backlog keeps their
tap rows instead (a reference to each step's taps array, nothing copied or launched) and writes them all in
one context write (`take`), which the Speculator runs:
  - before any proposal: a step that verifies, scheduled or pipelined (the drafter reads its context);
  - in a step that writes context of its own (prefill chunks) or captures a prefix snapshot (an entry shares
    the blocks and copies their partial one, drafter rows included, for whoever restores it);
  - before a finishing sequence's turn entry is kept, for the same reason;
  - in the step after a sequence came to hold LIMIT rows (the taps' memory; LIMIT x S rows are one write of
    one trace), before that step's own graph.
A row is written only while its sequence still owns the block it was computed for (not finished, cancelled,
preempted or restarted since), so a stale row never lands in a block another sequence owns now.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

from ..kernels import SeqLayout
from .sequence import SeqStatus

LIMIT = 16  # rows a sequence may hold back before the backlog is written


@dataclass
class _Row:
    taps: mx.array  # [T, F] the taps of the step that computed the row (its row `index`)
    index: int
    seq: object  # the Sequence
    position: int
    block: int  # seq.block_table[position // block_tokens] when the row was computed
    incarnation: int  # seq.num_preemptions then: a recomputed sequence's rows are its new ones


class ContextBacklog:
    """Tap rows whose drafter context is not written yet, in the order they were computed."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self.rows: list[_Row] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, taps: mx.array, scheduled) -> None:
        """Hold the rows of a step in which every scheduled sequence computes one token: row i of taps
        [T, F] (T may include padding rows past them) is scheduled[i]'s, at position start."""
        bt = self.block_tokens
        for i, s in enumerate(scheduled):
            seq = s.seq
            self.rows.append(_Row(taps, i, seq, s.start, seq.block_table[s.start // bt], seq.num_preemptions))

    def held(self) -> Counter:
        """Rows held, by Sequence."""
        return Counter(r.seq for r in self.rows)

    def holds(self, seq) -> bool:
        return any(r.seq is seq for r in self.rows)

    def full(self) -> bool:
        return bool(self.rows) and max(self.held().values()) >= LIMIT

    def _valid(self, r: _Row) -> bool:
        seq = r.seq
        table = seq.block_table
        k = r.position // self.block_tokens
        return (seq.status is SeqStatus.RUNNING and seq.num_preemptions == r.incarnation
                and r.position < seq.kv_valid and k < len(table) and table[k] == r.block)

    def take(self) -> tuple[mx.array, SeqLayout] | None:
        """Empty the backlog: (tap rows [R, F], a layout of R one-token sequences at their positions and
        blocks) for Drafter.write_context, or None when no held row is still valid."""
        rows = [r for r in self.rows if self._valid(r)]
        self.rows = []
        if not rows:
            return None
        parts, run = [], []  # consecutive rows of one step's taps: one slice each, else a gather
        for r in rows:
            if run and run[-1].taps is r.taps and run[-1].index + 1 == r.index:
                run.append(r)
            else:
                if run:
                    parts.append(run)
                run = [r]
        parts.append(run)
        feats = mx.concatenate([p[0].taps[p[0].index : p[-1].index + 1] for p in parts], axis=0)
        layout = SeqLayout(list(range(len(rows) + 1)), [r.position for r in rows],
                           [list(r.seq.block_table) for r in rows], [0] * len(rows), self.block_tokens)
        return feats, layout

    def drop(self, seq) -> None:
        """Forget seq's rows (it finished and nothing will read them)."""
        self.rows = [r for r in self.rows if r.seq is not seq]

    def clear(self) -> None:
        self.rows = []
