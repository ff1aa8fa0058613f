"""Turn entries, exactly: a finished request's computed tokens kept from its slot, looked up as the longest
match over both kinds of entry (a re-rendered earlier turn hits shorter), and chats on a tiny fp32 model
whose every turn restores the previous one and matches the cache-off run; nothing leaked."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtlqwen
from mtlqwen.runtime import Engine
from mtlqwen.runtime import prefix_cache as pc
from mtlqwen.runtime.kv_manager import KVManager
from mtlqwen.runtime.scheduler import ScheduledSeq
from mtlqwen.runtime.sequence import Sequence, SeqStatus

from engine_checks import assert_idle, assert_reference, greedy
from hf_checkpoints import random_token_ids, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return mtlqwen.load(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def fake_cache(slots=4, blocks=16, bt=4):
    """The pools a snapshot touches, each row a distinct value: GDN states by slot, K/V by block."""
    ar = lambda n, *shape: mx.arange(n * int(np.prod(shape)), dtype=mx.float32).reshape(n, *shape)  # noqa: E731
    return SimpleNamespace(conv_states=[ar(slots, 2) + 100], rec_states=[ar(slots, 3) + 200],
                           k_pools=[ar(blocks, bt, 1, 1) + 300], v_pools=[ar(blocks, bt, 1, 1) + 400],
                           drafter_cache=None)


def running(kv, rid, tokens, computed, slot):
    """A sequence in a slot with `computed` tokens' K/V of its own (as after its steps, no hit)."""
    s = Sequence(rid, list(tokens), greedy(4), seed=0)
    s.slot, s.status = slot, SeqStatus.RUNNING
    kv.allocate(s, computed)
    kv.advance(s, computed)
    return s


def probe(tokens):
    return Sequence("probe", list(tokens), greedy(1), seed=0)


def test_a_finished_sequence_keeps_a_turn_entry_from_its_slot():
    kv = KVManager(16, 4, prefix_interval=8, identity="x")
    pool, cache = kv.pool, fake_cache()
    owner = running(kv, "owner", range(14), 14, slot=2)
    kv.finish(owner, "cancelled", cache)  # a cancelled (or failed) request keeps nothing
    assert not kv.prefix.entries
    kv.finish(owner, "length", cache)
    (e,) = kv.prefix.entries.values()
    # 14 tokens: bucket = key of the first 8, three whole blocks shared, block 3 (two tokens) copied
    assert (e.kind, e.length, e.blocks, e.bucket) == ("turn", 14, [0, 1, 2], kv.prefix.keys(owner, 1)[0])
    assert e.key == pc.chunk_key(e.bucket, list(range(8, 14))) and kv.prefix.turns == {e.bucket: [e.key]}
    np.testing.assert_array_equal(np.array(e.state[1]), np.array(cache.rec_states[0][2:3]))  # the owner's slot
    np.testing.assert_array_equal(np.array(e.tail[0]), np.array(cache.k_pools[0][3:4]))
    assert pool.ref_counts[:4] == [2, 2, 2, 1]
    kv.finish(owner, "stop", cache)  # the same tokens again: touched, not duplicated
    assert len(kv.prefix.entries) == 1 and pool.ref_counts[:4] == [2, 2, 2, 1]
    s = kv.stats()
    assert (s["prefix_turn_entries"], s["prefix_turns_kept"], s["prefix_turn_bytes"]) == (1, 1, e.nbytes)
    kv.free(owner)
    assert pool.ref_counts[:4] == [1, 1, 1, 0]
    # a verification that ran past a stop leaves a state for tokens the request dropped: nothing kept
    past = running(kv, "past", range(30, 40), 10, slot=1)
    past.tokens = past.tokens[:9]
    kv.finish(past, "stop", cache)
    kv.free(past)
    assert len(kv.prefix.entries) == 1 and kv.clear() == 1 and pool.num_free == 16


def test_lookup_takes_the_longest_match_over_both_kinds():
    kv = KVManager(32, 4, prefix_interval=8, identity="x")
    cache, prefix = fake_cache(blocks=32), kv.prefix
    conv = list(range(50, 80))  # a conversation: turns ending at 5, 14 and 21 tokens
    for n, slot in ((5, 0), (14, 1), (21, 2)):
        s = running(kv, f"t{n}", conv[:n], n, slot)
        kv.finish(s, "stop", cache)
        kv.free(s)
    interval = running(kv, "iv", conv[:17], 16, slot=3)  # an interval entry at 16 (the engine's capture)
    snaps = kv.step_snapshots([ScheduledSeq(interval, 0, 16, False, 0, False)], [], cache)
    snaps.capture()
    snaps.publish()
    kv.free(interval)
    assert sorted((e.kind, e.length) for e in prefix.entries.values()) == [
        ("interval", 16), ("turn", 5), ("turn", 14), ("turn", 21)]
    assert {len(v) for v in prefix.turns.values()} == {1} and len(prefix.turns) == 3  # buckets: root, 8, 16
    hit = lambda tokens: getattr(prefix.lookup(probe(tokens)), "length", 0)  # noqa: E731
    assert hit(conv[:22]) == 21  # the next turn of the conversation
    assert hit(conv[:21]) == 16  # the same prompt again: one token must run, 21 is too long
    assert hit(conv[:20] + [1, 2]) == 16  # the last turn re-rendered differently
    assert hit(conv[:15] + [1]) == 14
    assert hit(conv[:12] + [1, 2, 3]) == 5  # turn 2 re-rendered: turn 1 still matches
    assert hit(conv[:6]) == 5 and hit(conv[:5]) == 0 and hit([1] + conv[1:22]) == 0
    assert kv.clear() == 4 and kv.pool.num_free == 32 and all(r == 0 for r in kv.pool.ref_counts)


