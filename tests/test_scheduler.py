"""The scheduler, exactly: budget split, admission, block reservation and preemption (no arrays)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtlqwen.runtime.block_pool import BlockPool
from mtlqwen.runtime.kv_manager import KVManager
from mtlqwen.runtime.sampling import SamplingParams
from mtlqwen.runtime.scheduler import Scheduler, split_budget
from mtlqwen.runtime.sequence import Sequence, SeqStatus


def seq(rid, prompt_len, max_tokens=8):
    return Sequence(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0)


def make(num_blocks, slots, budget, block_tokens=4):
    return Scheduler(KVManager(num_blocks, block_tokens), slots, budget)


def commit(plan, token=7):
    """What the engine does when a step's tokens are read back (without its one-step lag)."""
    for s in plan.scheduled:
        if s.samples:
            s.seq.pending -= 1
            s.seq.tokens.append(token)


def summary(plan):
    return [(s.seq.request_id, s.start, s.num_tokens, s.samples) for s in plan.scheduled]


# ---- the split rule
@pytest.mark.parametrize(
    "needs,budget,shares",
    [
        ([100, 100, 100], 128, [43, 43, 42]),  # remainder 2 goes to the two earliest
        ([100, 100, 100], 127, [43, 42, 42]),
        ([5, 100, 100], 128, [5, 62, 61]),  # 5 fits its share; the other 123 are re-split
        ([3, 40, 41], 16, [3, 7, 6]),
        ([50, 7, 9, 200], 40, [12, 7, 9, 12]),  # 7 and 9 fit the first offer (10); 24 left for two
        ([10, 10], 128, [10, 10]),  # budget left unused
        ([1000], 125, [125]),
        ([], 128, []),
        ([9, 9, 9], 2, [1, 1, 0]),  # fewer tokens than sequences: the earliest get one
    ],
)
def test_split_budget(needs, budget, shares):
    assert split_budget(needs, budget) == shares
    assert sum(shares) == min(budget, sum(needs))
    assert all(0 <= s <= n for s, n in zip(shares, needs))


# ---- mixes of decoding and prefilling sequences
def test_prefill_chunks_decode_anchors_and_blocks_on_boundaries():
    sch = make(num_blocks=100, slots=3, budget=16)
    a, b, c, d = seq("a", 10), seq("b", 3), seq("c", 30), seq("d", 2)
    for s_ in (a, b, c, d):
        sch.add(s_)
    p1 = sch.schedule()
    assert [s_.request_id for s_ in p1.admitted] == ["a", "b", "c"]
    assert (a.slot, b.slot, c.slot, d.slot) == (0, 1, 2, None)
    assert [s_.request_id for s_ in sch.waiting] == ["d"]
    # split [10, 3, 30] of 16: b fits (3), then a 7, c 6; b's chunk ends its prompt, so b samples
    assert summary(p1) == [("a", 0, 7, False), ("b", 0, 3, True), ("c", 0, 6, False)]
    assert [s_.fresh for s_ in p1.scheduled] == [True, True, True]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2], [3, 4])
    assert (a.kv_valid, b.kv_valid, c.kv_valid, b.pending) == (7, 3, 6, 1)
    commit(p1)

    p2 = sch.schedule()
    # b decodes its anchor (1); a (needs 3) and c split 15: a 3, c 12
    assert summary(p2) == [("a", 7, 3, True), ("b", 3, 1, True), ("c", 6, 12, False)]
    assert [s_.fresh for s_ in p2.scheduled] == [False, False, False]
    assert [s_.sample_index for s_ in p2.scheduled] == [0, 1, 0]
    # a reaches 10 tokens (3 blocks), b 4 (still 1 block), c 18 (5 blocks)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 5], [2], [3, 4, 6, 7, 8])
    commit(p2)

    p3 = sch.schedule()  # two decoding sequences; c gets the other 14 and 12 of them finish its prompt
    assert summary(p3) == [("a", 10, 1, True), ("b", 4, 1, True), ("c", 18, 12, True)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 5], [2, 9], [3, 4, 6, 7, 8, 10, 11, 12])
    assert sch.kv.pool.num_free == 100 - 13


