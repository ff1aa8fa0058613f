"""The compiled drafter (model/compiled_draft.py) on CPU, fp32: proposals, draft logits and drafter context
rows equal the uncompiled drafter's exactly, a trace replayed at other lengths, tables and anchors included
(a value baked into a trace would show here); a second call of the same shape class builds no trace; the
engine compiling with a drafter gives plain decoding's tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_checkpoints import write_tiny_drafter
from engine_checks import assert_idle, greedy
from hf_checkpoints import random_token_ids
from mtlqwen import SeqLayout
from mtlqwen.model.compiled_draft import CompiledDraft
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine
from test_speculative import assert_drafter_context, plain_outputs

BT, BLOCKS, SCRATCH = 8, 17, 16  # the last block plays the engine's padding bundle

# the drafter attention's masks: non-causal full layers (the default), a causal sliding layer, causal full
VARIANTS = {"full": {}, "sliding-causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
            "full-causal": dict(is_causal=True)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def drafter(request, ckpt, model, tmp_path_factory):
    d = write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt, num_layers=2, block_size=16,
                           **VARIANTS[request.param])
    return load_drafter(d, model)


def prefill(model, drafter, lens, tables, seed=0):
    """Prompts of `lens` tokens in `tables`; (target cache, their taps, the prefill layout)."""
    cache = model.make_cache(BLOCKS, len(lens), BT)
    ids = sum((random_token_ids(n, 512, seed=seed + n) for n in lens), [])
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    lay = SeqLayout(qsl, [0] * len(lens), tables, list(range(len(lens))), BT)
    _, taps = model.forward_with_taps(mx.array(ids, dtype=mx.int32), lay, cache, drafter.tap_layers,
                                      mx.array([], dtype=mx.int32))
    return cache, taps, lay


def same_rows(a, b) -> bool:
    """Drafter caches equal in every block but the scratch one (the padding rows' sink)."""
    return all(np.array_equal(np.array(x[:SCRATCH]), np.array(y[:SCRATCH])) for x, y in zip(a.arrays(), b.arrays()))


def test_context_writes_equal_the_drafter_and_replay_per_row_class(model, drafter):
    """Prefill context of 3 sequences, then committed runs of other lengths and positions (a verification's
    anchor + accepted drafts, rows picked from the step's taps): the same pools as Drafter.write_context;
    row counts up to 16 share one trace, 17..32 another."""
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    cache, taps, lay = prefill(model, drafter, [21, 9, 30], tables)
    ref, got = drafter.make_cache(cache), drafter.make_cache(cache)
    comp = CompiledDraft(drafter, SCRATCH)
    drafter.write_context(taps, lay, ref)
    comp.write_context(taps, lay, got)  # 60 rows: the 64 class
    assert same_rows(ref, got) and comp.traces == 1
    # commits: rows of the prefill taps standing in for a step's, written at later positions
    for qsl, kv, rows in (([0, 3, 5], [21, 9], [0, 1, 2, 7, 8]), ([0, 1, 4], [20, 11], [3, 4, 5, 6]),
                          ([0, 6, 7, 15], [12, 12, 20], list(range(10, 25)))):
        cl = SeqLayout(qsl, kv, tables[: len(kv)], list(range(len(kv))), BT)
        drafter.write_context(taps[mx.array(rows, dtype=mx.int32)], cl, ref)
        comp.write_context(taps, cl, got, rows)
        assert same_rows(ref, got)
    assert comp.traces == 2  # 60 rows; then 5, 4 and 15 rows: the 16 class, replayed
    with pytest.raises(ValueError, match="tap rows but the layout packs"):
        comp.write_context(taps, cl, got, rows[:-1])


def test_proposals_and_logits_equal_the_drafter_exactly(model, drafter):
    """Greedy proposals and draft logits of 3 sequences at 3 and 7 drafts, then the same classes at other
    context lengths (within the tables' width bucket), anchors and tables: exactly the drafter's; the
    drafter cache is left as it was (the block's K/V are transient)."""
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    cache, taps, lay = prefill(model, drafter, [21, 9, 30], tables)
    dc = drafter.make_cache(cache)
    drafter.write_context(taps, lay, dc)
    before = [np.array(a) for a in dc.arrays()]
    comp = CompiledDraft(drafter, SCRATCH)
    steps = [([5, 6, 7], [20, 8, 29], tables), ([300, 2, 509], [13, 1, 17], tables),
             ([9, 9, 9], [21, 9, 30], [[8, 7, 6], [5, 4], [3, 2, 1, 0]])]
    for n in (3, 7):
        for anchors, kv, tab in steps:
            dec = SeqLayout([0, 1, 2, 3], kv, tab, [0, 1, 2], BT)
            want, want_logits = drafter.propose_with_logits(anchors, dec, dc, n)
            got, got_logits = comp.propose_with_logits(anchors, dec, dc, n)
            assert got.dtype == mx.int32 and got.shape == (3, n)
            assert np.array_equal(np.array(got), np.array(want))
            assert np.array_equal(np.array(got_logits), np.array(want_logits))
            assert np.array_equal(np.array(comp.propose(anchors, dec, dc, n)), np.array(drafter.propose(anchors, dec, dc, n)))
    # (greedy, with logits) x (3, 7 drafts); table widths 3 and 4 share the width bucket 4
    assert comp.traces == 4 and len(comp._propose) == 4
    assert all(np.array_equal(np.array(a), b) for a, b in zip(dc.arrays(), before))
    # one sequence alone: a class of its own
    one = SeqLayout([0, 1], [9], [[3, 4]], [1], BT)
    assert np.array_equal(np.array(comp.propose([4], one, dc, 1)), np.array(drafter.propose([4], one, dc, 1)))
    assert comp.traces == 5
    for bad in (([1, 2], one, 1, "anchors for 1 sequences"), ([1], one, 0, "n_draft must be >= 1")):
        with pytest.raises(ValueError, match=bad[3]):
            comp.propose(bad[0], bad[1], dc, bad[2])


def test_engine_compiles_the_drafter_and_keeps_plain_tokens(model, drafter):
    """The real (random) drafter through the compiled engine (compile_decode=True): every proposal is the
    uncompiled drafter's, so the tokens, acceptance counts and drafter context equal the uncompiled
    speculative engine's and plain decoding's; proposals replay their traces."""
    prompts = [random_token_ids(n, 512, seed=70 + n) for n in (13, 30)]
    sp = greedy(20, ignore_eos=True)
    kw = dict(slots=2, step_tokens=32, block_tokens=16, num_blocks=12)
    base = plain_outputs(model, prompts, sp, **kw)
    stats = []
    for compiled in (False, True):
        eng = Engine(model, draft=drafter, n_draft=7, prefix_interval=0, compile_decode=compiled, **kw)
        rids = [eng.submit(p, sp) for p in prompts]
        outs = {}
        while eng.has_work():
            for d in eng.step():
                if d.finished:
                    outs[d.request_id] = d.output
            fl = eng._inflight
            if fl is not None and fl.spec is not None:
                for s in fl.spec.seqs:
                    assert_drafter_context(eng, s.seq, s.start, model, drafter)
        assert [outs[r].token_ids for r in rids] == [o.token_ids for o in base]
        s = eng.stats()
        stats.append({k: s[k] for k in ("draft_tokens", "accepted_tokens", "spec_verifications", "spec_steps")})
        assert_idle(eng)
    assert stats[0] == stats[1] and stats[1]["spec_steps"] > 0
    cd = eng.spec.compiled_draft
    assert cd is not None and 1 <= len(cd._propose) < stats[1]["spec_steps"]


def test_default_compiles_with_a_drafter_where_the_kernels_run(model, drafter, monkeypatch):
    """compile_decode's default: off on the CPU references (uncompiled drafter, the uncompiled H200 table for
    the adaptive policy), on where the kernels run, the drafter pass included (and the compiled table);
    an explicit value wins either way."""
    from mtlqwen.runtime import engine as engine_mod  # noqa: PLC0415
    from mtlqwen.runtime.draft_policy import H200_9B_COMPILED_COSTS, H200_9B_COSTS  # noqa: PLC0415

    kw = dict(slots=1, step_tokens=32, block_tokens=16, num_blocks=8, draft=drafter, prefix_interval=0)
    eng = Engine(model, **kw)
    assert eng.compiled is None and eng.spec.compiled is None and eng.spec.compiled_draft is None
    assert eng.stats()["draft_policy"] == "fixed"
    monkeypatch.setattr(engine_mod, "use_kernels", lambda: True)  # as on a GPU back-end
    eng = Engine(model, **kw)
    assert eng.compiled is not None and eng.spec.compiled is eng.compiled
    assert eng.spec.compiled_draft.drafter is drafter and eng.spec.compiled_draft.scratch_block == eng.num_blocks
    assert eng.spec.policy.costs is H200_9B_COMPILED_COSTS
    eng = Engine(model, compile_decode=False, **kw)
    assert eng.compiled is None and eng.spec.compiled_draft is None and eng.spec.policy.costs is H200_9B_COSTS
    eng = Engine(model, learn_draft_costs=True, **kw)  # learning: the table is the prior of what it measures
    assert eng.spec.policy.costs.prior is H200_9B_COMPILED_COSTS and eng.timer is not None


def test_context_write_padding_is_built_on_the_host_where_the_layout_holds_the_values():
    """padded_array: a layout's own positions / write slots padded on the host (one array of the exact
    values); a provided device array (a pipelined step's) extended by the fill; no padding: the layout's
    shared array itself."""
    from mtlqwen.model.compiled_draft import padded_array  # noqa: PLC0415

    lay = SeqLayout([0, 3, 5], [9, 2], [[4, 5], [6]], [0, 1], BT)
    assert lay.host_values("positions") == [9, 10, 11, 2, 3]
    assert lay.host_values("write_blocks") == [5, 5, 5, 6, 6] and lay.host_values("write_offsets") == [1, 2, 3, 2, 3]
    assert padded_array(lay, "positions", 0, 0) is lay.array("positions")
    assert padded_array(lay, "write_blocks", SCRATCH, 3).tolist() == [5, 5, 5, 6, 6, SCRATCH, SCRATCH, SCRATCH]
    assert padded_array(lay, "write_offsets", 0, 2).tolist() == [1, 2, 3, 2, 3, 0, 0]
    lay.provide("positions", mx.array([7, 8, 9, 1, 2], dtype=mx.int32))  # device-derived: the lists are bounds
    assert lay.host_values("positions") is None and lay.host_values("write_blocks") is not None
    assert padded_array(lay, "positions", 0, 3).tolist() == [7, 8, 9, 1, 2, 0, 0, 0]
    traced = SeqLayout.for_trace([0, 1], {"block_tables": mx.zeros((1, 2), dtype=mx.int32)}, BT)
    assert traced.host_values("write_offsets") is None
    with pytest.raises(KeyError):
        lay.host_values("kv_valid")
