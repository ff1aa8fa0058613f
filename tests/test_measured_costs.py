"""The adaptive policy's step costs learned from the engine's own steps (runtime/measured_costs.py): the ratios
and their fallbacks, the timer's intervals and gap rule, and an engine whose speculative steps cost far more
than its table says turning its drafter off by its own timings (a virtual clock, so the choices are exact)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_checks import assert_idle, greedy
from hf_checkpoints import random_token_ids
from mtlqwen.runtime import Engine, EngineConfig
from mtlqwen.runtime.draft_policy import AdaptiveDrafting, StepCosts
from mtlqwen.runtime.measured_costs import MeasuredCosts, StepTimer, decode_shape
from test_draft_policy import CHEAP, seq_with, wrong_by_one
from test_speculative import Oracle, draft_dir, drafter, plain_outputs  # noqa: F401

TABLE = StepCosts((1, 8), (0, 3, 7), ((2.0, 4.0, 5.0), (4.0, 10.0, 16.0)))


def test_prior_until_observed_then_the_median_ratio():
    m = MeasuredCosts(TABLE, window=3, min_seen=2)
    assert m.drafts == (0, 3, 7) and m.seqs == (1, 8)
    assert m.step(1, 1, 7) == TABLE.step(1, 1, 7) == 5.0 and m.step(8, 0, 0) == 4.0
    m.observe(1, 1, 7, 0.050)  # the shape's first step (its compile): dropped
    assert m.summary() == {} and m.step(1, 1, 7) == 5.0
    m.observe(1, 1, 7, 0.010)  # 10 ms / 5 ms
    assert m.summary() == {"7@1": [2.0, 1]} and m.step(1, 1, 7) == 5.0  # one is not enough (min_seen 2)
    m.observe(1, 1, 7, 0.020)
    assert m.step(1, 1, 7) == pytest.approx(5.0 * 3.0)  # median of 2 and 4
    m.observe(1, 1, 7, 0.030)
    m.observe(1, 1, 7, 0.011)  # the window keeps the last 3: 4, 6, 2.2
    assert m.ratio(7, 1) == pytest.approx(4.0)
    assert m.summary() == {"7@1": [4.0, 3]}


def test_unseen_keys_borrow_from_the_nearest_seen_one():
    m = MeasuredCosts(TABLE, window=5, min_seen=1)
    assert m.bucket(1) == 1 and m.bucket(2) == 1 and m.bucket(3) == 8 and m.bucket(32) == 8  # log scale
    assert m.ratio(3, 1) == m.ratio(0, 1) == 1.0  # nothing seen: the table's own ratios
    for ms in (9.0, 3.0):  # plain steps at 1 sequence: 1.5x the table (the first dropped)
        m.observe(1, 0, 0, ms / 1e3)
    assert m.ratio(0, 1) == 1.5 and m.ratio(3, 1) == 1.5 and m.ratio(7, 1) == 1.5  # no spec step seen: plain's
    assert m.ratio(0, 8) == 1.0  # another batch keeps the table
    for ms in (1.0, 12.0):  # 1 x 3 drafts: 3x
        m.observe(1, 1, 3, ms / 1e3)
    assert m.ratio(3, 1) == 3.0 and m.ratio(7, 1) == 3.0  # 7 drafts: the nearest seen length's
    assert m.step(1, 1, 7) == pytest.approx(15.0) and m.step(1, 0, 0) == pytest.approx(3.0)
    # between two speculative lengths seen: their costs interpolated; never from plain (no fixed part there)
    m2 = MeasuredCosts(TABLE, window=5, min_seen=1)
    for ms in (1.0, 20.0):  # 7 drafts at 4x: 20 ms where the table says 5
        m2.observe(1, 1, 7, ms / 1e3)
    assert m2.ratio(3, 1) == 4.0 and m2.ratio(0, 1) == 1.0  # plain unseen: the table's own cost
    for ms in (1.0, 3.0):
        m2.observe(1, 0, 0, ms / 1e3)
    assert m2.ratio(3, 1) == 4.0  # plain seen too: 3 drafts still borrow 7's ratio
    for ms in (1.0, 12.0):  # 3 drafts at 3x: 12 ms
        m2.observe(1, 1, 3, ms / 1e3)
    assert m2.step(1, 1, 5) == pytest.approx(12.0 + (20.0 - 12.0) * 2 / 4)  # the table's 4.5 becomes 16
    # k = 0 or N = 0 is a plain step whatever the other says; N past the table is its longest
    m.observe(2, 0, 7, 0.001)
    assert (2, 0, 0) in m._seen
    m.observe(1, 1, 15, 0.002)
    assert (1, 1, 7) in m._seen
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        m.observe(1, 1, 3, bad)
    assert m.ratio(3, 1) == 3.0
    with pytest.raises(TypeError):
        MeasuredCosts({"seqs": [1]})
    with pytest.raises(ValueError):
        MeasuredCosts(TABLE, window=2, min_seen=3)


def test_the_policy_prices_steps_with_what_it_measured():
    """By TABLE one sequence at the prior (a = 0.8) drafts 7: E[tau] 4.16 over 5 ms against 1 over 2. Once 7-draft
    steps are seen at 4x their price it stays plain; plain steps seen slower too bring it back."""
    p = AdaptiveDrafting(MeasuredCosts(TABLE, window=4, min_seen=2), prior=0.8, prior_weight=2.0)
    assert p.choose([seq_with()], [7], 1) == [7]
    for _ in range(3):
        p.observe(1, 1, 7, 0.020)
    assert p.choose([seq_with()], [7], 1) == [0]  # 4.16 / 20 < 1 / 2 (3 drafts: the same ratio, 2.95 / 16)
    for _ in range(5):
        p.observe(1, 0, 0, 0.008)  # plain steps at 4x too
    assert p.choose([seq_with()], [7], 1) == [7]  # the table's ratios again (3 drafts borrow 7's ratio)
    for _ in range(4):
        p.observe(1, 0, 0, 0.002)  # plain as the table says: 7 drafts cost 10 plain steps, 3 drafts 8
    assert p.choose([seq_with()], [7], 1) == [0]
    # a table that does not learn ignores observations
    q = AdaptiveDrafting(TABLE, prior=0.8, prior_weight=2.0)
    for _ in range(3):
        q.observe(1, 1, 7, 0.020)
    assert q.choose([seq_with()], [7], 1) == [7]


def test_speculative_steps_seen_faster_than_the_table_make_the_policy_time_plain_ones():
    """The demo pair on an H100: every step ~4x cheaper than the 9B table. Seen only drafting, its speculative
    steps priced at 0.25x beside plain ones at the table's price made drafting look cheap whatever it accepted.
    At acceptance 0.5 neither draft length pays by the table (E[tau] 1.99 over 5 ms, 1.88 over 4, against 1
    over 2): the policy runs plain steps until they are seen, then prices both at the machine's scale."""
    p = AdaptiveDrafting(MeasuredCosts(TABLE, window=4, min_seen=2), prior=0.8, prior_weight=2.0)
    seq = seq_with(accepted=0.4, rejected=1.6)  # rate (0.4 + 1.6) / (2 + 2) = 0.5
    assert p.acceptance(seq) == 0.5 and not p.due(seq)
    assert p.choose([seq], [7], 1) == [0]
    for _ in range(3):  # 7 drafts at 1.25 ms (the first dropped)
        p.observe(1, 1, 7, 0.00125)
    assert p.costs.plain_unseen(1) and not p.costs.plain_unseen(8)  # another batch has seen nothing
    assert p.costs.step(1, 1, 7) == pytest.approx(1.25)  # 1.99 / 1.25 would beat 1 / 2 ...
    assert p.choose([seq], [7], 1) == [0]  # ... but plain is timed first
    p.observe(1, 0, 0, 0.0005)  # dropped (its shape's first)
    p.observe(1, 0, 0, 0.0005)
    assert p.costs.plain_unseen(1) and p.choose([seq], [7], 1) == [0]  # one of the two it needs
    p.observe(1, 0, 0, 0.0005)
    assert not p.costs.plain_unseen(1)
    assert p.costs.step(1, 0, 0) == pytest.approx(0.5) and p.choose([seq], [7], 1) == [0]  # the table's shape
    good = seq_with(accepted=8.0, rejected=0.0)  # 0.96: 7 drafts pay at any scale here
    assert p.choose([good], [7], 1) == [7]
    # a table that does not learn never asks
    assert AdaptiveDrafting(TABLE).choose([good], [7], 1) == [7]