def test_every_live_sequence_advances_and_fifo_admission():
    sch = make(num_blocks=100, slots=2, budget=8)
    seqs = [seq(i, 5, max_tokens=2) for i in range(4)]
    for s_ in seqs:
        sch.add(s_)
    p = sch.schedule()
    assert summary(p) == [(0, 0, 4, False), (1, 0, 4, False)]
    commit(p)
    p = sch.schedule()
    assert summary(p) == [(0, 4, 1, True), (1, 4, 1, True)]
    commit(p)
    p = sch.schedule()
    assert summary(p) == [(0, 5, 1, True), (1, 5, 1, True)]
    commit(p)
    # both reached max_tokens: the engine releases them, and the queue moves up in order
    for s_ in seqs[:2]:
        assert s_.sampling_done
        sch.release(s_)
    assert sch.free_slots == [0, 1] and sch.kv.pool.num_free == 100
    p = sch.schedule()
    assert [s_.request_id for s_ in p.admitted] == [2, 3] and (seqs[2].slot, seqs[3].slot) == (0, 1)


def test_sampling_done_sequences_wait_for_read_back():
    sch = make(num_blocks=10, slots=2, budget=8)
    a = seq("a", 2, max_tokens=1)
    sch.add(a)
    p = sch.schedule()
    assert summary(p) == [("a", 0, 2, True)]
    assert a.sampling_done and a.pending == 1
    assert sch.schedule().scheduled == []  # its one token is in flight: nothing more to run
    assert a.status is SeqStatus.RUNNING  # slot and blocks held until the engine reads it back


def test_budget_must_cover_one_token_per_slot():
    with pytest.raises(ValueError, match="step_tokens"):
        make(num_blocks=10, slots=8, budget=4)


# ---- preemption
def test_preemption_frees_the_newest_and_requeues_it_first():
    sch = make(num_blocks=6, slots=2, budget=8)
    a, b, c = seq("a", 8), seq("b", 8), seq("c", 3)
    for s_ in (a, b, c):
        sch.add(s_)
    p = sch.schedule()
    assert summary(p) == [("a", 0, 4, False), ("b", 0, 4, False)]
    commit(p)
    p = sch.schedule()
    assert summary(p) == [("a", 4, 4, True), ("b", 4, 4, True)]
    assert (a.block_table, b.block_table) == ([0, 2], [1, 3])
    commit(p)
    p = sch.schedule()  # 9 tokens each: a third block each
    assert (a.block_table, b.block_table, sch.kv.pool.num_free) == ([0, 2, 4], [1, 3, 5], 0)
    commit(p)
    for _ in range(3):  # kv_valid 9 -> 12 fits the 3 blocks
        p = sch.schedule()
        assert p.preempted == [] and len(p.scheduled) == 2
        commit(p)
    assert (a.kv_valid, b.kv_valid, a.need) == (12, 12, 1)
    # the 13th token crosses into a 4th block for both; one free block is needed per sequence, none is free
    p = sch.schedule()
    assert p.preempted == [b] and summary(p) == [("a", 12, 1, True)]
    assert b.status is SeqStatus.WAITING and b.slot is None and b.block_table == [] and b.kv_valid == 0
    assert [s_.request_id for s_ in sch.waiting] == ["b", "c"]  # ahead of the never-started request
    assert a.block_table == [0, 2, 4, 5]  # b's blocks were freed tail first: 5, 3, 1
    assert sch.kv.pool.free_ids() == [3, 1]
    assert sch.num_preemptions == 1 and b.num_preemptions == 1
    assert b.tokens == list(range(8)) + [7] * 5  # prompt + what it generated: recomputed from kv_valid 0
    commit(p)


