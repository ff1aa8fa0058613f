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


def entries(eng, kind=None):
    """Entries least recently used first; of one kind ("interval" or "turn") when given."""
    return [e for e in eng.prefix.entries.values() if kind is None or e.kind == kind]


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
    assert oa.finish_reason == "length"
    e16, e32, t42 = entries(eng)  # and a turn entry for the 40 + 3 - 1 tokens that ran
    assert (e16.length, e32.length, t42.length, t42.kind, oa.cached_tokens) == (16, 32, 42, "turn", 0)
    assert e32.blocks[:2] == e16.blocks and len(e32.blocks) == 4
    assert t42.blocks[:4] == e32.blocks and len(t42.blocks) == 5 and t42.tail is not None  # 42 = 5 blocks + 2
    refs = lambda: [eng.pool.ref_counts[b] for b in t42.blocks]  # noqa: E731
    assert refs() == [3, 3, 2, 2, 1]
    assert (eng.stats()["free_blocks"], eng.stats()["prefix_blocks"]) == (40 - 5, 5)  # nested entries share blocks
    b = a[:32] + random_token_ids(6, 500, seed=2)
    rid = eng.submit(b, greedy(4))
    eng.step()
    seq = eng._seqs[rid]
    assert seq.block_table[:4] == e32.blocks and refs() == [4, 4, 3, 3, 1] and seq.kv_valid > 32
    outs = []
    while eng.has_work():
        outs += [d.output for d in eng.step() if d.finished]
    (ob,) = outs
    t41 = entries(eng)[-1]  # b's own turn entry (38 + 4 - 1 tokens) holds its first four blocks too
    assert (t41.length, t41.blocks[:4]) == (41, e32.blocks)
    assert refs() == [4, 4, 3, 3, 1] and ob.cached_tokens == 32  # t42 is longer than b: the 32 entry hits
    assert_reference(model, a, oa)
    assert_reference(model, b, ob)
    s = eng.stats()
    assert (s["prefix_lookups"], s["prefix_hits"], s["prefix_hit_tokens"], s["prefix_query_tokens"]) == (2, 1, 32, 78)
    per_slot, per_block = ModelCache.bytes_per_slot(model.config, model.dtype), ModelCache.bytes_per_block(model.config, 8, model.dtype)
    assert (s["prefix_entries"], s["prefix_turn_entries"], s["prefix_turns_kept"], s["prefix_turn_hits"]) == (4, 2, 2, 0)
    assert s["prefix_bytes"] == 4 * per_slot + 2 * per_block and s["prefix_turn_bytes"] == 2 * (per_slot + per_block)
    assert s["prefix_blocks"] == 6  # b (38 + 4 tokens) reaches no boundary past 32; its turn entry adds its 5th block
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
        e, t = entries(eng)
        assert e.length == 16 and e.tokens == pc.token_bytes((p + o.token_ids)[:16])
        assert (t.kind, t.length, t.tokens) == ("turn", len(p) + 9, pc.token_bytes((p + o.token_ids)[:-1]))
        q = (p + o.token_ids)[:16] + [3, 4]
        (o2,) = eng.generate([q], greedy(3))
        assert o2.cached_tokens == 16
        assert_reference(model, q, o2)
        nxt = p + o.token_ids + [3, 4]  # the next turn: restored at the turn entry, past the boundary
        (o3,) = eng.generate([nxt], greedy(2))
        assert o3.cached_tokens == len(p) + 9 and eng.stats()["prefix_turn_hits"] == 1
        assert_reference(model, nxt, o3)
    assert_idle(eng)


def test_a_cache_salt_is_chained_in_before_the_tokens():
    tokens = list(range(100, 132))
    cache = pc.PrefixCache(BlockPool(4), 16, 8, 1 << 20, "mtlqwen-test-identity")
    root = pc.root_key("mtlqwen-test-identity")
    salted = xxhash.xxh3_64_intdigest(struct.pack("<Q", root) + "salt:tenant-\u00e9".encode())
    seq = Sequence(0, tokens, greedy(1, cache_salt="tenant-\u00e9"), seed=0)
    assert cache.root_of(seq) == salted and cache.keys(seq, 2) == pc.prefix_keys(salted, tokens, 16)
    assert cache.keys(Sequence(1, tokens, greedy(1), seed=0), 2) == pc.prefix_keys(root, tokens, 16)


