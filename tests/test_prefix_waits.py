"""Shared in-flight prefixes, exactly: which requests are held back in which step, for which leader and
boundary, when they are released (target published, leader gone, limit reached) and what they restore;
held requests run nothing and hold no blocks, and outputs stay those of each request run alone."""

import mlx.core as mx
import pytest

import mtlqwen
from mtlqwen.runtime import Engine
from mtlqwen.runtime import prefix_cache as pc
from mtlqwen.runtime.failures import EvalFailed
from mtlqwen.runtime.kv_manager import KVManager
from mtlqwen.runtime.scheduler import Scheduler
from mtlqwen.runtime.sequence import Sequence

from engine_checks import assert_idle, assert_reference, greedy
from hf_checkpoints import random_token_ids, write_tiny_checkpoint

SYSTEM = list(range(100, 132))  # 32 shared tokens: two 16-token intervals


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return mtlqwen.load(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def seq(rid, tokens, max_tokens=20):
    return Sequence(rid, list(tokens), greedy(max_tokens), seed=0)


def summary(plan):
    return [(s.seq.request_id, s.start, s.num_tokens) for s in plan.scheduled]


def commit(plan, token=7):
    for s in plan.scheduled:
        if s.samples:
            s.seq.pending -= 1
            s.seq.tokens.append(token)


def scheduler(slots=2, step_tokens=16):
    return Scheduler(KVManager(40, 8, prefix_interval=16, prefix_cache_bytes=1 << 20, identity="x"), slots, step_tokens)


def test_a_held_request_runs_nothing_and_is_released_at_its_limit():
    sch = scheduler()
    a, w = seq("a", SYSTEM + [1, 2, 3, 4]), seq("w", SYSTEM + [5, 6, 7, 8])
    sch.add(a), sch.add(w)
    plan = sch.schedule()
    assert (plan.admitted, plan.held, summary(plan)) == ([a, w], [w], [("a", 0, 16)])
    wait = sch.held[w]
    # a and w prefilling: 8 tokens a step for w alone, so 4 steps to 32, plus one for the read-back
    assert (wait.leader, wait.target, wait.since, wait.until) == (a, 32, 1, 6)
    assert (w.slot, w.kv_valid, w.block_table, w.restore) == (1, 0, [], None)
    assert sch.kv.stats()["prefix_lookups"] == 1  # a held request is not looked up (counted) until released
    commit(plan)
    held_in = [1]
    for step in range(2, 7):  # nothing is published (no engine here): w waits out its limit
        plan = sch.schedule()
        assert plan.held == [w] and all(s.seq is a for s in plan.scheduled)
        held_in.append(step)
        commit(plan)
    plan = sch.schedule()
    assert (held_in, plan.held, plan.released) == ([1, 2, 3, 4, 5, 6], [], [w])
    assert summary(plan) == [("a", 39, 1), ("w", 0, 15)]  # a decodes; w computes from scratch, cut at 16
    s = sch.stats()
    assert (s["prefix_waiting"], s["prefix_waits"], s["prefix_wait_steps"], s["prefix_wait_timeouts"]) == (0, 1, 6, 1)
    assert sch.kv.stats()["prefix_lookups"] == 2


def test_a_held_request_restores_the_published_target_and_is_freed_when_its_leader_leaves():
    sch = scheduler(slots=3)
    kv, pool = sch.kv, sch.kv.pool
    a, w = seq("a", SYSTEM + [1, 2]), seq("w", SYSTEM + [3])
    other = seq("o", SYSTEM[:16] + [9] * 20)  # shares 16 tokens with a: waits for the 16 boundary only
    for s in (a, w, other):
        sch.add(s)
    plan = sch.schedule()
    assert plan.held == [w, other] and (sch.held[w].target, sch.held[other].target) == (32, 16)
    commit(plan)
    plan = sch.schedule()  # a reaches 32; publish its 32-token snapshot as the engine would at read-back
    assert summary(plan) == [("a", 16, 16)] and a.kv_valid == 32
    cap = pc.Capture(a, 32, list(a.block_table[:4]), [mx.zeros((1, 2))], None)
    pool.share(cap.blocks)
    kv.prefix.publish([cap])
    (e,) = kv.prefix.entries.values()
    plan = sch.schedule()
    # w: its target is cached, restored at once; other: 32 is no prefix of it, and 16 was never published
    assert plan.released == [w] and plan.held == [other]
    assert (w.restore, e.pins, w.block_table[:4], w.cached_tokens) == (e, 1, a.block_table[:4], 32)
    assert summary(plan) == [("a", 32, 2), ("w", 32, 1)]
    sch.release(a)  # the leader leaves (finished or cancelled): other stops waiting
    plan = sch.schedule()
    assert plan.released == [other] and not sch.held and other.cached_tokens == 0
    assert summary(plan) == [("w", 33, 1), ("o", 0, 15)]  # w decodes; other computes from scratch
    s = sch.stats()
    assert (s["prefix_waits"], s["prefix_wait_steps"], s["prefix_wait_timeouts"]) == (2, 2 + 3, 0)


def test_no_wait_without_a_longer_shared_prefix_in_flight():
    sch = scheduler(slots=3)
    a = seq("a", SYSTEM + [1])
    sch.add(a)
    commit(sch.schedule()), commit(sch.schedule())
    assert a.kv_valid == 32  # a computed the shared prefix already (launched): nothing left to wait for
    late, short = seq("late", SYSTEM + [2]), seq("short", SYSTEM[:16])  # short: 15 tokens to share at most
    sch.add(late), sch.add(short)
    plan = sch.schedule()
    assert plan.held == [] and plan.admitted == [late, short]
    off = Scheduler(KVManager(40, 8), 2, 16)  # no prefix cache: no waits
    b, c = seq("b", SYSTEM + [1]), seq("c", SYSTEM + [2])
    off.add(b), off.add(c)
    assert off.schedule().held == [] and off.stats()["prefix_waits"] == 0


def test_who_waits_for_whom_through_the_engine(model):
    """Two system prompts, two requests each, arriving together: one of each pair computes, its partner
    waits for the 32-token snapshot, then restores it and runs only its own tokens."""
    eng = Engine(model, slots=4, step_tokens=32, block_tokens=8, num_blocks=60, prefix_interval=16)
    s1, s2 = random_token_ids(32, 500, seed=61), random_token_ids(32, 500, seed=62)
    prompts = {"a": s1 + [1, 2, 3, 4], "b": s1 + [5, 6, 7, 8], "c": s2 + [1, 2, 3, 4], "d": s2 + [9, 9, 9, 9]}
    plans, schedule = [], eng.scheduler.schedule

    def record():
        plan = schedule()
        plans.append(([q.request_id for q in plan.held], [q.request_id for q in plan.released], summary(plan)))
        return plan

    eng.scheduler.schedule = record
    for rid, p in prompts.items():
        eng.submit(p, greedy(3, ignore_eos=True), request_id=rid)
    waits = {q.request_id: (w.leader.request_id, w.target, w.until) for q, w in eng.scheduler.held.items()}
    outs = {}
    while eng.has_work():
        if not waits:
            waits = {q.request_id: (w.leader.request_id, w.target, w.until) for q, w in eng.scheduler.held.items()}
        outs.update({d.request_id: d.output for d in eng.step() if d.finished})
    # b's limit: 2 prefilling (a, b) -> 16 a step -> 2 steps + 1; d's: 3 (a, c, d) -> 10 a step -> 4 steps + 1
    assert waits == {"b": ("a", 32, 4), "d": ("c", 32, 6)}
    assert plans[:4] == [
        (["b", "d"], [], [("a", 0, 16), ("c", 0, 16)]),
        # the 32 snapshots are published when this step is launched (their tokens are prompt tokens)
        (["b", "d"], [], [("a", 16, 16), ("c", 16, 16)]),
        # so b and d restore them in the next step, beside their leaders' last prompt tokens
        ([], ["b", "d"], [("a", 32, 4), ("b", 32, 4), ("c", 32, 4), ("d", 32, 4)]),
        ([], [], [("a", 36, 1), ("b", 36, 1), ("c", 36, 1), ("d", 36, 1)]),
    ]
    assert {r: o.cached_tokens for r, o in outs.items()} == {"a": 0, "b": 32, "c": 0, "d": 32}
    s = eng.stats()
    assert (s["prefix_waits"], s["prefix_wait_steps"], s["prefix_wait_timeouts"], s["prefix_waiting"]) == (2, 4, 0, 0)
    assert s["prefill_tokens"] == 2 * 36 + 2 * 4  # the shared prompts were computed once each
    for rid, p in prompts.items():
        assert_reference(model, p, outs[rid], max_tokens=3)
    assert_idle(eng)


def test_a_cancelled_leader_releases_its_waiters(model):
    eng = Engine(model, slots=2, step_tokens=16, block_tokens=8, num_blocks=40, prefix_interval=16)
    p = random_token_ids(32, 500, seed=63)
    a, b = eng.submit(p + [1], greedy(2)), eng.submit(p + [2], greedy(2))
    eng.step()  # a computes its first 16 tokens; that snapshot is published at launch, the 32 one is not yet
    (held,) = eng.scheduler.held
    assert held.request_id == b and eng.scheduler.held[held].target == 32
    eng.cancel(a)
    outs = []
    while eng.has_work():
        outs += [d.output for d in eng.step() if d.finished]
    done = {o.request_id: o for o in outs}
    assert done[a].finish_reason == "cancelled" and done[b].cached_tokens == 16
    assert eng.stats()["prefix_wait_timeouts"] == 0 and not eng.scheduler.held
    assert_reference(model, p + [2], done[b])
    assert_idle(eng)


def test_a_preempted_leader_releases_its_waiter_which_leads_in_turn():
    sch = scheduler()
    a, w = seq("a", SYSTEM + [1, 2, 3, 4]), seq("w", SYSTEM + [5, 6, 7, 8])
    sch.add(a), sch.add(w)
    plan = sch.schedule()
    assert plan.held == [w]
    sch._preempt(a, [], [])  # as the scheduler does under memory pressure, a's token not in flight
    plan = sch.schedule()
    # w's leader left: w is admitted and computes; a, readmitted behind it, now waits for w
    assert (plan.released, plan.admitted, plan.held) == ([w], [a], [a])
    assert summary(plan) == [("w", 0, 16)] and sch.held[a].leader is w and sch.held[a].target == 32
    sch.release(a)  # a held request that leaves (cancelled): its slot comes back, nothing else to free
    assert not sch.held and a.slot is None and sch.free_slots == [0]
    s = sch.stats()
    assert (s["prefix_waits"], s["prefix_wait_steps"], s["prefix_wait_timeouts"], s["preemptions"]) == (2, 1, 0, 1)


def test_a_read_back_failure_withdraws_the_snapshot_its_waiter_restored(model, monkeypatch):
    """The leader's step publishes its 32-token snapshot at launch and the waiter restores it in the next step;
    when the leader's step then fails at read-back, both fail, the entry is withdrawn (its state was never
    computed), and a later request of the same prefix computes it afresh and gets its tokens alone."""
    eng = Engine(model, slots=2, step_tokens=16, block_tokens=8, num_blocks=40, prefix_interval=16)
    p = random_token_ids(32, 500, seed=64)
    a, b = eng.submit(p + [1], greedy(3)), eng.submit(p + [2], greedy(3))
    real, failing = eng._commit, []

    def faulty(flight):
        if failing and flight is failing[0]:
            raise EvalFailed(RuntimeError("injected read-back failure"))
        return real(flight)

    monkeypatch.setattr(eng, "_commit", faulty)
    eng.step()  # a: 0..16, b held for 32
    eng.step()  # a: 16..32, its 32 snapshot published at launch
    assert sorted(e.length for e in eng.prefix.entries.values()) == [16, 32]
    failing.append(eng._inflight)
    outs = {d.request_id: d.output for d in eng.step() if d.finished}  # b restores 32, then a's read-back fails
    assert set(outs) == {a, b} and all(o.finish_reason == "error" for o in outs.values())
    assert "injected read-back failure" in outs[b].error and outs[b].cached_tokens == 32
    assert not eng.prefix.entries and not eng.has_work()
    (c,) = eng.generate([p + [3]], greedy(3))
    assert c.cached_tokens == 0
    assert_reference(model, p + [3], c)
    assert_idle(eng)
