"""The prefix cache on a tiny random Qwen3.5 (CPU): outputs with the cache equal those without it and
the model run alone; exact keys, ref counts, LRU order, eviction before preemption, no leaks."""

import struct
from types import SimpleNamespace

import mlx.core as mx
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtlqwen
from mtlqwen.model.cache import ModelCache
from mtlqwen.runtime import Engine
from mtlqwen.runtime import prefix_cache as pc
from mtlqwen.runtime.block_pool import BlockPool
from mtlqwen.runtime.kv_manager import KVManager
from mtlqwen.runtime.scheduler import Scheduler
from mtlqwen.runtime.sequence import Sequence

from engine_checks import EOS, assert_idle, assert_reference, greedy, run_arrivals
from hf_checkpoints import random_token_ids, write_tiny_checkpoint

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return mtlqwen.load(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def entries(eng):
    return list(eng.prefix.entries.values())  # least recently used first


# ---- keys
def test_keys_are_the_documented_chained_xxh3_64():
    tokens = list(range(100, 140))
    root = pc.root_key("mtlqwen-test-identity")
    assert root == xxhash.xxh3_64_intdigest(b"mtlqwen-test-identity") == 0xFEBBF1DB2D9A4053
    k1 = xxhash.xxh3_64_intdigest(struct.pack("<Q", root) + struct.pack("<16i", *tokens[:16]))
    k2 = xxhash.xxh3_64_intdigest(struct.pack("<Q", k1) + struct.pack("<16i", *tokens[16:32]))
    assert (k1, k2) == (0x7F7FD9D1B83109DF, 0xA619145069AA3F41)
    assert pc.prefix_keys(root, tokens, 16) == [k1, k2]  # the 8 tokens past 32 make no key
    cache = pc.PrefixCache(BlockPool(4), 16, 8, 1 << 20, "mtlqwen-test-identity")
    seq = Sequence(0, tokens, greedy(1), seed=0)
    assert cache.keys(seq, 2) == [k1, k2] and seq.prefix_keys == [k1, k2]


def test_models_and_drafters_never_share_a_root(model):
    same_config_other_weights = SimpleNamespace(config=model.config, dtype=model.dtype, source="elsewhere")
    idents = [pc.model_identity(model), pc.model_identity(model, drafter="dflash-a"),
              pc.model_identity(model, drafter="dflash-b"), pc.model_identity(same_config_other_weights)]
    assert len({pc.root_key(i) for i in idents}) == 4
    assert pc.model_identity(model) == pc.model_identity(model)  # stable, so one model's entries are found again


# ---- scheduling
def test_prefill_chunks_end_on_interval_boundaries():
    sch = Scheduler(KVManager(32, 8, prefix_interval=16, prefix_cache_bytes=1 << 20, identity="x"), 2, 32)
    a = Sequence("a", list(range(40)), greedy(2), seed=0)
    b = Sequence("b", list(range(50, 60)), greedy(2), seed=0)
    sch.add(a), sch.add(b)
    chunks = []
    for _ in range(3):
        plan = sch.schedule()
        chunks.append([(s.seq.request_id, s.start, s.num_tokens) for s in plan.scheduled])
    # a's share of 32 - 10 is cut at 16, its next of 31 at 32; b prefills, then decodes its anchor
    assert chunks == [[("a", 0, 16), ("b", 0, 10)], [("a", 16, 16), ("b", 10, 1)], [("a", 32, 8)]]


def test_an_entry_being_restored_is_pinned_against_eviction():
    kv = KVManager(6, 4, prefix_interval=8, prefix_cache_bytes=1 << 20, identity="x")
    pool, cache = kv.pool, kv.prefix
    sch = Scheduler(kv, 1, 16)
    owner = Sequence("owner", list(range(12)), greedy(1), seed=0)
    owner.block_table = pool.allocate(2)
    cap = pc.Capture(owner, 8, list(owner.block_table), [mx.zeros((1, 2))], None)
    pool.share(cap.blocks)
    cache.publish([cap])
    pool.free(owner.block_table)  # the owner finished: only the entry holds blocks 0, 1
    (e,) = entries(SimpleNamespace(prefix=cache))
    seq = Sequence("s", list(range(12)), greedy(1), seed=0)
    sch.add(seq)
    sch._admit()
    assert (seq.kv_valid, seq.block_table, seq.restore, e.pins) == (8, [0, 1], e, 1)
    assert cache.clear() == 0 and not cache.evict_for_blocks(6) and cache.entries
    assert [pool.ref_counts[b] for b in e.blocks] == [2, 2]
    sch.release(seq)  # left before its restore was launched: unpinned
    assert e.pins == 0 and seq.restore is None and cache.clear() == 1
    assert pool.num_free == 6 and all(r == 0 for r in pool.ref_counts)


# ---- exact behaviour of the engine
def test_hits_share_bundles_and_ref_counts_return(model):
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=8, num_blocks=40, prefix_interval=16)
    a = random_token_ids(40, 500, seed=1)
    (oa,) = eng.generate([a], greedy(3))
    e16, e32 = entries(eng)
    assert (e16.length, e32.length, oa.cached_tokens) == (16, 32, 0)
    assert e32.blocks[:2] == e16.blocks and len(e32.blocks) == 4
    refs = lambda: [eng.pool.ref_counts[b] for b in e32.blocks]  # noqa: E731
    assert refs() == [2, 2, 1, 1]
    assert (eng.stats()["free_blocks"], eng.stats()["prefix_blocks"]) == (40 - 4, 4)  # e16's blocks are e32's first two
    b = a[:32] + random_token_ids(6, 500, seed=2)
    rid = eng.submit(b, greedy(4))
    eng.step()
    seq = eng._seqs[rid]
    assert seq.block_table[:4] == e32.blocks and refs() == [3, 3, 2, 2] and seq.kv_valid > 32
    outs = []
    while eng.has_work():
        outs += [d.output for d in eng.step() if d.finished]
    (ob,) = outs
    assert refs() == [2, 2, 1, 1] and ob.cached_tokens == 32
    assert_reference(model, a, oa)
    assert_reference(model, b, ob)
    s = eng.stats()
    assert (s["prefix_lookups"], s["prefix_hits"], s["prefix_hit_tokens"], s["prefix_query_tokens"]) == (2, 1, 32, 78)
    assert s["prefix_entries"] == 2 and s["prefix_bytes"] == 2 * ModelCache.bytes_per_slot(model.config, model.dtype)
    assert s["prefix_blocks"] == 4  # b (38 + 4 tokens) reaches no boundary past 32
    assert_idle(eng)