def test_requests_share_entries_and_waits_only_within_their_salt(model):
    """The same prompt three ways at once and again: unsalted, salt a, salt b. Each salt computes its own
    prefix (no wait across salts) and later hits only its own entries, turn entries included."""
    eng = Engine(model, slots=3, step_tokens=48, block_tokens=8, num_blocks=60, prefix_interval=16)
    p = random_token_ids(35, 500, seed=6)
    salts = [None, "a", "b"]
    first = eng.generate([p] * 3, [greedy(3, cache_salt=s) for s in salts])
    assert [o.cached_tokens for o in first] == [0, 0, 0] and eng.stats()["prefix_waits"] == 0
    assert sorted(e.length for e in entries(eng, "interval")) == [16, 16, 16, 32, 32, 32]
    again = eng.generate([p + first[0].token_ids + [7]] * 3 + [p], [greedy(2, cache_salt=s) for s in salts + ["c"]])
    assert [o.cached_tokens for o in again] == [37, 37, 37, 0]  # each its own turn entry; "c" nothing
    assert [o.token_ids for o in first] == [first[0].token_ids] * 3
    assert_idle(eng)


def test_requests_sharing_an_uncached_prefix_wait_and_one_entry_is_kept(model):
    eng = Engine(model, slots=3, step_tokens=48, block_tokens=8, num_blocks=40, prefix_interval=16)
    p = random_token_ids(35, 500, seed=5)
    prompts = [p, p, p[:33] + [1, 2]]
    outs = eng.generate(prompts, greedy(3))
    # the second and third wait for the first's 32-token snapshot instead of computing it again
    assert [o.cached_tokens for o in outs] == [0, 32, 32]
    assert [(e.kind, e.length) for e in entries(eng)] == [("interval", 16), ("interval", 32), ("turn", 37), ("turn", 37)]
    e16, e32, t_same, t_other = entries(eng)  # the two identical requests keep one turn entry
    assert t_same.tokens == pc.token_bytes((p + outs[0].token_ids)[:37]) and t_other.tokens != t_same.tokens
    assert [eng.pool.ref_counts[b] for b in e32.blocks] == [4, 4, 3, 3]  # no reference leaked
    s = eng.stats()
    assert (s["prefix_waits"], s["prefix_wait_timeouts"], s["prefix_hits"], s["prefix_turns_kept"]) == (2, 0, 2, 2)
    assert outs[0].token_ids == outs[1].token_ids
    for q, o in zip(prompts, outs):
        assert_reference(model, q, o)
    assert_idle(eng)


def test_lru_eviction_with_a_second_chance_for_hit_entries_under_one_budget(model):
    per_entry = ModelCache.bytes_per_slot(model.config, model.dtype)
    per_turn = per_entry + ModelCache.bytes_per_block(model.config, 8, model.dtype)  # a turn entry's partial block
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=8, num_blocks=40, prefix_interval=16,
                 prefix_cache_bytes=2 * per_entry + 2 * per_turn + 100)  # two of each kind
    p1, p2, p3, p4 = (random_token_ids(17, 500, seed=s) for s in (11, 12, 13, 14))
    q = p1[:16] + [9, 9]
    view = lambda: [(e.kind, e.tokens) for e in entries(eng)]  # noqa: E731
    iv = lambda t: ("interval", pc.token_bytes(t[:16]))  # noqa: E731
    turn = lambda t: ("turn", pc.token_bytes(t))  # noqa: E731
    eng.generate([p1], greedy(1)), eng.generate([p2], greedy(1))  # each: an interval entry, a turn entry at 17
    assert view() == [iv(p1), turn(p1), iv(p2), turn(p2)]
    (hit,) = eng.generate([q], greedy(1))  # hits p1's interval entry; its own turn entry evicts p1's turn entry
    assert hit.cached_tokens == 16
    assert view() == [iv(p2), turn(p2), iv(p1), turn(q)]
    eng.generate([p3], greedy(1))  # p2's pair is least recent
    assert view() == [iv(p1), turn(q), iv(p3), turn(p3)]
    eng.generate([p4], greedy(1))  # p1's interval entry was hit: spared once (to the recent end), q's turn entry goes
    assert view() == [turn(p3), iv(p4), iv(p1), turn(p4)]
    eng.generate([p2], greedy(1))
    assert view() == [iv(p1), turn(p4), iv(p2), turn(p2)]
    eng.generate([p3], greedy(1))  # p1's entry has lost its mark: plain LRU again
    assert view() == [iv(p2), turn(p2), iv(p3), turn(p3)]
    s = eng.stats()
    assert (s["prefix_evictions"], s["prefix_entries"], s["prefix_bytes"]) == (9, 4, 2 * per_entry + 2 * per_turn)
    assert eng.pool.num_free == 40 - 4  # two blocks per kept prompt (its turn entry shares them)
    (stale,) = eng.generate([p4[:16] + [5]], greedy(1))  # no stale key points at p4's reused blocks
    assert stale.cached_tokens == 0
    assert_reference(model, p4[:16] + [5], stale)
    assert_idle(eng)
    with pytest.raises(ValueError, match="less than one snapshot"):
        Engine(model, slots=1, block_tokens=8, num_blocks=8, prefix_interval=16, prefix_cache_bytes=per_entry - 1)
    with pytest.raises(ValueError, match="prefix_interval"):
        Engine(model, slots=1, block_tokens=8, num_blocks=8, prefix_interval=-1)