def test_one_prefix_published_twice_in_one_step_keeps_one_entry():
    kv = KVManager(16, 4, prefix_interval=8, identity="x")
    cache = fake_cache()
    a, b = running(kv, "a", range(10), 8, slot=0), running(kv, "b", range(10), 8, slot=1)
    snaps = kv.step_snapshots([ScheduledSeq(a, 0, 8, False, 0, True), ScheduledSeq(b, 0, 8, False, 0, True)], [], cache)
    snaps.capture()  # prompt tokens: both published at launch, the second a duplicate
    (e,) = kv.prefix.entries.values()
    assert e.blocks == a.block_table and kv.pool.ref_counts[:4] == [2, 2, 1, 1]  # b's references dropped
    assert snaps.published == [e]
    snaps.publish()  # nothing left for the read-back
    assert list(kv.prefix.entries.values()) == [e] and kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    kv.free(a), kv.free(b)
    assert kv.clear() == 1 and kv.pool.num_free == 16


def chat_turns(eng, turns, sp):
    """Run a chat: each turn's prompt is the previous prompt + its reply + the new message."""
    prompt, outs, prompts = [], [], []
    for msg in turns:
        prompt = (prompt + outs[-1].token_ids if outs else prompt) + msg
        prompts.append(prompt)
        (o,) = eng.generate([prompt], sp)
        outs.append(o)
    return prompts, outs


def test_each_turn_of_a_chat_restores_the_previous_one_and_prefills_only_the_new_message(model):
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=8, num_blocks=40, prefix_interval=16)
    msgs = [random_token_ids(n, 500, seed=70 + n) for n in (20, 6, 9)]
    sp = greedy(5, ignore_eos=True)
    before = []
    prompt, outs = [], []
    for msg in msgs:
        prompt = (prompt + outs[-1].token_ids if outs else prompt) + msg
        before.append(eng.stats()["prefill_tokens"])
        (o,) = eng.generate([prompt], sp)
        outs.append(o)
        assert_reference(model, prompt, o, max_tokens=5)
    # turn k restores the previous turn's prompt + reply but its last sampled token (never run)
    assert [o.cached_tokens for o in outs] == [0, 20 + 5 - 1, 20 + 5 + 6 + 5 - 1]
    after = eng.stats()["prefill_tokens"]
    assert [b - a for a, b in zip(before, before[1:] + [after])] == [20, 1 + 6, 1 + 9]
    s = eng.stats()
    assert (s["prefix_turn_hits"], s["prefix_turns_kept"], s["prefix_hits"]) == (2, 3, 2)
    # a client that re-renders the second turn differently hits the first turn's entry
    edited = prompt[:24] + [3] + prompt[25:]
    (o,) = eng.generate([edited], sp)
    assert o.cached_tokens == 24
    assert_reference(model, edited, o, max_tokens=5)
    assert_idle(eng)


@st.composite
def chats(draw):
    interval, bt = draw(st.sampled_from([(16, 8), (12, 8), (16, 16), (8, 8)]))
    system = random_token_ids(draw(st.integers(0, 2 * interval)), 500, seed=draw(st.integers(0, 999)))
    convs = []
    for _ in range(draw(st.integers(1, 3))):  # conversations sharing the system prompt, run together
        turns = [random_token_ids(draw(st.integers(1, 20)), 500, seed=draw(st.integers(0, 999)))
                 for _ in range(draw(st.integers(2, 4)))]
        turns[0] = system + turns[0]
        convs.append(turns)
    gen = draw(st.integers(1, 6))
    return dict(interval=interval, bt=bt, convs=convs, gen=gen, ignore_eos=draw(st.booleans()),
                slots=draw(st.integers(1, 3)), step_tokens=draw(st.integers(8, 40)))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(w=chats())
def test_chats_match_cache_off_and_hit_the_previous_turn(model, w):
    kw = dict(slots=w["slots"], step_tokens=w["step_tokens"], block_tokens=w["bt"], num_blocks=120)
    on, off = Engine(model, prefix_interval=w["interval"], **kw), Engine(model, prefix_interval=0, **kw)
    sp = greedy(w["gen"], ignore_eos=w["ignore_eos"])
    prompts, last = [list(t[0]) for t in w["convs"]], [None] * len(w["convs"])
    for k in range(max(len(t) for t in w["convs"])):
        live = [i for i, t in enumerate(w["convs"]) if k < len(t)]
        if k:  # the next turn: previous prompt + its reply (as the cache-on engine produced it) + the message
            for i in live:
                prompts[i] = prompts[i] + last[i].token_ids + w["convs"][i][k]
        batch = [prompts[i] for i in live]
        outs_on, outs_off = on.generate(batch, sp), off.generate(batch, sp)
        for i, p, o_on, o_off in zip(live, batch, outs_on, outs_off):
            if o_on.token_ids != o_off.token_ids:  # only where the reference has a near tie
                assert_reference(model, p, o_off, max_tokens=w["gen"], ignore_eos=w["ignore_eos"])
            assert_reference(model, p, o_on, max_tokens=w["gen"], ignore_eos=w["ignore_eos"])
            if k:  # the previous turn's computed tokens (its reply's last token only if it ran) are restored
                ran = len(p) - len(w["convs"][i][k]) - 1
                assert o_on.cached_tokens >= ran, (k, o_on.cached_tokens, ran)
            last[i] = o_on
    s = on.stats()
    assert s["prefix_bytes"] <= on.prefix.budget and s["prefix_turn_entries"] <= s["prefix_entries"]
    assert_idle(on)
    assert_idle(off)