def test_a_preempted_request_resumes_with_prompt_and_generated_tokens():
    sch = make(num_blocks=4, slots=2, budget=8)
    a, b = seq("a", 6, max_tokens=6), seq("b", 6, max_tokens=6)
    sch.add(a)
    sch.add(b)
    plans = []
    while not b.sampling_done or b.status is SeqStatus.WAITING:
        p = sch.schedule()
        plans.append(p)
        commit(p)
        for s_ in (a, b):
            if s_.status is SeqStatus.RUNNING and s_.sampling_done:
                sch.release(s_)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    resumed = next(p for p in plans if b in p.admitted and plans.index(p) > 0)
    (sb,) = [s_ for s_ in resumed.scheduled if s_.seq is b]
    assert sb.start == 0 and sb.fresh  # recompute from an empty state...
    assert b.tokens[:6] == list(range(6)) and len(b.tokens) == 12  # ...over prompt + generated
    assert sch.kv.pool.num_free == 4 - len(b.block_table)


def test_memory_pressure_preempts_newest_computed_sequence():
    sch = make(num_blocks=3, slots=2, budget=8)
    a, b = seq("a", 12, max_tokens=1), seq("b", 4)
    sch.add(a)
    sch.add(b)
    p = sch.schedule()
    assert summary(p) == [("a", 0, 4, False), ("b", 0, 4, True)]
    commit(p)
    p = sch.schedule()
    # b's anchor needs a 2nd block and a's 7 tokens two more: 3 > 1 free, so b (newest) is preempted
    # and a, alone, takes the whole budget
    assert p.preempted == [b] and summary(p) == [("a", 4, 8, True)]
    assert sch.num_preemptions == 1


def test_admitted_then_shed_is_not_a_preemption():
    sch = make(num_blocks=3, slots=2, budget=8)
    a, b = seq("a", 9, max_tokens=4), seq("b", 4)
    sch.add(a)
    p = sch.schedule()
    assert summary(p) == [("a", 0, 8, False)] and sch.kv.pool.num_free == 1
    commit(p)
    sch.add(b)
    p = sch.schedule()
    # b is admitted, but a's 9th token and b's first chunk need 2 blocks with 1 free: b, which has
    # nothing computed yet, goes back to the head of the queue without counting as a preemption
    assert p.admitted == [] and p.preempted == [] and summary(p) == [("a", 8, 1, True)]
    assert list(sch.waiting) == [b] and b.slot is None and sch.num_preemptions == 0


def test_a_preempted_request_with_a_token_in_flight_is_not_readmitted_until_read_back():
    sch = make(num_blocks=100, slots=1, budget=8)
    a = seq("a", 3)
    sch.add(a)
    p = sch.schedule()
    assert a.pending == 1
    sch._preempt(a, [], [])  # as the scheduler does under memory pressure
    assert sch.schedule().scheduled == [] and a.status is SeqStatus.WAITING
    commit(p)
    p = sch.schedule()
    assert summary(p) == [("a", 0, 4, True)]


# ---- admission that does not thrash
def test_a_victim_stays_out_until_the_blocks_to_finish_it_exist():
    sch = make(num_blocks=6, slots=2, budget=8)
    a, b, c = seq("a", 8), seq("b", 8), seq("c", 3)  # a and b need 4 blocks each to finish (8 + 8 - 1 tokens)
    for s_ in (a, b, c):
        sch.add(s_)
    for _ in range(7):  # 2 prefill steps, 4 decode steps to 12 tokens each, then the 13th needs a 4th block
        p = sch.schedule()
        commit(p)
    assert p.preempted == [b] and summary(p) == [("a", 12, 1, True)]
    assert (sch.kv.pool.num_free, sch.kv.blocks_to_finish(a), sch.kv.blocks_to_finish(b)) == (2, 0, 4)
    for start in (13, 14):
        # a slot and 2 blocks are free, enough for b's first chunk, but not for b to finish: b stays out,
        # and c behind it (FIFO), where it used to be readmitted at once and preempted again
        p = sch.schedule()
        assert (p.admitted, p.preempted, summary(p)) == ([], [], [("a", start, 1, True)])
        assert [s_.request_id for s_ in sch.waiting] == ["b", "c"] and sch.free_slots == [1]
        commit(p)
    assert a.sampling_done
    sch.release(a)
    p = sch.schedule()  # 6 blocks free: b (4 to finish) is readmitted, and c after it
    assert [s_.request_id for s_ in p.admitted] == ["b", "c"]
    assert summary(p) == [("b", 0, 5, False), ("c", 0, 3, True)]
    commit(p)
    while sch.running:
        p = sch.schedule()
        commit(p)
        for s_ in list(sch.running):
            if s_.sampling_done and s_.pending == 0:
                sch.release(s_)
    assert (sch.num_preemptions, b.num_preemptions, len(b.generated), len(c.generated)) == (1, 1, 8, 8)
    assert sch.kv.pool.num_free == 6