def test_kv_pressure_evicts_entries_before_preempting(model):
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=8, num_blocks=12, prefix_interval=16)
    warm = [random_token_ids(33, 500, seed=s) for s in (21, 22)]
    eng.generate(warm, greedy(1))
    assert (eng.stats()["prefix_entries"], eng.stats()["prefix_turn_entries"], eng.pool.num_free) == (6, 2, 12 - 8)
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
    e12, e24, t31 = entries(eng)
    assert (len(e12.blocks), len(e24.blocks)) == (1, 3) and e12.tail is not None
    assert (t31.length, len(t31.blocks), t31.tail is not None) == (31, 3, True)
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
    sch, schedule = on.scheduler, on.scheduler.schedule

    def checked():  # a held request runs nothing, holds no blocks, and is never held past its limit
        plan = schedule()
        assert not set(plan.held) & {s.seq for s in plan.scheduled}
        assert all(q.block_table == [] and sch.steps <= x.until for q, x in sch.held.items())
        return plan

    sch.schedule = checked
    outs_on = run_arrivals(on, reqs, max_steps=5000)
    outs_off = run_arrivals(Engine(model, prefix_interval=0, **kw), reqs, max_steps=5000)
    ran = [prompt + o.token_ids for (_, prompt, _), o in zip(w["reqs"], outs_on)]
    for (_, prompt, _), o_on, o_off in zip(w["reqs"], outs_on, outs_off):
        if o_on.token_ids != o_off.token_ids:  # only where the reference has a near tie
            assert_reference(model, prompt, o_off)
        assert_reference(model, prompt, o_on)
        # a whole-prompt hit leaves the last prompt token to run, unless generated tokens follow it (preempted)
        if o_on.num_preemptions == 0:
            n = o_on.cached_tokens
            assert n < len(prompt)
            # at a boundary, or at another request's turn entry: its tokens that ran (the last sampled one maybe)
            assert n % w["interval"] == 0 or any(n in (len(r) - 1, len(r)) and r[:n] == prompt[:n] for r in ran)
    # prefix entries count as free for a victim's readmission: still never preempted twice
    assert max(o.num_preemptions for o in outs_on) <= 1
    s = on.stats()
    assert s["prefix_hit_tokens"] >= sum(o.cached_tokens for o in outs_on)
    assert s["prefix_lookups"] >= len(w["reqs"]) and s["prefix_bytes"] <= on.prefix.budget
    assert_idle(on)


def test_the_step_in_flight_when_the_last_request_finishes_is_read_back(model):
    """The request's last token is read back while the next step (its anchor at position 15) is in flight and
    captures the 16-token boundary, to publish at that step's read-back; with no request left nothing would
    read it back, and its references would stay held while the engine idles. The engine reads it back at once:
    the capture meets the turn entry kept at 16 (one entry), and only that entry holds the two blocks."""
    prompt = random_token_ids(12, 500, seed=52)
    kw = dict(slots=1, step_tokens=16, block_tokens=8, num_blocks=2)
    (first,) = Engine(model, prefix_interval=0, **kw).generate([prompt], greedy(4, ignore_eos=True))
    stop = first.token_ids[3]  # the 4th token ends the request as a stop token: not known before its read-back
    assert stop not in first.token_ids[:3]
    eng = Engine(model, prefix_interval=16, **kw)
    (out,) = eng.generate([prompt], greedy(5, ignore_eos=True, stop_token_ids=[stop]))
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids
    assert eng._inflight is None and not eng.has_work()
    assert [(e.length, e.blocks) for e in eng.prefix.entries.values()] == [(16, [0, 1])]
    assert list(eng.pool.ref_counts) == [1, 1]
    assert_idle(eng)
