"""The DFlash drafter's proposal and context write through `mx.compile` (compiled.py's rules, for dflash.py).

Why: the drafter pass is a few hundred small ops built in Python every speculative step (5.6 ms on the
H200 host at batch 1, benchmarks/spec.md), longer than its device time; a trace replays it from C++.

As in CompiledDecode, a trace takes every per-step quantity as an input array and its key holds what the
graph's structure depends on:
  proposal  sequences S, block rows B = n_draft + 1, block-table width (a power of two), the drafter's
            RoPE table size, block_tokens, whether logits are returned. Inputs: anchors [S], kv_valid [S],
            block tables [S, width]; the block's ids and positions are built inside from them. Attention
            reads every row of the padded tables, masked past kv_valid (drafter_attention's traced form).
  context   token rows rounded up to a power of two (CONTEXT_MIN_ROWS at least), RoPE size, block_tokens.
            Inputs: tap rows, positions, write blocks / offsets; the padding rows write into the engine's
            scratch bundle (never read), so commits of any acceptance share a few traces.
The drafter cache's pools go in and come out; the caller's DrafterCache is rebound to the outputs.
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import mlx.core as mx

from ..kernels import SeqLayout
from .compiled import _pow2_at_least, lookup_trace, padded_tables
from .dflash import Drafter, DrafterCache

CONTEXT_MIN_ROWS = 16


def padded_array(layout: SeqLayout, name: str, fill: int, pad: int) -> mx.array:
    """layout.array(name) [T] int32 followed by `pad` copies of `fill`: built on the host where the layout
    holds the values (one array, where a fill and a concatenation would be two launches and two graph nodes),
    else appended to the provided device array (a pipelined step's)."""
    if not pad:
        return layout.array(name)
    host = layout.host_values(name)
    if host is not None:
        return mx.array(host + [fill] * pad, dtype=mx.int32)
    return mx.concatenate([layout.array(name), mx.full((pad,), fill, dtype=mx.int32)])


class CompiledDraft:
    """`Drafter.propose` / `propose_with_logits` and `Drafter.write_context`, compiled per shape class.
    scratch_block: a block id of the drafter cache that nothing reads (the engine's padding bundle), where
    padding rows of a context write go; None: context writes are traced per exact row count. At most
    `max_traces` traces of each kind are kept (least recently used dropped)."""

    def __init__(self, drafter: Drafter, scratch_block: int | None = None, max_traces: int = 32):
        self.drafter, self.scratch_block, self.max_traces = drafter, scratch_block, max_traces
        self._propose: OrderedDict[tuple, object] = OrderedDict()
        self._context: OrderedDict[tuple, object] = OrderedDict()
        self.traces = 0  # traces built so far, of both kinds (tests and benchmarks read it)

    # ---- the proposal
    def propose(self, anchors, layout: SeqLayout, cache: DrafterCache, n_draft: int) -> mx.array:
        """Greedy proposals [S, n_draft] int32, as `Drafter.propose`."""
        return self._run_propose(anchors, layout, cache, n_draft, False)[0]

    def propose_with_logits(self, anchors, layout: SeqLayout, cache: DrafterCache, n_draft: int):
        """(greedy proposals [S, n_draft] int32, draft logits [S, n_draft, vocab]), as the drafter's."""
        return self._run_propose(anchors, layout, cache, n_draft, True)

    def _run_propose(self, anchors, layout: SeqLayout, cache: DrafterCache, n_draft: int, logits: bool):
        d = self.drafter
        # anchors and kv_valid may be device arrays (a pipelined step's, derived from the previous step's
        # accepted counts): the layout's host kv_valid then holds upper bounds, read only for the RoPE size
        if not isinstance(anchors, mx.array):
            anchors = mx.array([int(a) for a in anchors], dtype=mx.int32)
        if anchors.shape != (layout.num_seqs,):
            raise ValueError(f"{anchors.size} anchors for {layout.num_seqs} sequences")
        if n_draft < 1:
            raise ValueError("n_draft must be >= 1")
        S, B = layout.num_seqs, n_draft + 1
        width = _pow2_at_least(max(len(t) for t in layout.block_tables), 1)
        d.rope.ensure(max(layout.kv_valid) + B)  # the trace holds the table: its size is in the key
        key = (S, B, width, d.rope.size, layout.block_tokens, logits)
        fn, new = lookup_trace(self._propose, key, lambda: mx.compile(self._propose_fn(S, B, width, layout.block_tokens,
                                                                                     logits)), self.max_traces)
        self.traces += new
        inputs = [anchors.astype(mx.int32), layout.array("kv_valid"), padded_tables(layout.block_tables, width)]
        head, pools = fn(inputs, cache.arrays())
        self._rebind(cache, pools)
        return head[0], (head[1] if logits else None)

    def _propose_fn(self, S: int, B: int, width: int, block_tokens: int, logits: bool):
        d = self.drafter
        mask = d.config.mask_token_id

        def step(inputs, pools):
            anchors, kv_valid, tables = inputs
            ids = mx.concatenate([anchors[:, None], mx.full((S, B - 1), mask, dtype=mx.int32)], axis=1).reshape(-1)
            positions = (kv_valid[:, None] + mx.arange(B, dtype=mx.int32)[None, :]).reshape(-1)
            bl = SeqLayout.for_trace([i * B for i in range(S + 1)],
                                     {"positions": positions, "kv_valid": kv_valid, "block_tables": tables},
                                     block_tokens)
            view = self._view(pools)
            lg = d.head_logits(d.block_hidden(ids, bl, view))  # as Drafter.propose: the argmax of the logits
            return [mx.argmax(lg, axis=-1).astype(mx.int32)] + ([lg] if logits else []), view.arrays()

        return step

    # ---- the context write
    def write_context(self, tap_feat: mx.array, layout: SeqLayout, cache: DrafterCache,
                      rows: list[int] | None = None) -> None:
        """As `Drafter.write_context(tap_feat[rows], layout, cache)` (rows None: every row of tap_feat)."""
        d = self.drafter
        T = layout.num_tokens
        if (len(rows) if rows is not None else tap_feat.shape[0]) != T:
            raise ValueError(f"{T if rows is None else len(rows)} tap rows but the layout packs {T} tokens")
        if T == 0:
            return
        d.rope.ensure(max(kv + layout.q_len(i) for i, kv in enumerate(layout.kv_valid)))
        pad = 0 if self.scratch_block is None else _pow2_at_least(T, CONTEXT_MIN_ROWS) - T
        if rows is not None or pad:
            idx = (list(range(T)) if rows is None else list(rows)) + [0] * pad
            tap_feat = tap_feat[mx.array(idx, dtype=mx.int32)]
        # the layout's arrays, padding rows into the scratch
        fill = [(0, "positions"), (self.scratch_block, "write_blocks"), (0, "write_offsets")]
        inputs = [tap_feat] + [padded_array(layout, name, v, pad) for v, name in fill]
        key = (T + pad, d.rope.size, layout.block_tokens)
        fn, new = lookup_trace(self._context, key, lambda: mx.compile(self._context_fn(T + pad, layout.block_tokens)),
                               self.max_traces)
        self.traces += new
        self._rebind(cache, fn(inputs, cache.arrays()))

    def _context_fn(self, T: int, block_tokens: int):
        d = self.drafter

        def step(inputs, pools):
            tap_feat, positions, blocks, offsets = inputs
            lay = SeqLayout([0, T], [0], [[0]], [0], block_tokens, traced=True)
            for name, a in (("positions", positions), ("write_blocks", blocks), ("write_offsets", offsets)):
                lay.provide(name, a)
            view = self._view(pools)
            d.write_rows(tap_feat, lay, view)
            return view.arrays()

        return step

    # ---- pools
    def _view(self, pools):
        """A stand-in DrafterCache over the trace's pool inputs; the drafter's writes rebind its lists."""
        L = len(pools) // 2
        view = SimpleNamespace(k_pools=list(pools[:L]), v_pools=list(pools[L:]))
        view.arrays = lambda: [*view.k_pools, *view.v_pools]
        return view

    @staticmethod
    def _rebind(cache: DrafterCache, pools) -> None:
        L = len(cache.k_pools)
        cache.k_pools[:], cache.v_pools[:] = pools[:L], pools[L:]
