"""Drafter context held back while nobody drafts (runtime/context_backlog.py), exactly: which rows a plain
decode step holds, when they are written (a proposal, a step with rows of its own or a snapshot, a turn
entry, LIMIT rows), that they land where each step would have written them, and that rows of a sequence
that left are never written."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from dflash_checkpoints import write_tiny_drafter
from engine_checks import assert_drafter_context, assert_idle, assert_reference, greedy, run_checking_drafter_context
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine
from mtlqwen.runtime.context_backlog import LIMIT, ContextBacklog
from mtlqwen.runtime.draft_policy import FixedDrafting
from mtlqwen.runtime.sequence import SeqStatus


@pytest.fixture(scope="module")
def drafter(ckpt, model, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt, num_layers=2, block_size=16), model)


class FakeSeq:
    """What the backlog reads of a Sequence (hashable by identity, as a Sequence is)."""

    def __init__(self, table):
        self.block_table, self.status, self.num_preemptions, self.kv_valid = list(table), SeqStatus.RUNNING, 0, 0


def fake_seq(table):
    return FakeSeq(table)


def test_take_keeps_only_rows_whose_sequence_still_owns_their_block():
    bl = ContextBacklog(block_tokens=4)
    a, b, c, d = fake_seq([5, 6]), fake_seq([7]), fake_seq([8]), fake_seq([9, 3])
    taps1 = mx.arange(4 * 3, dtype=mx.float32).reshape(4, 3)  # 3 rows + a padding row
    bl.add(taps1, [SimpleNamespace(seq=s, start=p) for s, p in ((a, 5), (b, 2), (c, 1))])
    taps2 = 100 + mx.arange(3 * 3, dtype=mx.float32).reshape(3, 3)
    bl.add(taps2, [SimpleNamespace(seq=s, start=p) for s, p in ((a, 6), (b, 3), (d, 7))])
    for s, n in ((a, 7), (b, 4), (c, 2), (d, 8)):
        s.kv_valid = n
    assert (len(bl), bl.held()[a], bl.held()[d], bl.full()) == (6, 2, 1, False)
    c.status = SeqStatus.FINISHED  # c left (finished or cancelled)
    d.num_preemptions, d.block_table = 1, [3, 9]  # d was preempted and got its blocks again, in another order
    feats, lay = bl.take()
    assert (len(bl), bl.held()) == (0, {})
    # a's and b's rows in the order they were computed: a run of two rows of taps1, then two of taps2
    assert feats.tolist() == [[0, 1, 2], [3, 4, 5], [100, 101, 102], [103, 104, 105]]
    assert (lay.query_start_loc, lay.kv_valid) == ([0, 1, 2, 3, 4], [5, 2, 6, 3])
    assert lay.slot_mapping() == ([6, 7, 6, 7], [1, 2, 2, 3])
    bl.add(taps2, [SimpleNamespace(seq=a, start=7)])  # at kv_valid: a row never committed
    assert bl.take() is None and len(bl) == 0
    bl.add(taps2, [SimpleNamespace(seq=s, start=p) for s, p in ((a, 4), (b, 1), (a, 5))])
    bl.drop(a)  # a finished: nothing will read its rows
    assert [(r.seq, r.position) for r in bl.rows] == [(b, 1)] and bl.held() == {b: 1} and not bl.holds(a)


def test_limit_rows_make_the_backlog_full():
    bl = ContextBacklog(block_tokens=64)
    a = fake_seq([0])
    for p in range(LIMIT):
        assert not bl.full()
        bl.add(mx.zeros((1, 2)), [SimpleNamespace(seq=a, start=p)])
    assert bl.full() and bl.held()[a] == LIMIT


class DraftAfter(FixedDrafting):
    """Plain decoding for the first `plain` choices, then every draft the engine allows."""

    def __init__(self, plain: int):
        self.plain, self.calls = plain, 0

    def choose(self, seqs, caps, rows):
        self.calls += 1
        return [0] * len(caps) if self.calls <= self.plain else list(caps)


def held_after_each_step(eng) -> tuple[list[int], dict]:
    sizes, outs = [], {}
    while eng.has_work():
        outs.update({d.request_id: d.output for d in eng.step() if d.finished})
        sizes.append(len(eng.spec.backlog))
    return sizes, outs


def test_plain_decode_steps_hold_their_rows_and_write_them_at_the_limit(model, drafter):
    """Two requests that never draft: the prefill step writes its rows, each decode step holds two, the step
    after a sequence holds LIMIT writes them all before its own (which it holds); what lands equals the
    one-shot context."""
    prompts = [random_token_ids(9, 500, seed=81), random_token_ids(12, 500, seed=82)]
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=12, draft=drafter, n_draft=3,
                 prefix_interval=0)
    ids = [eng.submit(p, greedy(20, ignore_eos=True, speculative=False)) for p in prompts]
    eng.step()  # both prompts in one step: written at once
    assert len(eng.spec.backlog) == 0
    sizes = []
    for _ in range(LIMIT + 1):
        eng.step()
        sizes.append(len(eng.spec.backlog))
    assert sizes == [2 * k for k in range(1, LIMIT + 1)] + [2]  # the 17th decode step writes 32 rows first
    mx.synchronize()
    for seq in eng.scheduler.running:
        assert_drafter_context(eng, seq, seq.kv_valid - 1, model, drafter)  # all but the row still held
    rest, outs = held_after_each_step(eng)
    assert rest == [4, 6, 0] and set(outs) == set(ids)  # two more decode steps, then the finish drops the rows
    for p, rid in zip(prompts, ids):
        assert_reference(model, p, outs[rid], 20, ignore_eos=True)
    assert_idle(eng)


def test_rows_held_before_drafting_are_written_before_the_proposal(model, drafter):
    """Six plain steps, then drafting with the real drafter: at every verification the drafter context is
    the one-shot one for every position before the anchor, the held rows included; output as plain."""
    prompt = random_token_ids(11, 500, seed=83)
    sp = greedy(30, ignore_eos=True)
    (base,) = Engine(model, slots=1, step_tokens=32, block_tokens=16, num_blocks=8).generate([prompt], sp)
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=16, num_blocks=8, draft=drafter, n_draft=3,
                 prefix_interval=0, draft_policy=DraftAfter(6))
    rid = eng.submit(prompt, sp)
    held = []
    outs, checked = run_checking_drafter_context(eng, model, drafter, lambda e: held.append(len(e.spec.backlog)))
    assert max(held) >= 4 and checked >= 3 and held[-1] == 0
    assert outs[rid].token_ids == base.token_ids
    assert_idle(eng)


def test_a_boundary_step_and_a_finish_write_the_held_rows_for_the_entries(model, drafter):
    """Prefix cache on (interval 16): the plain step that reaches position 32 writes what is held (its
    capture shares the blocks); the request's end writes the rest before its turn entry is kept; the next
    turn restores that entry (a partial block copied, drafter rows included) and drafts on exact context."""
    prompt = random_token_ids(20, 500, seed=84)
    eng = Engine(model, slots=1, step_tokens=32, block_tokens=16, num_blocks=16, draft=drafter, n_draft=3,
                 prefix_interval=16)
    eng.submit(prompt, greedy(18, ignore_eos=True, speculative=False))
    sizes, outs = held_after_each_step(eng)
    (first,) = outs.values()
    # the prompt in two steps (cut at 16); decode steps compute positions 20, 21, ...: the one at 31 reaches 32;
    # the one at 36 holds a fifth row, which the finish writes
    assert sizes == [0, 0, *range(1, 12), 0, 1, 2, 3, 4, 5, 0]
    assert eng.stats()["prefix_turns_kept"] == 1
    turn2 = prompt + first.token_ids + random_token_ids(5, 500, seed=85)
    sp = greedy(10, ignore_eos=True)
    (base,) = Engine(model, slots=1, step_tokens=32, block_tokens=16, num_blocks=16).generate([turn2], sp)
    rid = eng.submit(turn2, sp)
    outs, checked = run_checking_drafter_context(eng, model, drafter)
    out = outs[rid]
    assert checked >= 2 and out.cached_tokens == len(prompt) + len(first.token_ids) - 1
    assert out.token_ids == base.token_ids
    assert_idle(eng)