def test_a_former_victim_waits_for_a_finished_sequences_blocks_instead_of_a_second_preemption():
    """A readmitted victim b and a newcomer c admitted behind it: c samples its only token in the first
    step and holds its block until read-back. When b's next token needs a block and none is free, b is the
    only live sequence: it sits the step out (its blocks kept) rather than being preempted again."""
    sch = make(num_blocks=3, slots=2, budget=8)
    b, c = seq("b", 8, max_tokens=2), seq("c", 4, max_tokens=1)
    b.num_preemptions = 1  # as if preempted before; 8 + 2 - 1 tokens: 3 blocks to finish, 3 free
    sch.add(b)
    sch.add(c)
    p = sch.schedule()
    assert p.admitted == [b, c] and summary(p) == [("b", 0, 4, False), ("c", 0, 4, True)]
    commit(p)
    assert c.sampling_done and sch.kv.pool.num_free == 1
    p = sch.schedule()
    assert summary(p) == [("b", 4, 4, True)] and sch.kv.pool.num_free == 0
    commit(p)
    p = sch.schedule()  # b's 9th token needs a 3rd block; c's comes back only at its read-back
    assert (summary(p), p.preempted, b.num_preemptions, b.block_table) == ([], [], 1, [0, 2])
    sch.release(c)
    p = sch.schedule()
    assert summary(p) == [("b", 8, 1, True)] and b.block_table == [0, 2, 1]
    commit(p)
    assert b.sampling_done and sch.num_preemptions == 0


@st.composite
def tight_workloads(draw):
    bt = draw(st.sampled_from([2, 4, 8]))
    reqs = [(draw(st.integers(1, 24)), draw(st.integers(1, 16))) for _ in range(draw(st.integers(1, 12)))]
    need = max(BlockPool.blocks_for(p + m - 1, bt) for p, m in reqs)
    slots = draw(st.integers(1, 6))
    return dict(bt=bt, reqs=reqs, slots=slots, budget=draw(st.integers(slots, 32)),
                num_blocks=need + draw(st.integers(0, 8)))


@settings(max_examples=200, deadline=None, database=None)
@given(w=tight_workloads())
def test_tight_pools_finish_every_request_with_at_most_one_preemption_each(w):
    """Whatever the pool, slots and budget: every request finishes, none is preempted twice (a victim
    comes back only when it and every running sequence can finish), and every block comes back."""
    sch = make(num_blocks=w["num_blocks"], slots=w["slots"], budget=w["budget"], block_tokens=w["bt"])
    seqs = [seq(i, p, max_tokens=m) for i, (p, m) in enumerate(w["reqs"])]
    for s_ in seqs:
        sch.add(s_)
    steps = 0
    while sch.running or sch.waiting:
        p = sch.schedule()
        for s_ in sch.running:
            assert len(s_.block_table) == BlockPool.blocks_for(s_.kv_valid, w["bt"])
        commit(p)
        for s_ in list(sch.running):
            if s_.sampling_done and s_.pending == 0:
                sch.release(s_)
        steps += 1
        assert steps < 2000, "no progress"
    assert all(len(s_.generated) == s_.params.max_tokens for s_ in seqs)
    assert max(s_.num_preemptions for s_ in seqs) <= 1
    assert sch.num_preemptions == sum(s_.num_preemptions for s_ in seqs)
    assert sch.kv.pool.num_free == w["num_blocks"] and not any(sch.kv.pool.ref_counts)