def test_the_policy_reprices_when_the_learned_table_moves():
    """AdaptiveDrafting keeps each batch's prices until the table's version moves: an observation that changes a
    ratio changes the next choice."""
    m = MeasuredCosts(TABLE, window=4, min_seen=1)
    p = AdaptiveDrafting(m, prior=0.8, prior_weight=2.0)
    seq = seq_with(accepted=4.0, rejected=0.0)  # (4 + 1.6) / 6 = 0.93
    assert p.prices(1, 7) == [TABLE.step(1, k, 7) for k in range(2)] and p.choose([seq], [7], 1) == [7]
    for _ in range(2):  # plain steps at the table's 2 ms (the first dropped): seen, ratio 1
        m.observe(1, 0, 0, 0.002)
    v = m.version
    m.observe(1, 1, 7, 0.001)  # a shape's first: dropped, no new version
    assert m.version == v and p.choose([seq], [7], 1) == [7]
    m.observe(1, 1, 7, 0.100)  # 20x: 7 and 3 drafts (borrowing 7's ratio) cost 100 and 80 ms
    assert m.version == v + 1 and not m.plain_unseen(1)
    assert p.prices(1, 7) == [pytest.approx(2.0), pytest.approx(100.0)] and p.choose([seq], [7], 1) == [0]