def test_whole_prompt_hit_leaves_one_token_to_run(model):
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=8, num_blocks=40, prefix_interval=16)
    p = random_token_ids(32, 500, seed=3)
    first, again = eng.generate([p], greedy(2)), eng.generate([p], greedy(2))
    longer = eng.generate([p + [7]], greedy(2))
    assert (first[0].cached_tokens, again[0].cached_tokens, longer[0].cached_tokens) == (0, 16, 32)
    assert again[0].token_ids == first[0].token_ids
    for q, (o,) in ((p, first), (p, again), (p + [7], longer)):
        assert_reference(model, q, o)
    assert_idle(eng)


def test_decode_publishes_generated_tokens(model):
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=8, num_blocks=40, prefix_interval=16)
    p = random_token_ids(10, 500, seed=4)
    (o,) = eng.generate([p], greedy(10))
    assert len(o.token_ids) == 10 or o.token_ids[-1] in EOS
    if len(p) + len(o.token_ids) - 1 >= 16:  # the anchor at 15 ran: the decode crossed the boundary
        (e,) = entries(eng)
        assert e.length == 16 and e.tokens == pc.token_bytes((p + o.token_ids)[:16])
        q = (p + o.token_ids)[:16] + [3, 4]
        (o2,) = eng.generate([q], greedy(3))
        assert o2.cached_tokens == 16
        assert_reference(model, q, o2)
    assert_idle(eng)


