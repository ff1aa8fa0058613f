"""Prefix snapshots taken inside a step (Engine(prefix_in_step=True), model/gdn_taps.py) on a tiny random
Qwen3.5 (CPU): prefill chunks cross snapshot boundaries, the delta rule runs in pieces split there, and the
states it leaves are the snapshots. Exact chunk plans, the same entries as with chunks cut at boundaries,
the model's own outputs, the same states, no leaks."""

import mlx.core as mx
import numpy as np
import pytest

from mtlqwen.kernels import SeqLayout
from mtlqwen.runtime import Engine
from mtlqwen.runtime.kv_manager import KVManager, _tap_state
from mtlqwen.runtime.scheduler import Scheduler
from mtlqwen.runtime.sequence import Sequence

from engine_checks import assert_idle, assert_reference, close, greedy
from hf_checkpoints import random_token_ids

KW = dict(slots=2, step_tokens=16, prefill_step_tokens=64, block_tokens=8, num_blocks=40, prefix_interval=16)


def test_chunks_cross_boundaries_only_in_step_mode():
    kv = KVManager(32, 8, prefix_interval=16, prefix_cache_bytes=1 << 20, identity="x", in_step=True)
    assert kv.boundaries_in(0, 40) == [16, 32] and kv.boundaries_in(16, 32) == [] and kv.boundaries_in(15, 17) == [16]
    assert kv.chunk_tokens_at(3, 40) == 40 and kv.chunk_tokens_at(3, 40, cross=False) == 13
    sch = Scheduler(kv, 2, 16, prefill_step_tokens=64)
    a = Sequence("a", list(range(40)), greedy(2), seed=0)
    sch.add(a)
    plan = sch.schedule()
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in plan.scheduled] == [("a", 0, 40)]
    off = KVManager(32, 8, prefix_interval=16, prefix_cache_bytes=1 << 20, identity="x")
    assert not off.in_step and off.chunk_tokens_at(3, 40) == 13
    assert not KVManager(32, 8, in_step=True).in_step  # no cache, nothing to take


def test_the_delta_rule_in_pieces_leaves_the_states_of_cut_chunks(model):
    """One forward over 2 sequences with taps == the same tokens in chunks cut at the taps: outputs, final
    states, and at each tap the conv and recurrent states the cut run had there (fp32)."""
    rng = np.random.default_rng(0)
    lens, taps = [21, 9], [[2, 16], [5]]  # a tap 2 tokens in: its conv state mixes the old rows
    ids = [rng.integers(0, 500, n).tolist() for n in lens]
    bt, nb = 8, 5
    tables = [[0, 1, 2], [3, 4]]
    whole = model.make_cache(nb, 2, bt)
    lay = SeqLayout([0, 21, 30], [0, 0], tables, [0, 1], bt, state_taps=taps)
    h = model.forward(mx.array(ids[0] + ids[1], dtype=mx.int32), lay, whole)
    mx.eval(h, whole.arrays())
    cut = model.make_cache(nb, 2, bt)
    outs, states = [], {}
    for i, (seq, t) in enumerate(zip(ids, taps)):
        edges = [0, *t, len(seq)]
        for s, e in zip(edges, edges[1:]):
            one = SeqLayout([0, e - s], [s], [tables[i]], [i], bt)
            outs.append(model.forward(mx.array(seq[s:e], dtype=mx.int32), one, cut))
            mx.eval(outs[-1], cut.arrays())
            states[(i, e)] = [np.array(p[i]) for p in (*cut.conv_states, *cut.rec_states)]
    assert close(np.array(h), np.array(mx.concatenate(outs)))
    for got, want in zip((*whole.conv_states, *whole.rec_states), (*cut.conv_states, *cut.rec_states)):
        assert close(np.array(got), np.array(want))
    assert sorted(whole.gdn_taps) == [(0, 2), (0, 16), (1, 5)]
    n = len(whole.conv_states)
    for key, tap in whole.gdn_taps.items():
        assert sorted(tap["conv"]) == sorted(tap["rec"]) == list(range(n))
        got = _tap_state(tap, n)
        assert [g.shape[0] for g in got] == [1] * (2 * n)
        for g, w in zip(got, states[key]):
            assert close(np.array(g[0]), w)
    with pytest.raises(RuntimeError, match="needs every GDN layer"):
        _tap_state({"conv": {0: None}, "rec": {}}, n)


def test_a_batch_with_verifications_refuses_taps(model):
    c = model.make_cache(4, 1, 8)
    lay = SeqLayout([0, 3], [0], [[0]], [0], 8, verify=[True], state_taps=[[1]])
    with pytest.raises(ValueError, match="takes no state taps"):
        model.forward_verifying(mx.array([1, 2, 3], dtype=mx.int32), lay, c)


def run(model, prompts, **kw):
    eng = Engine(model, **{**KW, **kw})
    return eng, eng.generate(prompts, greedy(6))


def intervals(eng) -> list:
    return sorted((e.length, e.key) for e in eng.prefix.entries.values() if e.kind == "interval")


def test_outputs_and_entries_match_cut_chunks(model):
    """A 50-token prompt prefills in one step with the snapshots at 16, 32 and 48 taken inside it: the same
    interval entries (lengths and keys) as the cut-chunk engine's, the same states in them, the model's own
    tokens, and a repeat that hits at 48 and generates the same."""
    p = random_token_ids(50, 500, seed=4)
    cut, (out_cut,) = run(model, [p])
    eng, (out,) = run(model, [p], prefix_in_step=True)
    assert out.token_ids == out_cut.token_ids
    assert_reference(model, p, out, 6)
    assert [n for n, _ in intervals(eng)] == [16, 32, 48] and intervals(eng) == intervals(cut)
    by_key = {e.key: e for e in cut.prefix.entries.values()}
    for e in eng.prefix.entries.values():
        if e.kind == "interval":
            for got, want in zip(e.state, by_key[e.key].state):
                assert close(np.array(got), np.array(want))
    assert eng.counters["steps"] < cut.counters["steps"]  # the prompt in one prefill step, not four
    hits = eng.stats()["prefix_hits"]
    (again,) = eng.generate([p], greedy(6))
    assert again.token_ids == out.token_ids and eng.stats()["prefix_hits"] == hits + 1
    assert eng.cache.gdn_taps == {}
    assert_idle(eng)


def test_concurrent_prompts_with_taps_equal_the_reference(model):
    prompts = [random_token_ids(n, 500, seed=n) for n in (37, 70, 5)]
    _, plain = run(model, prompts, prefix_interval=0)
    eng, outs = run(model, prompts, prefix_in_step=True)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for p, o in zip(prompts, outs):
        assert_reference(model, p, o, 6)
    assert_idle(eng)