def test_step_timer_intervals_and_the_gap_rule():
    t, seen = [0.0], []
    timer = StepTimer(lambda *a: seen.append(a), max_gap_share=0.25, clock=lambda: t[0])

    def call(dt_in_call, shape, gap=0.0):
        t[0] += gap
        timer.call_started()
        t[0] += dt_in_call
        timer.read_back(shape)
        timer.call_ended()

    call(1.0, (2, 0, 0))  # the first read-back starts the chain
    call(1.0, (2, 0, 0), gap=0.2)  # 1.2 s between read-backs, 0.2 of it between calls: kept
    call(1.0, (2, 2, 7), gap=0.5)  # 0.5 of 1.5: an idle host, dropped
    call(3.0, None)  # a prefill step: timed for no one
    call(3.0, (2, 2, 7))
    assert seen == [(2, 0, 0, pytest.approx(1.2))]  # a call's observations reach the table at the next call's start
    timer.call_started()
    assert seen == [(2, 0, 0, pytest.approx(1.2)), (2, 2, 7, pytest.approx(3.0))]


def test_decode_shape():
    def row(n, drafts=0, samples=True):
        return SimpleNamespace(num_tokens=n, drafts=drafts, samples=samples)

    assert decode_shape([row(1), row(8, 7), row(4, 3)]) == (3, 2, 7)
    assert decode_shape([row(1), row(1)]) == (2, 0, 0)
    assert decode_shape([row(1), row(5)]) is None  # a prefill chunk
    assert decode_shape([row(1, samples=False)]) is None
    assert decode_shape([]) is None


def test_config(model, drafter):
    with pytest.raises(ValueError, match="learn_draft_costs is the adaptive policy's"):
        EngineConfig(draft="d", draft_policy="fixed", learn_draft_costs=True)
    with pytest.raises(ValueError, match="learn_draft_costs must be true or false"):
        EngineConfig(draft="d", learn_draft_costs="yes")
    with pytest.raises(ValueError, match="learn_draft_costs needs a drafter"):
        EngineConfig(learn_draft_costs=True)
    kw = dict(slots=1, step_tokens=32, block_tokens=16, num_blocks=8, prefix_interval=0)
    assert Engine(model, draft=drafter, draft_costs=CHEAP, **kw).timer is None  # off unless asked for
    eng = Engine(model, draft=drafter, draft_costs=CHEAP, learn_draft_costs=True, **kw)
    assert eng.spec.policy.costs.prior is CHEAP and eng.timer is not None
    assert Engine(model, draft=drafter, draft_policy="fixed", **kw).timer is None
    assert Engine(model, **kw).timer is None


