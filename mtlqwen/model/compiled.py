"""Decode and verification forwards through `mx.compile`: traced once per shape class, replayed every step.

Why: on the H200 host, building the batch-1 Qwen3.5-9B graph in Python takes ~6 ms, twice the device
time of the step (benchmarks/decode_profile.md); a compiled step replays the recorded graph from C++.

What may change between replays is array *values* only. So the trace takes every per-step quantity as
an input array (ids, positions, KV write slots, state rows, kv_valid, block tables, logits rows) and
its key holds everything the graph's structure depends on: tokens per sequence, the block-table width
and the attention length bound (both bucketed to powers of two so a trace serves many steps), the
RoPE table size. Its layout's kv_valid / block_tables / state_rows lists are dummies: an op that read
a value from them would bake the first step's value in (SeqLayout.traced tells ops to use the arrays).
The pools go in and come out; the caller rebinds its cache to the outputs.
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import mlx.core as mx

from ..kernels import SeqLayout
from .cache import GDNStash, VerifyStash

_INPUTS = ("positions", "write_blocks", "write_offsets", "state_rows", "query_start_loc", "kv_valid")


def _pow2_at_least(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def padded_tables(block_tables: list[list[int]], width: int) -> mx.array:
    """Block tables [B, width] int32, each row padded with block 0 (masked out by kv_valid)."""
    return mx.array([t + [0] * (width - len(t)) for t in block_tables], dtype=mx.int32)


def lookup_trace(fns: OrderedDict, key: tuple, build, max_traces: int) -> tuple[object, bool]:
    """(the compiled function of `key`, whether it was built now): build() makes it on a miss; at most
    max_traces are kept, the least recently used dropped."""
    fn = fns.get(key)
    if fn is not None:
        fns.move_to_end(key)
        return fn, False
    fn = fns[key] = build()
    if len(fns) > max_traces:
        fns.popitem(last=False)
    return fn, True


class CompiledDecode:
    """`model.forward` for batches whose sequences all send one token (decode), compiled per shape class;
    `with_taps` does `model.forward_with_taps` for the speculative engine's decode batches and `verifying`
    does `model.forward_verifying` for its batches in which every sequence verifies, and `commit` its
    candidate pick by the device's accepted counts. At most `max_traces` traces of each kind are kept
    (least recently used dropped)."""

    MIN_LEN = 256  # attention length bound never below this: short contexts share one trace

    def __init__(self, model, max_traces: int = 32):
        self.model, self.max_traces = model, max_traces
        self._fns: OrderedDict[tuple, object] = OrderedDict()
        self._commits: OrderedDict[tuple, object] = OrderedDict()  # candidate picks (commit)
        self.traces = 0  # traces built so far (a new key; tests and benchmarks read it)

    @staticmethod
    def eligible(layout: SeqLayout) -> bool:
        return layout.verify is None and layout.num_seqs > 0 and layout.num_tokens == layout.num_seqs

    @classmethod
    def eligible_with_taps(cls, layout: SeqLayout) -> bool:
        """Decode batches, and batches in which every sequence verifies (any number of tokens each)."""
        return cls.eligible(layout) or (layout.verify is not None and layout.num_seqs > 0 and all(layout.verify))

    def __call__(self, input_ids: mx.array, layout: SeqLayout, cache, logits_rows: mx.array | None) -> mx.array:
        """Logits as `Qwen35Model.forward`; `cache`'s pools are rebound to the step's outputs."""
        return self._run(input_ids, layout, cache, logits_rows, None)[0]

    def with_taps(self, input_ids, layout: SeqLayout, cache, taps: tuple[int, ...], logits_rows: mx.array | None):
        """(logits, taps) as `Qwen35Model.forward_with_taps`."""
        return self._run(input_ids, layout, cache, logits_rows, tuple(taps))[:2]

    def verifying(self, input_ids, layout: SeqLayout, cache, taps: tuple[int, ...], logits_rows: mx.array | None,
                  verify_commit: str = "candidates"):
        """(logits, taps, VerifyStash) as `Qwen35Model.forward_verifying`, the stash holding the real layout."""
        if not layout.verify or not all(layout.verify):
            raise ValueError("CompiledDecode.verifying needs a batch in which every sequence verifies")
        return self._run(input_ids, layout, cache, logits_rows, tuple(taps), verify_commit)

    def commit(self, cache, stash: VerifyStash, accepted: mx.array) -> None:
        """`model.commit_candidates(cache, stash, accepted)` of a "candidates" verification by the device's
        accepted counts [S] int32, compiled per (sequences, verify rows); the state pools are rebound."""
        lay = stash.layout
        if stash.mode != "candidates" or not isinstance(accepted, mx.array) or accepted.shape != (lay.num_seqs,):
            raise ValueError("CompiledDecode.commit picks candidates by a device array of one count per sequence")
        if stash.committed:
            raise RuntimeError("this verification was committed already")
        n_gdn = len(cache.conv_states)
        fn, new = lookup_trace(self._commits, (lay.num_seqs, lay.num_tokens), lambda: mx.compile(self._commit_fn(n_gdn)),
                               self.max_traces)
        self.traces += new
        starts, slots = mx.array(lay.query_start_loc[:-1], dtype=mx.int32), mx.array(lay.state_rows, dtype=mx.int32)
        trees = [stash.layers[i].tree() for i in range(n_gdn)]
        conv, rec = fn(trees, [accepted, starts, slots], cache.conv_states, cache.rec_states)
        cache.conv_states[:], cache.rec_states[:] = conv, rec
        stash.committed = True

    def _commit_fn(self, n_gdn: int):
        model = self.model

        def step(trees, rows, conv, rec):
            view = SimpleNamespace(conv_states=list(conv), rec_states=list(rec))
            model.pick_candidates(view, {i: GDNStash.from_tree(t) for i, t in enumerate(trees)}, *rows)
            return view.conv_states, view.rec_states

        return step

    def _run(self, input_ids, layout: SeqLayout, cache, logits_rows, taps, verify_commit: str | None = None):
        """(logits, taps or None, VerifyStash or None); verify_commit: the mode of an all-verify batch."""
        B = layout.num_seqs
        width = _pow2_at_least(max(len(t) for t in layout.block_tables), 1)
        max_len = _pow2_at_least(layout.longest(), self.MIN_LEN)
        self.model.rope.ensure(max_len)  # the trace holds the table: it must cover the whole bucket
        tables = padded_tables(layout.block_tables, width)
        arrays = [layout.array(n) for n in _INPUTS] + [tables]
        rows = () if logits_rows is None else (logits_rows,)
        verify = verify_commit is not None  # eligible layouts: all verify, or none
        if verify != any(layout.verify or ()):
            raise ValueError("CompiledDecode.verifying runs the batches with verifying sequences, and only those")
        # the graph's structure: tokens per sequence, table width, length bucket, what is returned, and the
        # commit mode (it decides what a verification stashes)
        shape = (tuple(layout.query_start_loc), width, max_len, self.model.rope.size, layout.block_tokens,
                 len(rows) and logits_rows.shape[0], taps, verify_commit)
        fn, new = lookup_trace(self._fns, shape, lambda: mx.compile(self._step_fn(
            B, layout.query_start_loc, width, max_len, layout.block_tokens, bool(rows), taps, verify_commit)),
            self.max_traces)
        self.traces += new
        n_attn, n_gdn = len(cache.k_pools), len(cache.conv_states)
        head, pools, stash = fn(input_ids, arrays, rows, cache.arrays())
        cache.k_pools[:], cache.v_pools[:] = pools[:n_attn], pools[n_attn : 2 * n_attn]
        cache.conv_states[:], cache.rec_states[:] = pools[2 * n_attn : 2 * n_attn + n_gdn], pools[2 * n_attn + n_gdn :]
        # the trace's stash, one GDNStash tree per GDN layer in state-index order
        out = VerifyStash(verify_commit, layout, {idx: GDNStash.from_tree(t) for idx, t in enumerate(stash)}) \
            if verify else None
        return head[0], (head[1] if taps is not None else None), out

    def _step_fn(self, B: int, qsl: list[int], width: int, max_len: int, block_tokens: int, has_rows: bool,
                 taps: tuple[int, ...] | None, verify: str | None):
        """verify: None, or the commit mode of an all-verify batch."""
        model = self.model
        qsl = list(qsl)

        def step(ids, arrays, rows, pools):
            lay = SeqLayout.for_trace(qsl, dict(zip(_INPUTS + ("block_tables",), arrays)), block_tokens,
                                      verify=[True] * B if verify else None, max_len=max_len)
            n_attn = len(model.config.full_attention_layers)
            n_gdn = len(model.config.linear_attention_layers)
            view = SimpleNamespace(  # the model's writes rebind these lists; they are returned below
                k_pools=list(pools[:n_attn]), v_pools=list(pools[n_attn : 2 * n_attn]),
                conv_states=list(pools[2 * n_attn : 2 * n_attn + n_gdn]),
                rec_states=list(pools[2 * n_attn + n_gdn :]),
            )
            r = rows[0] if has_rows else None
            stash = []
            if verify:
                logits, tapped, st = model.forward_verifying(ids, lay, view, taps or (), r, verify)
                head = [logits] if taps is None else [logits, tapped]
                stash = [st.layers[idx].tree() for idx in range(n_gdn)]
            elif taps is None:
                head = [model.forward(ids, lay, view, r)]
            else:
                head = list(model.forward_with_taps(ids, lay, view, taps, r))
            return head, [*view.k_pools, *view.v_pools, *view.conv_states, *view.rec_states], stash

        return step
