"""Speculative statistics (engine.stats(), /metrics) and the draft policies (runtime/draft_policy.py): the
adaptive policy's choices for given tables and acceptances, exactly; engines drafting adaptively give
plain decoding's greedy tokens and leak nothing; a table where drafting never pays keeps plain steps
pipelined (as many steps as an engine without a drafter)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine_checks import assert_idle, greedy
from hf_checkpoints import random_token_ids
from mtlqwen.frontends.metrics import Metrics
from mtlqwen.runtime import Engine, EngineConfig, Sequence, SamplingParams
from mtlqwen.runtime.draft_policy import (H200_9B_COMPILED_COSTS, H200_9B_COSTS, AcceptanceEstimate, AdaptiveDrafting, FixedDrafting,
                                          StepCosts, bucket_drafts, draft_lengths, expected_tokens, make_policy)
from test_speculative import Oracle, check_workload, draft_dir, drafter, plain_outputs, spec_workloads  # noqa: F401

KW = dict(slots=1, step_tokens=32, block_tokens=16, num_blocks=8, prefix_interval=0)


def seq_with(accepted: float = 0.0, rejected: float = 0.0) -> Sequence:
    s = Sequence(0, [1, 2, 3], SamplingParams(), 0)
    s.draft_estimate = AcceptanceEstimate(accepted, rejected)
    return s


def wrong_by_one(ref):
    """A proposer whose every draft is the plain run's token + 1: nothing is ever accepted."""
    def propose(seqs, layout, n):
        rows = []
        for s in seqs:
            full = ref[tuple(s.seq.tokens[: s.seq.prompt_len])]
            r = full[s.start + 1 : s.start + 1 + n] + [0] * n
            rows.append([(t + 1) % 500 for t in r[:n]])
        return mx.array(rows, dtype=mx.int32), None
    return propose


# ------------------------------------------------------------------------------------------ statistics
def test_stats_and_metrics_count_exactly(model, drafter):
    """One request, n_draft 4. Oracle drafts, max_tokens 11: the prefill step samples token 1 (a plain step),
    then two verifications accept 4 + 4 drafts (5 tokens each). Drafts always wrong, max_tokens 5: the caps
    shrink with max_tokens (3, 2, 1 may go; the draft lengths of n_draft 4 being 1, 3, 4, the second sends 1:
    3, 1, 1 drafts, one token each), then a plain decode of the last token."""
    prompt = random_token_ids(9, 512, seed=41)
    for max_tokens, good, want in (
        (11, True, dict(spec_steps=2, plain_steps=1, spec_verifications=2, draft_tokens=8, accepted_tokens=8,
                        plain_decodes=0, mean_acceptance_length=5.0)),
        (5, False, dict(spec_steps=3, plain_steps=2, spec_verifications=3, draft_tokens=5, accepted_tokens=0,
                        plain_decodes=1, mean_acceptance_length=1.0)),
    ):
        sp = greedy(max_tokens, ignore_eos=True)
        (base,) = plain_outputs(model, [prompt], sp, **{k: v for k, v in KW.items() if k != "prefix_interval"})
        eng = Engine(model, draft=drafter, n_draft=4, **KW)
        ref = {tuple(prompt): prompt + base.token_ids}
        eng.spec.propose = Oracle(ref) if good else wrong_by_one(ref)
        (out,) = eng.generate([prompt], sp)
        assert out.token_ids == base.token_ids
        s = eng.stats()
        assert {k: s[k] for k in want} == want and s["draft_policy"] == "fixed"
        assert s["steps"] == s["spec_steps"] + s["plain_steps"]
        text = Metrics("t").render(s)
        for name, key in (("spec_decode_steps_total", "spec_steps"), ("spec_decode_plain_steps_total", "plain_steps"),
                          ("spec_decode_num_drafts_total", "spec_verifications"),
                          ("spec_decode_num_draft_tokens_total", "draft_tokens"),
                          ("spec_decode_num_accepted_tokens_total", "accepted_tokens"),
                          ("spec_decode_plain_decodes_total", "plain_decodes")):
            assert f'mtlqwen:{name}{{model_name="t"}} {want[key]}\n' in text, name
        tau = "5" if good else "1"
        assert f'mtlqwen:spec_decode_mean_acceptance_length{{model_name="t"}} {tau}\n' in text
        assert_idle(eng)