def run_on_virtual_clock(model, drafter, seed: int, tokens: int, proposer, step_ms) -> dict:
    """One request, n_draft 7, the CHEAP table, drafts from proposer(reference tokens), with the table alone
    (False) and learning (True), on a virtual clock that advances step_ms(shape) ms at each timed read-back:
    {learn: ([(generated, drafts) of each verification], stats)}; output as plain decoding, nothing leaked."""
    prompt = random_token_ids(12, 512, seed=seed)
    sp = greedy(tokens, ignore_eos=True)
    kw = dict(slots=1, step_tokens=32, block_tokens=16, num_blocks=12, prefix_interval=0)
    (base,) = plain_outputs(model, [prompt], sp, **{k: v for k, v in kw.items() if k != "prefix_interval"})
    runs = {}
    for learn in (False, True):
        eng = Engine(model, draft=drafter, n_draft=7, draft_policy="adaptive", draft_costs=CHEAP,
                     learn_draft_costs=learn, **kw)
        eng.spec.propose = proposer({tuple(prompt): prompt + base.token_ids})
        at, record = [], eng.spec.policy.record

        def recording(seq, drafts, accepted, at=at, record=record):
            at.append((seq.num_generated, drafts))
            record(seq, drafts, accepted)

        eng.spec.policy.record = recording
        if learn:
            clock, read_back = [0.0], eng.timer.read_back
            eng.timer.clock = lambda: clock[0]

            def timed(shape, clock=clock, read_back=read_back):
                if shape is not None:
                    clock[0] += step_ms(shape) / 1e3
                read_back(shape)

            eng.timer.read_back = timed
        (out,) = eng.generate([prompt], sp)
        assert out.token_ids == base.token_ids
        runs[learn] = (at, eng.stats())
        assert_idle(eng)
    return runs


def test_an_engine_turns_off_a_drafter_its_own_steps_show_does_not_pay(model, drafter):
    """An oracle drafter (every draft accepted), the CHEAP table (7 drafts cost 3 plain steps), on a virtual
    clock where a plain step takes 1 ms and a speculative one 40. Trusting the table, the engine verifies in
    every step it may; learning, it verifies 3 drafts (the prior), then 7 four times (the first of each shape
    dropped, two more to trust the ratio, 13.3x, and one while the last observation waits for the next step
    call), then decodes plain: 8 tokens a 40 ms step lose to 1 a ms."""
    runs = run_on_virtual_clock(model, drafter, 91, 48, Oracle, lambda shape: 40.0 if shape[1] else 1.0)
    trusted, learned = runs[False][0], runs[True][0]
    assert len(trusted) > 5 and all(n == 7 for _, n in trusted[1:-1])
    assert [n for _, n in learned] == [3, 7, 7, 7, 7]
    stats = runs[True][1]
    assert stats["step_cost_ratios"]["7@1"] == [13.333, 3]  # 40 ms over 3 (rounded in the summary)
    assert stats["draft_tokens"] == 3 + 7 * 4 and stats["accepted_tokens"] == stats["draft_tokens"]
    assert "step_cost_ratios" not in runs[False][1]


def test_timings_that_equal_the_table_change_no_choice(model, drafter):
    """Every draft wrong, the CHEAP table, a virtual clock on which each step takes exactly what the table
    prices it at: every learned ratio is 1, and learning verifies at the same tokens, with the same drafts, as
    the table alone (the engine's timing keys, units and attribution agree with the table's)."""
    runs = run_on_virtual_clock(model, drafter, 78, 64, wrong_by_one, lambda shape: CHEAP.step(*shape))
    assert runs[True][0] == runs[False][0] and len(runs[False][0]) >= 3
    ratios = runs[True][1]["step_cost_ratios"]
    assert ratios and all(r == pytest.approx(1.0) for r, _ in ratios.values()), ratios