def test_same_prefix_published_twice_in_one_step_keeps_one_entry(model):
    eng = Engine(model, slots=3, step_tokens=48, block_tokens=8, num_blocks=40, prefix_interval=16)
    p = random_token_ids(35, 500, seed=5)
    outs = eng.generate([p, p, p[:33] + [1, 2]], greedy(3))
    assert [e.length for e in entries(eng)] == [16, 32]
    e16, e32 = entries(eng)
    assert [eng.pool.ref_counts[b] for b in e32.blocks] == [2, 2, 1, 1]  # no reference leaked
    assert outs[0].token_ids == outs[1].token_ids
    for q, o in zip([p, p, p[:33] + [1, 2]], outs):
        assert_reference(model, q, o)
    assert_idle(eng)


def test_lru_eviction_order_under_a_small_budget(model):
    per_entry = ModelCache.bytes_per_slot(model.config, model.dtype)
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=8, num_blocks=40, prefix_interval=16,
                 prefix_cache_bytes=2 * per_entry + 100)
    p1, p2, p3 = (random_token_ids(17, 500, seed=s) for s in (11, 12, 13))
    eng.generate([p1], greedy(1)), eng.generate([p2], greedy(1))
    assert [e.tokens for e in entries(eng)] == [pc.token_bytes(p1[:16]), pc.token_bytes(p2[:16])]
    (hit,) = eng.generate([p1[:16] + [9, 9]], greedy(1))  # touches p1: p2 is now least recent
    assert hit.cached_tokens == 16
    eng.generate([p3], greedy(1))
    assert [e.tokens for e in entries(eng)] == [pc.token_bytes(p1[:16]), pc.token_bytes(p3[:16])]
    s = eng.stats()
    assert (s["prefix_evictions"], s["prefix_entries"], s["prefix_bytes"]) == (1, 2, 2 * per_entry)
    assert eng.pool.num_free == 40 - 4  # p2's two blocks went back with its entry
    (stale,) = eng.generate([p2[:16] + [5]], greedy(1))  # no stale key points at p2's reused blocks
    assert stale.cached_tokens == 0
    assert_reference(model, p2[:16] + [5], stale)
    assert_idle(eng)
    with pytest.raises(ValueError, match="less than one snapshot"):
        Engine(model, slots=1, block_tokens=8, num_blocks=8, prefix_interval=16, prefix_cache_bytes=per_entry - 1)
    with pytest.raises(ValueError, match="prefix_interval"):
        Engine(model, slots=1, block_tokens=8, num_blocks=8, prefix_interval=-1)


def test_kv_pressure_evicts_entries_before_preempting(model):
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=8, num_blocks=12, prefix_interval=16)
    warm = [random_token_ids(33, 500, seed=s) for s in (21, 22)]
    eng.generate(warm, greedy(1))
    assert eng.stats()["prefix_entries"] == 4 and eng.pool.num_free == 12 - 8
    # two requests that need 5 + 5 blocks: the pool has 4 free, the entries hold the rest
    prompts = [random_token_ids(36, 500, seed=s) for s in (23, 24)]
    outs = eng.generate(prompts, greedy(3))
    s = eng.stats()
    assert s["preemptions"] == 0 and s["prefix_evictions"] >= 2
    for q, o in zip(prompts, outs):
        assert_reference(model, q, o)
    assert_idle(eng)


def test_a_hash_collision_is_a_miss(model, monkeypatch):
    monkeypatch.setattr(pc, "chunk_key", lambda parent, tokens: 42)  # every prefix gets the same key
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=8, num_blocks=40, prefix_interval=16)
    a, b = random_token_ids(40, 500, seed=31), random_token_ids(40, 500, seed=32)
    eng.generate([a], greedy(2))
    (e,) = entries(eng)  # the 32-token prefix collided with the 16-token one and was dropped
    assert e.length == 16
    (ob,) = eng.generate([b], greedy(3))
    assert ob.cached_tokens == 0 and eng.stats()["prefix_hits"] == 0
    assert_reference(model, b, ob)
    assert_idle(eng)