def test_metrics_without_a_drafter_read_zero(model):
    eng = Engine(model, **KW)
    eng.generate([random_token_ids(5, 512, seed=1)], greedy(3))
    text = Metrics("t").render(eng.stats())
    for name in ("spec_decode_steps_total", "spec_decode_plain_steps_total", "spec_decode_num_drafts_total",
                 "spec_decode_mean_acceptance_length"):
        assert f'mtlqwen:{name}{{model_name="t"}} 0\n' in text, name


# ------------------------------------------------------------------------------------------ the table
def test_step_costs_interpolate_and_load(tmp_path):
    t = StepCosts((1, 3), (0, 4, 8), ((1.0, 3.0, 5.0), (3.0, 7.0, 11.0)))
    assert [t.cost(1, n) for n in (0, 2, 4, 6, 8)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert t.cost(2, 0) == 2.0 and t.cost(2, 4) == 5.0 and t.cost(2, 6) == 6.5
    assert t.cost(5, 0) == 5.0 and t.cost(5, 8) == 17.0  # past the last batch: along the last segment
    assert t.cost(0, 4) == 3.0  # below the first batch: the first row
    assert StepCosts((4,), (0, 2), ((2.0, 3.0),)).cost(32, 2) == 3.0  # one row: constant in S
    with pytest.raises(ValueError, match="outside the table"):
        t.cost(1, 9)
    for bad in (dict(seqs=(), drafts=(0, 1), ms=()), dict(seqs=(1,), drafts=(1, 2), ms=((1.0, 1.0),)),
                dict(seqs=(1,), drafts=(0,), ms=((1.0,),)), dict(seqs=(1,), drafts=(0, 1), ms=((1.0, 0.0),)),
                dict(seqs=(2, 1), drafts=(0, 1), ms=((1.0, 2.0), (1.0, 2.0))), dict(seqs=(1,), drafts=(0, 1), ms=((1.0,),))):
        with pytest.raises(ValueError, match="StepCosts"):
            StepCosts(**bad)
    # spec_bench rows: the engine's own commit mode per cell (candidates up to 64 verify rows, replay past them),
    # the plain column from n_draft 0 rows (a drafter loaded) where measured, else plain_step_ms
    rows = [dict(seqs=1, n_draft=4, commit="candidates", plain_step_ms=5.0, spec_step_ms=20.0),
            dict(seqs=1, n_draft=4, commit="replay", plain_step_ms=5.0, spec_step_ms=18.0),
            dict(seqs=1, n_draft=15, commit="candidates", plain_step_ms=5.0, spec_step_ms=30.0),
            dict(seqs=1, n_draft=15, commit="replay", plain_step_ms=5.0, spec_step_ms=33.0),
            dict(seqs=8, n_draft=0, commit="replay", plain_step_ms=15.0, spec_step_ms=16.0),
            dict(seqs=8, n_draft=4, commit="candidates", plain_step_ms=15.0, spec_step_ms=60.0),
            dict(seqs=8, n_draft=15, commit="replay", plain_step_ms=15.0, spec_step_ms=70.0)]
    got = StepCosts.from_rows(rows)
    assert got == StepCosts((1, 8), (0, 4, 15), ((5.0, 20.0, 30.0), (16.0, 60.0, 70.0)))  # 1 x 16 rows: candidates
    (tmp_path / "bench.json").write_text(json.dumps({"args": {}, "rows": rows}))
    (tmp_path / "table.json").write_text(json.dumps({"seqs": [1], "drafts": [0, 3], "ms": [[1, 2]]}))
    assert StepCosts.load(tmp_path / "bench.json") == got
    assert StepCosts.load(tmp_path / "table.json") == StepCosts((1,), (0, 3), ((1, 2),))
    with pytest.raises(ValueError, match="no row at 8 sequences, n_draft 15"):
        StepCosts.from_rows(rows[:-1])
    # measured uncompiled and compiled: the engine reads the rows of the way it runs its steps
    both = [{**r, "compiled": "off"} for r in rows] + [{**r, "compiled": "on", "spec_step_ms": r["spec_step_ms"] / 2}
                                                       for r in rows]
    assert StepCosts.from_rows(both, compiled=False) == got == StepCosts.from_rows(rows, compiled=True)
    halved = StepCosts((1, 8), (0, 4, 15), ((5.0, 10.0, 15.0), (8.0, 30.0, 35.0)))
    assert StepCosts.from_rows(both, compiled=True) == halved
    (tmp_path / "both.json").write_text(json.dumps({"rows": both}))
    assert StepCosts.load(tmp_path / "both.json", compiled=True) == halved


# ------------------------------------------------------------------------------------ draft lengths
def test_draft_lengths_and_bucketing():
    assert draft_lengths(15) == (1, 3, 7, 15) and draft_lengths(7) == (1, 3, 7)
    assert draft_lengths(4) == (1, 3, 4) and draft_lengths(1) == (1,) and draft_lengths(12) == (1, 3, 7, 12)
    lengths = draft_lengths(15)
    assert [bucket_drafts(n, lengths) for n in range(17)] == [0, 1, 1, 3, 3, 3, 3, 7, 7, 7, 7, 7, 7, 7, 7, 15, 15]
    assert [bucket_drafts(n, draft_lengths(5)) for n in (0, 2, 4, 5, 9)] == [0, 1, 3, 5, 5]


# ------------------------------------------------------------------------------------------ the policy
def test_expected_tokens_and_estimates():
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    p = AdaptiveDrafting(decay=0.5, prior=0.8, prior_weight=2.0)
    s = seq_with()
    assert p.acceptance(s) == pytest.approx(0.8)  # the prior alone
    p.record(s, 4, 4)  # all accepted: 4 successes, no failure
    assert (s.draft_estimate.accepted, s.draft_estimate.rejected) == (4.0, 0.0)
    p.record(s, 4, 1)  # 1 success then a failure; the past weighs half
    assert (s.draft_estimate.accepted, s.draft_estimate.rejected) == (3.0, 1.0)
    assert p.acceptance(s) == pytest.approx((3.0 + 1.6) / (4.0 + 2.0))
    p.skipped(s)  # plain steps leave the counts alone: only the backoff's clock moves
    assert s.draft_estimate == AcceptanceEstimate(3.0, 1.0, idle=1, backoff=4)
    fresh = Sequence(1, [1], SamplingParams(), 0)
    assert p.acceptance(fresh) == pytest.approx(0.8) and fresh.draft_estimate == AcceptanceEstimate()
    for bad in (dict(decay=1.0), dict(prior=1.5), dict(prior_weight=0.0), dict(min_backoff=0),
                dict(min_backoff=8, max_backoff=4), dict(probe_share=0.0)):
        with pytest.raises(ValueError):
            AdaptiveDrafting(**bad)
    with pytest.raises(TypeError, match="StepCosts"):
        AdaptiveDrafting(costs={"seqs": [1]})


def test_adaptive_choices_for_given_tables_and_acceptances():
    # one sequence, a step with 4 drafts costs 2 plain steps: draft iff E[tau(4)] > 2
    t = StepCosts((1,), (0, 4), ((1.0, 2.0),))
    p = AdaptiveDrafting(t, prior=0.8, prior_weight=2.0)
    assert p.choose([seq_with()], [4], 1) == [4]  # a = 0.8: E = 3.36
    assert p.choose([seq_with(0.0, 8.0)], [4], 1) == [0]  # a = 1.6 / 10: E = 1.19
    assert p.choose([seq_with()], [0], 1) == [0]  # not eligible
    assert p.choose([seq_with()], [7], 1) == [4]  # the table's longest run bounds N
    # the batch turns drafting off: 2x a plain step at 1 sequence, 10x at 8 (4x at 4, interpolated)
    t = StepCosts((1, 8), (0, 4), ((1.0, 2.0), (2.0, 20.0)))
    p = AdaptiveDrafting(t, prior=0.8, prior_weight=2.0)
    assert p.choose([seq_with()], [4], 1) == [4]
    assert p.choose([seq_with() for _ in range(8)], [4] * 8, 8) == [0] * 8
    assert p.choose([seq_with() for _ in range(4)], [4] * 4, 4) == [0] * 4
    assert p.choose([seq_with()], [4], 8) == [0]  # one eligible among 8 decoding: still the batch of 8
    # mixed acceptance: only the sequence that accepts speculates (a = 0.9 vs 0.1; extra cost shared 1/2)
    t = StepCosts((2,), (0, 2), ((1.0, 2.0),))
    p = AdaptiveDrafting(t, prior=0.5, prior_weight=2.0)
    good, bad = seq_with(8.0, 0.0), seq_with(0.0, 8.0)
    assert p.choose([bad, good], [2, 2], 2) == [0, 2]  # (2 + 1.71) / 1.5 beats 2 / 1 and (2 + 1.82) / 2
    assert p.choose([bad, seq_with(0.0, 8.0)], [2, 2], 2) == [0, 0]
    # the draft length in between the table's: 4 (rate 4.0951 / 3) beats 6 (5.2170 / 4) at a = 0.9
    t = StepCosts((1,), (0, 4, 8), ((1.0, 3.0, 5.0),))
    p = AdaptiveDrafting(t, prior=0.5, prior_weight=2.0)
    assert p.choose([seq_with(8.0, 0.0)], [6], 1) == [4]
    assert p.choose([seq_with(1e9, 0.0)], [6], 1) == [6]  # a -> 1: 7 / 4 beats 5 / 3
    # a capped sequence gains only the drafts it may send, at the full run's share of the cost
    p = AdaptiveDrafting(StepCosts((2,), (0, 4), ((1.0, 1.2),)), prior=1.0, prior_weight=1.0)
    assert p.choose([seq_with(), seq_with()], [4, 1], 2) == [4, 1]  # 7 / 1.2 beats 6 / 1.1
    p = AdaptiveDrafting(StepCosts((2,), (0, 4), ((1.0, 1.5),)), prior=1.0, prior_weight=1.0)
    assert p.choose([seq_with(), seq_with()], [4, 1], 2) == [4, 0]  # 6 / 1.25 beats 7 / 1.5
    # a bad drafter's run: accepted nothing twice, then plain; probed again after 4, 8, ... 128 plain steps
    # (a probe assumes the prior), never more often once the backoff is at its longest
    t = StepCosts((1,), (0, 4), ((1.0, 2.0),))
    p = AdaptiveDrafting(t, decay=0.8, prior=0.8, prior_weight=2.0)
    s, drafted = seq_with(), []
    for step in range(520):
        (n,) = p.choose([s], [4], 1)
        drafted += [step] if n else []
        p.record(s, 4, 0) if n else p.skipped(s)
    assert drafted == [0, 1, 6, 15, 32, 65, 130, 259, 388, 517]
    assert s.draft_estimate.backoff == 128
    # the drafter turns good: the next probe accepts all 4 and the estimate keeps it drafting, backoff reset
    for step in range(520, 700):
        (n,) = p.choose([s], [4], 1)
        drafted += [step] if n else []
        p.record(s, 4, 4) if n else p.skipped(s)
    assert drafted[10:] == list(range(646, 700)) and s.draft_estimate.backoff == 4
    # a due sequence the table would not draft even at the prior: declined, it backs off without drafting
    p = AdaptiveDrafting(StepCosts((1,), (0, 4), ((1.0, 9.0),)), prior=0.8, prior_weight=2.0)
    s = seq_with(0.0, 8.0)
    for _ in range(5):
        assert p.choose([s], [4], 1) == [0]
        p.skipped(s)
    assert (s.draft_estimate.idle, s.draft_estimate.backoff) == (0, 8)
    # an amortised backoff past max_backoff is never shortened by a declined probe
    s.draft_estimate.idle = s.draft_estimate.backoff = 200
    p.skipped(s)
    assert (s.draft_estimate.idle, s.draft_estimate.backoff) == (0, 200)
    # the backoff after a speculative step amortises the sequence's share of the step's extra cost to
    # probe_share / S: 1 of 4 sequences speculating with 4 drafts adds c(1, 4) - c(1, 0) = 1 plain step at
    # c(4, 0) = 2, i.e. 0.5 of a plain step, all of it its own: 0.5 x 4 / 5% = 40 steps
    t = StepCosts((1, 4), (0, 4), ((1.0, 2.0), (2.0, 5.0)))
    p = AdaptiveDrafting(t, prior=0.8, prior_weight=2.0)
    batch = [seq_with(0.0, 8.0) for _ in range(4)]
    p.planned(batch, [4, 0, 0, 0], 4)
    assert batch[0].draft_estimate.step_extra == pytest.approx(2.0) and batch[1].draft_estimate.step_extra == 0.0
    p.record(batch[0], 4, 0)
    assert (batch[0].draft_estimate.idle, batch[0].draft_estimate.backoff) == (0, 40)
    # all four: c(4, 4) - c(4, 0) = 3 ms = 1.5 plain steps, a quarter each: 1.5 x 4 / 4 / 5% = 30 steps; a due
    # probe that accepts nothing doubles 40 to 80, an accepted draft resets it to the amortised 30
    p.planned(batch, [4] * 4, 4)
    assert batch[1].draft_estimate.step_extra == pytest.approx(1.5)
    batch[0].draft_estimate.idle = 40
    p.record(batch[0], 4, 0)
    assert batch[0].draft_estimate.backoff == 80
    p.record(batch[1], 4, 1)
    assert batch[1].draft_estimate.backoff == 30
    # one probing sequence pays the speculative step's fixed part alone: by the H200 compiled table, 1 of 32
    # sequences at a = 0.9 adds c(1, 7) - c(1, 0) = 5.89 ms to 8.53 (36.9 / 14.42 tokens a ms < 32 / 8.53),
    # where a share of the 32-sequence row (0.44 ms) would have drafted it
    p = AdaptiveDrafting(H200_9B_COMPILED_COSTS, prior=0.8, prior_weight=2.0)
    batch = [seq_with(1e9, 1e8)] + [seq_with(0.0, 1e9) for _ in range(31)]
    assert p.costs.extra(1, 7) == pytest.approx(9.84 - 3.95)
    assert p.choose(batch, [7] * 32, 32) == [0] * 32
    assert p.choose(batch[:1], [7], 1) == [7]  # alone, it drafts
    assert FixedDrafting().choose([seq_with(), seq_with()], [3, 0], 2) == [3, 0]


def test_h200_table_drafts_only_when_acceptance_pays():
    """By the measured H200 table a step of 15 drafts costs 6.7 plain steps at 1 sequence and 4.55 at 8:
    a = 0.9 (E[tau(15)] = 8.1) pays at both, a = 0.85 (E = 6.0) only at 8, a = 0.7 (E[tau(4)] = 2.8,
    4.9 plain steps at 1 sequence, 4.1 at 8) nowhere, 32 sequences (extrapolated) included."""
    def choice(a, S):
        return AdaptiveDrafting(H200_9B_COSTS, prior=a, prior_weight=1.0).choose([seq_with() for _ in range(S)], [15] * S, S)

    assert choice(0.9, 1) == [15] and choice(0.9, 8) == [15] * 8
    assert choice(0.85, 1) == [0] and choice(0.85, 8) == [15] * 8
    assert choice(0.7, 1) == [0] and choice(0.7, 8) == [0] * 8 and choice(0.7, 32) == [0] * 32
    assert isinstance(make_policy("fixed", None), FixedDrafting)
    assert make_policy("adaptive", None).costs is H200_9B_COSTS
    assert make_policy("adaptive", None, compiled=False).costs is H200_9B_COSTS
    assert make_policy("adaptive", None, compiled=True).costs is H200_9B_COMPILED_COSTS
    # learning: the table is the prior of the costs the engine measures
    assert make_policy("adaptive", None, compiled=True, learn=True).costs.prior is H200_9B_COMPILED_COSTS
    assert make_policy("adaptive", H200_9B_COSTS, learn=True).costs.prior is H200_9B_COSTS
    assert H200_9B_COMPILED_COSTS.cost(1, 15) == 12.17 and H200_9B_COMPILED_COSTS.cost(32, 0) == 8.53
    mine = FixedDrafting()
    assert make_policy(mine, None) is mine


@st.composite
def cost_tables(draw):
    """A step-cost table: 1-3 batch sizes, 1-3 draft lengths, each row increasing in N from its plain cost."""
    seqs = tuple(sorted(draw(st.sets(st.sampled_from([1, 2, 4, 8, 16, 32]), min_size=1, max_size=3))))
    drafts = (0, *sorted(draw(st.sets(st.sampled_from([1, 3, 4, 7, 15]), min_size=1, max_size=3))))
    rows = []
    for _ in seqs:
        row = [draw(st.floats(1.0, 10.0))]
        for _ in drafts[1:]:
            row.append(row[-1] + row[0] * draw(st.floats(0.01, 5.0)))
        rows.append(tuple(row))
    return StepCosts(seqs, drafts, tuple(rows))


@settings(max_examples=60, deadline=None, database=None)
@given(table=cost_tables(), S=st.sampled_from([1, 2, 3, 5, 8, 13, 32]), prior=st.floats(0.3, 1.0),
       weight=st.floats(0.5, 4.0))
# 8 of 13 speculate beside each probe: had their backoff reset by a run that accepted nothing, they came back
# every ~27 steps (found by a random search)
@example(table=StepCosts((4, 8, 16), (0, 4, 15), ((2.97, 5.56, 16.28), (8.63, 15.49, 19.69), (8.87, 27.56, 29.7))),
         S=13, prior=0.978, weight=3.266)
# 1 of 5 at a time, each probing on its own: amortised over its own steps alone, the five spent 5x the share
@example(table=StepCosts((1, 8, 16), (0, 4, 7, 15), ((1.36, 5.46, 5.75, 6.49), (5.59, 29.15, 39.23, 64.29),
                                                     (3.79, 9.23, 27.92, 44.26))), S=5, prior=0.93, weight=0.706)
def test_a_drafter_that_is_never_right_costs_at_most_the_probe_share(table, S, prior, weight):
    """S sequences whose every draft is rejected, any table: once the estimates first turn drafting off, the
    speculative steps' extra cost by the table is at most probe_share of the plain steps since, plus the last
    probe's (not yet amortised)."""
    p = AdaptiveDrafting(table, prior=prior, prior_weight=weight)
    seqs = [Sequence(i, [1], SamplingParams(), 0) for i in range(S)]
    c0, off, extra, last = table.cost(S, 0), None, 0.0, 0.0
    for step in range(600):
        n = p.choose(seqs, [table.drafts[-1]] * S, S)
        p.planned(seqs, n, S)
        k = sum(1 for d in n if d)
        if off is None and k == 0:
            off = step
        if off is not None and k:
            last = table.extra(k, max(n)) / c0
            extra += last
        for seq, d in zip(seqs, n):
            p.record(seq, d, 0) if d else p.skipped(seq)
    if off is not None:
        assert extra <= p.probe_share * (600 - off) + last + 1e-9


@settings(max_examples=80, deadline=None, database=None)
@given(table=cost_tables(), S=st.sampled_from([1, 2, 3, 5, 8, 13, 32]), data=st.data())
def test_every_chosen_step_beats_plain_at_its_own_prices(table, S, data):
    """Any table, any estimates (some sequences due): the step choose() returns, probes at their shortened length,
    yields more expected tokens per unit of cost than a plain step, probes at the prior and the rest at their
    estimates; no probe sends more than the step's longest run, nor any sequence more than its cap; and the
    prices it keeps are the table's."""
    p = AdaptiveDrafting(table, prior=data.draw(st.floats(0.3, 0.95)), prior_weight=2.0)
    seqs, caps = [], []
    for _ in range(S):
        q = seq_with(data.draw(st.floats(0.0, 10.0)), data.draw(st.floats(0.0, 10.0)))
        q.draft_estimate.idle = data.draw(st.sampled_from([0, 4, 9]))
        seqs.append(q)
        caps.append(data.draw(st.sampled_from([0, 1, 3, 7, 15])))
    n = p.choose(seqs, caps, S)
    assert all(0 <= d <= c for d, c in zip(n, caps))
    assert all(p.prices(S, N) == [table.step(S, k, N) for k in range(S + 1)] for N in (0, *table.drafts[1:]))
    k = sum(1 for d in n if d)
    if not k:
        return
    rate = {i: p.prior if p.due(q) and p.acceptance(q) < p.prior else p.acceptance(q) for i, q in enumerate(seqs)}
    tokens = S + sum(expected_tokens(rate[i], d) - 1.0 for i, d in enumerate(n) if d)
    assert tokens / table.step(S, k, max(n)) > S / table.step(S, 0, 0)


# ------------------------------------------------------------------------------------------ the engine
# drafting pays at 1 to 4 sequences while the acceptance stays high (7 drafts cost 3 plain steps)
CHEAP = StepCosts((1, 4), (0, 1, 3, 7, 15), ((1.0, 1.5, 2.0, 3.0, 5.0), (2.0, 3.0, 4.0, 6.0, 10.0)))


def test_a_probe_sends_the_cheapest_draft_length_that_pays_at_the_prior():
    """A sequence its estimate keeps off (0.32), once due, is probed at the prior with 1 draft: 1.8 tokens over
    1.5 beats 1 over 1, and no length costs less (3 drafts would yield more, 2.95 over 2, but a probe asks only
    whether a draft is accepted). A due sequence whose own estimate is above the prior is no probe: it drafts
    as it chooses. Where the shortest length does not pay, the cheapest one that does: the H200 table at one
    sequence prices 1, 3 and 7 drafts at 9.69, 10.22 and 9.84 ms against 3.95 plain, so 1 draft (1.8 tokens)
    loses and 7 (4.16) is the cheapest that pays; at 8 sequences probing together, 1 draft pays and costs least."""
    p = AdaptiveDrafting(CHEAP, prior=0.8, prior_weight=2.0)
    s = seq_with(0.0, 3.0)
    assert p.acceptance(s) == pytest.approx(0.32) and p.choose([s], [7], 1) == [0]
    s.draft_estimate.idle = 4
    assert p.due(s) and p.choose([s], [7], 1) == [1]
    good = seq_with(8.0, 0.0)
    good.draft_estimate.idle = 4
    assert p.due(good) and p.choose([good], [7], 1) == [7]
    # two probes of four sequences send 1 draft each (priced as a 1-draft step of 2 sequences); beside two
    # sequences drafting 7 the step costs the same whatever they send, so they send 7 too:
    # (4 + 2 x 5.97 + 2 x 3.16) / 6 beats (4 + 2 x 5.97) / 4.67 without them
    a, b = seq_with(0.0, 3.0), seq_with(0.0, 3.0)
    a.draft_estimate.idle = b.draft_estimate.idle = 4
    assert p.choose([a, b], [7, 7], 4) == [1, 1]
    assert p.choose([a, b, seq_with(8.0, 0.0), seq_with(8.0, 0.0)], [7] * 4, 4) == [7, 7, 7, 7]
    h = AdaptiveDrafting(H200_9B_COMPILED_COSTS)
    for S, want in ((1, 7), (8, 1)):
        probes = [seq_with(0.0, 3.0) for _ in range(S)]
        for q in probes:
            q.draft_estimate.idle = 4
        assert h.choose(probes, [7] * S, S) == [want] * S


def test_config_knobs(model, drafter, tmp_path):
    with pytest.raises(ValueError, match="draft_policy must be one of"):
        EngineConfig(draft="d", draft_policy="sometimes")
    with pytest.raises(ValueError, match="draft_policy must be one of"):
        EngineConfig(draft="d", draft_policy=3)
    with pytest.raises(ValueError, match="draft_costs is the adaptive policy's"):
        EngineConfig(draft="d", draft_policy="fixed", draft_costs="t.json")
    with pytest.raises(ValueError, match="draft_policy needs a drafter"):
        EngineConfig(draft_policy="adaptive")
    for bad in (2, 16, True, "8"):
        with pytest.raises(ValueError, match="draft_bits must be"):
            EngineConfig(draft="d", draft_bits=bad)
    # default on the CPU references: the fixed rule; given a table or asked for: the adaptive one
    assert Engine(model, draft=drafter, **KW).stats()["draft_policy"] == "fixed"
    assert Engine(model, draft=drafter, draft_costs=CHEAP, **KW).spec.policy.costs is CHEAP  # a table: adaptive
    eng = Engine(model, draft=drafter, draft_policy="adaptive", draft_costs=CHEAP, **KW)
    assert eng.spec.policy.costs is CHEAP and eng.stats()["draft_policy"] == "adaptive"
    # a spec_bench JSON: the rows of the engine's compiled or uncompiled speculative steps
    rows = [dict(seqs=1, n_draft=n, commit="auto", compiled=c, plain_step_ms=1.0, spec_step_ms=ms)
            for n, c, ms in ((0, "off", 1.5), (4, "off", 6.0), (0, "on", 1.2), (4, "on", 3.0))]
    (tmp_path / "spec.json").write_text(json.dumps({"rows": rows}))
    for compiled, want in ((False, ((1.5, 6.0),)), (True, ((1.2, 3.0),))):
        eng = Engine(model, draft=drafter, draft_policy="adaptive", draft_costs=str(tmp_path / "spec.json"),
                     compile_decode=compiled, **KW)
        assert eng.spec.policy.costs == StepCosts((1,), (0, 4), want)


@pytest.mark.parametrize("good", [True, False])
def test_adaptive_drafting_keeps_greedy_outputs(model, drafter, good):
    """Three requests, n_draft 7, with an oracle (full acceptance) or an always-wrong drafter, drafting
    adaptively by a table where 7 drafts cost 3 plain steps at 1 sequence: outputs equal plain decoding;
    the oracle speculates as the fixed rule does, the wrong drafter is turned off after a few rejections
    (fewer verifications than the fixed rule, plain decodes in between); nothing leaks."""
    prompts = [random_token_ids(n, 512, seed=300 + n) for n in (7, 30, 18)]
    sp = greedy(20, ignore_eos=True)
    kw = dict(slots=3, step_tokens=32, block_tokens=16, num_blocks=30, prefix_interval=0)
    base = plain_outputs(model, prompts, sp, **{k: v for k, v in kw.items() if k != "prefix_interval"})
    ref = {tuple(p): p + o.token_ids for p, o in zip(prompts, base)}
    stats = {}
    for policy in ("fixed", "adaptive"):
        eng = Engine(model, draft=drafter, n_draft=7, draft_policy=policy,
                     draft_costs=CHEAP if policy == "adaptive" else None, **kw)
        eng.spec.propose = Oracle(ref) if good else wrong_by_one(ref)
        outs = eng.generate(prompts, sp)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
        stats[policy] = eng.stats()
        assert_idle(eng)
    fixed, adaptive = stats["fixed"], stats["adaptive"]
    assert adaptive["spec_verifications"] > 0
    if good:
        assert adaptive["accepted_tokens"] == adaptive["draft_tokens"] > 0
        assert adaptive["mean_acceptance_length"] > 4
    else:
        assert adaptive["accepted_tokens"] == fixed["accepted_tokens"] == 0
        assert adaptive["spec_verifications"] < fixed["spec_verifications"] and adaptive["plain_decodes"] > fixed["plain_decodes"]


def test_drafting_that_never_pays_runs_the_plain_engine(model, drafter):
    """A table where any draft costs 100 plain steps: no verification, and as many engine steps as an
    engine without a drafter (the plain steps stay pipelined: no read-back before scheduling)."""
    prompts = [random_token_ids(n, 512, seed=400 + n) for n in (11, 26)]
    sp = greedy(12, ignore_eos=True)
    kw = dict(slots=2, step_tokens=32, block_tokens=16, num_blocks=20)
    plain = Engine(model, prefix_interval=0, **kw)
    base = plain.generate(prompts, sp)
    eng = Engine(model, draft=drafter, n_draft=7, draft_policy="adaptive", prefix_interval=0,
                 draft_costs=StepCosts((1,), (0, 7), ((1.0, 100.0),)), **kw)
    outs = eng.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    s = eng.stats()
    assert s["spec_steps"] == s["spec_verifications"] == s["draft_tokens"] == 0
    assert s["steps"] == s["plain_steps"] == plain.stats()["steps"]
    assert s["plain_decodes"] == 2 * 11  # every token after the first of each request
    assert_idle(eng)


def test_a_drafter_that_is_never_right_is_probed_with_a_growing_backoff(model, drafter):
    """One request, n_draft 7, every draft wrong, the CHEAP table (a step of 3 drafts costs 2 plain steps, of
    1 draft 1.5). The 2nd generated token verifies 3 drafts (the prior, a = 0.8): its extra plain step, / 5%,
    sets the backoff to 20. The 3rd verifies 1 draft (a = 0.53 after one rejection), which keeps it. Then the
    estimate (0.42) keeps it plain until the probe at the prior after 20 plain steps (the 24th token), which
    doubles the backoff to 40 (the 65th). Each probe sends the table's shortest draft length, 1 (its extra half
    plain step would amortise over 10 steps: the doubling rules). Output as plain decoding, in as many steps (a
    rejected run yields one token, as a plain step does)."""
    prompt = random_token_ids(12, 512, seed=77)
    sp = greedy(80, ignore_eos=True)
    kw = dict(slots=1, step_tokens=32, block_tokens=16, num_blocks=12, prefix_interval=0)
    (base,) = plain_outputs(model, [prompt], sp, **{k: v for k, v in kw.items() if k != "prefix_interval"})
    eng = Engine(model, draft=drafter, n_draft=7, draft_policy="adaptive", draft_costs=CHEAP, **kw)
    eng.spec.propose = wrong_by_one({tuple(prompt): prompt + base.token_ids})
    at, record = [], eng.spec.policy.record

    def recording(seq, drafts, accepted):
        at.append(seq.num_generated)
        record(seq, drafts, accepted)

    eng.spec.policy.record = recording
    (out,) = eng.generate([prompt], sp)
    assert out.token_ids == base.token_ids
    assert at == [2, 3, 24, 65]
    got = eng.stats()
    assert (got["spec_verifications"], got["accepted_tokens"], got["steps"], got["plain_decodes"]) == (4, 0, 80, 75)
    assert got["draft_tokens"] == 3 + 1 + 1 + 1
    assert_idle(eng)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(w=spec_workloads())
def test_random_workloads_with_adaptive_drafting_match_plain_decoding(model, drafter, w):
    """test_speculative's hypothesis workloads (staggered arrivals, prefix boundaries, preemptions, opted-out
    requests, oracle drafts with noise 0 / 0.3 / 1) drafting adaptively: plain decoding's tokens (near-ties
    excepted), no leaks (check_workload)."""
    check_workload(model, drafter, None, w, draft_policy=AdaptiveDrafting(CHEAP))
