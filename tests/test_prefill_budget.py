"""The prefill budget rule: a step in which no sequence decodes takes up to prefill_step_tokens prompt tokens;
with a decoder in the batch every step keeps step_tokens (what the scheduler gives each sequence, exactly)."""

from __future__ import annotations

import pytest

from mtlqwen.runtime import EngineConfig, KVManager, Scheduler, SamplingParams
from mtlqwen.runtime.config import DEFAULT_PREFILL_STEP
from mtlqwen.runtime.sequence import Sequence


def _sched(step_tokens=16, prefill=64, slots=2, blocks=64, bt=16):
    kv = KVManager(blocks, bt, 0, 0, "test", 0)
    return Scheduler(kv, slots, step_tokens, prefill_step_tokens=prefill)


def _seq(rid, n, max_tokens=4):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0)


def _run(sched, plan):
    """What the engine does between steps for a plan: sampled tokens come back (one per sampling row)."""
    for s in plan.scheduled:
        if s.samples:
            s.seq.pending -= 1
            s.seq.tokens.append(7)


def test_prefill_only_steps_take_the_prefill_budget():
    sched = _sched()
    a = _seq("a", 150)
    sched.add(a)
    takes = []
    while a.kv_valid < a.prompt_len:
        plan = sched.schedule()
        takes.append([(s.seq.request_id, s.num_tokens) for s in plan.scheduled])
        _run(sched, plan)
    assert takes == [[("a", 64)], [("a", 64)], [("a", 22)]]  # 150 = 64 + 64 + 22, not 16-token chunks


def test_a_decoder_keeps_every_step_at_step_tokens():
    sched = _sched()
    a, b = _seq("a", 10, max_tokens=20), _seq("b", 100)
    sched.add(a)
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 10)]
    _run(sched, plan)
    sched.add(b)  # a decodes from now on: b's prefill shares step_tokens = 16 with a's one token
    takes = []
    for _ in range(3):
        plan = sched.schedule()
        takes.append([(s.seq.request_id, s.num_tokens) for s in plan.scheduled])
        _run(sched, plan)
    assert takes == [[("a", 1), ("b", 15)], [("a", 1), ("b", 15)], [("a", 1), ("b", 15)]]


def test_two_prefills_split_the_prefill_budget():
    sched = _sched()
    a, b = _seq("a", 100), _seq("b", 100)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 32), ("b", 32)]


def test_config_default_and_validation():
    assert EngineConfig().prefill_budget == DEFAULT_PREFILL_STEP
    assert EngineConfig(step_tokens=2048).prefill_budget == 2048  # never below step_tokens
    assert EngineConfig(prefill_step_tokens=256).prefill_budget == 256
    with pytest.raises(ValueError, match="prefill_step_tokens"):
        EngineConfig(prefill_step_tokens=0)
    assert Scheduler(KVManager(8, 16, 0, 0, "t", 0), 1, 16).prefill_step_tokens == 16  # None: step_tokens