def test_off_by_zero_interval_and_copy_on_write_for_partial_blocks(model):
    off = Engine(model, slots=1, step_tokens=32, block_tokens=8, num_blocks=20, prefix_interval=0)
    assert off.prefix is None and off.stats()["prefix_entries"] == 0 and off.clear_prefix_cache() == 0
    # interval 12 with 8-token blocks: an entry shares one whole block and keeps a copy of the half one
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=8, num_blocks=20, prefix_interval=12)
    p = random_token_ids(30, 500, seed=41)
    (o1,) = eng.generate([p], greedy(2))
    e12, e24 = entries(eng)
    assert (len(e12.blocks), len(e24.blocks)) == (1, 3) and e12.tail is not None
    q = p[:12] + random_token_ids(9, 500, seed=42)
    (o2,) = eng.generate([q], greedy(4))
    assert o2.cached_tokens == 12
    assert_reference(model, p, o1)
    assert_reference(model, q, o2)
    assert_idle(eng)


# ---- random workloads around shared prefixes
@st.composite
def workloads(draw):
    interval, bt = draw(st.sampled_from([(16, 8), (16, 16), (32, 16), (12, 8)]))
    sys_len = draw(st.one_of(st.integers(interval // 2, 3 * interval), st.sampled_from([interval, 2 * interval])))
    system = random_token_ids(sys_len, 500, seed=draw(st.integers(0, 999)))
    prompts = []
    for _ in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["question", "whole", "diverge", "duplicate"]))
        if kind == "whole" or (kind == "duplicate" and not prompts):
            p = list(system)
        elif kind == "duplicate":
            p = list(draw(st.sampled_from(prompts)))
        elif kind == "diverge":  # one token after a boundary, then a tail
            k = draw(st.integers(1, max(1, sys_len // interval))) * interval
            p = (system + random_token_ids(interval, 500, seed=7))[:k] + [draw(st.integers(0, 499))]
            p += random_token_ids(draw(st.integers(0, 8)), 500, seed=draw(st.integers(0, 999)))
        else:
            p = system + random_token_ids(draw(st.integers(1, interval)), 500, seed=draw(st.integers(0, 999)))
        prompts.append(p)
    reqs = [(draw(st.integers(0, 6)), p, draw(st.integers(1, 5))) for p in prompts]
    slots = draw(st.integers(1, 4))
    need = max(BlockPool.blocks_for(len(p) + n - 1, bt) for _, p, n in reqs)
    return dict(interval=interval, bt=bt, slots=slots, step_tokens=draw(st.integers(max(8, slots), 48)),
                num_blocks=need + draw(st.integers(0, 12)), reqs=reqs)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(w=workloads())
def test_shared_prefix_workloads_match_cache_off_and_each_request_alone(model, w):
    kw = dict(slots=w["slots"], step_tokens=w["step_tokens"], block_tokens=w["bt"], num_blocks=w["num_blocks"])
    on = Engine(model, prefix_interval=w["interval"], **kw)
    reqs = [(arrive, prompt, greedy(n)) for arrive, prompt, n in w["reqs"]]
    outs_on = run_arrivals(on, reqs, max_steps=5000)
    outs_off = run_arrivals(Engine(model, prefix_interval=0, **kw), reqs, max_steps=5000)
    for (_, prompt, _), o_on, o_off in zip(w["reqs"], outs_on, outs_off):
        if o_on.token_ids != o_off.token_ids:  # only where the reference has a near tie
            assert_reference(model, prompt, o_off)
        assert_reference(model, prompt, o_on)
        # a whole-prompt hit leaves the last prompt token to run, unless generated tokens follow it (preempted)
        if o_on.num_preemptions == 0:
            assert o_on.cached_tokens < len(prompt) and o_on.cached_tokens % w["interval"] == 0
    # prefix entries count as free for a victim's readmission: still never preempted twice
    assert max(o.num_preemptions for o in outs_on) <= 1
    s = on.stats()
    assert s["prefix_hit_tokens"] >= sum(o.cached_tokens for o in outs_on)
    assert s["prefix_lookups"] >= len(w["reqs"]) and s["prefix_bytes"] <= on.prefix.budget
    assert_idle(on)
