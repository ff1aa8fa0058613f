"""Repetition, frequency and presence penalties (runtime/penalties.py) on the CPU: the rule against its
definition over random rows, the engine's penalised greedy tokens against the model run alone on each request
with the rule applied at each step (batched, pipelined, preempted), seeded penalised sampling independent of
batching, and penalised requests never drafting in an engine with a drafter."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_checkpoints import write_tiny_drafter
from engine_checks import near_tie, ref_logits, run_preempting
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.penalties import PenaltyRows, penalized


def reference(x: np.ndarray, history: list[int], prompt: list[int], p: SamplingParams) -> np.ndarray:
    """The definitions, one row: repetition over prompt and reply, then frequency and presence over the reply."""
    x = x.astype(np.float64).copy()
    counts = np.bincount(np.asarray(history, dtype=np.int64), minlength=len(x)).astype(np.float64)
    if p.repetition_penalty != 1:
        hit = counts > 0
        hit[list(prompt)] = True
        x = np.where(hit, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    for t, b in p.logit_bias:
        x[t] += b
    return x


_PARAMS = st.builds(
    lambda pres, freq, rep, bias: SamplingParams(presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep,
                                                 logit_bias=bias),
    st.sampled_from([0.0, 1.5, -0.5, 2.0]), st.sampled_from([0.0, 0.7, -2.0]), st.sampled_from([1.0, 1.3, 0.8]),
    st.dictionaries(st.integers(0, 2), st.sampled_from([-100.0, 2.5, 100.0]), max_size=2))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_rule_is_the_definition(data):
    P, V = data.draw(st.integers(1, 4)), data.draw(st.integers(3, 40))
    rows = [data.draw(st.tuples(_PARAMS, st.lists(st.integers(0, V - 1), max_size=12),
                                st.one_of(st.just(-1), st.integers(0, V - 1)),
                                st.lists(st.integers(0, V - 1), max_size=8))) for _ in range(P)]
    x = np.random.default_rng(data.draw(st.integers(0, 2**31))).standard_normal((P, V)).astype(np.float32) * 3
    pen = PenaltyRows(list(range(P)), [r[0] for r in rows], [r[1] for r in rows],
                      mx.array([r[2] for r in rows], dtype=mx.int32),
                      [tuple(sorted(set(r[3]))) for r in rows])
    got = np.array(penalized(mx.array(x), pen))
    for i, (p, hist, pending, prompt) in enumerate(rows):
        want = reference(x[i], hist + ([pending] if pending >= 0 else []), prompt, p)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)


def check_penalised_greedy(model, prompt, out, p: SamplingParams):
    """Each token is the argmax of the model run alone on prompt + the tokens before it, penalised by the
    rule over those tokens (within near_tie of it)."""
    toks = out.token_ids
    rows = ref_logits(model, prompt + toks[:-1])[len(prompt) - 1:]
    for k, (tok, row) in enumerate(zip(toks, rows)):
        x = reference(row, toks[:k], prompt, p)
        ref = int(x.argmax())
        assert tok == ref or x[ref] - x[tok] <= near_tie() * np.abs(x).max(), (k, tok, ref)


PENALISED = [SamplingParams(max_tokens=14, ignore_eos=True, presence_penalty=2.0),
             SamplingParams(max_tokens=14, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.3),
             SamplingParams(max_tokens=14, ignore_eos=True, repetition_penalty=2.0),
             SamplingParams(max_tokens=14, ignore_eos=True)]


def test_penalised_greedy_is_the_request_alone_with_the_rule(model):
    """Batched with arrivals, chunked prompts and preemptions on a tight pool; the engine's steps are pipelined
    (each is launched before the previous one's tokens are read), so every penalised token after the first
    counted a token still in flight."""
    reqs, outs = run_preempting(model, PENALISED, (30, 5, 47, 12, 21, 9), seed=40, spread=3, num_blocks=9)
    for (_, prompt, p), out in zip(reqs, outs):
        assert len(out.token_ids) == 14
        check_penalised_greedy(model, prompt, out, p)
    assert outs[0].token_ids != Engine(model, slots=1, prefix_interval=0).generate(
        [reqs[0][1]], SamplingParams(max_tokens=14, ignore_eos=True))[0].token_ids  # the penalty did something


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**20))
def test_seeded_penalised_sampling_is_independent_of_batching(model, seed):
    prompt = random_token_ids(17, 512, seed=seed)
    hot = SamplingParams(temperature=0.9, max_tokens=10, seed=seed, presence_penalty=1.0, repetition_penalty=1.2,
                         ignore_eos=True)
    alone = Engine(model, slots=1, step_tokens=16, block_tokens=16, num_blocks=8).generate([prompt], hot)[0]
    others = [random_token_ids(n, 512, seed=seed + n) for n in (40, 7, 26)]
    eng = Engine(model, slots=4, step_tokens=16, block_tokens=16, num_blocks=6)
    outs = eng.generate(others + [prompt], [SamplingParams(max_tokens=10, frequency_penalty=0.5)] * 3 + [hot])
    assert outs[-1].token_ids == alone.token_ids


@pytest.fixture(scope="module")
def drafter(ckpt, model, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt, num_layers=2, block_size=16), model)


def test_penalised_requests_never_draft(model, drafter):
    prompts = [random_token_ids(n, 512, seed=n) for n in (9, 23)]
    sps = [SamplingParams(max_tokens=12, presence_penalty=1.0), SamplingParams(max_tokens=12, repetition_penalty=1.5)]
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=20, draft=drafter, n_draft=3,
                 prefix_interval=0)
    outs = eng.generate(prompts, sps)
    assert eng.stats()["draft_tokens"] == eng.stats()["spec_verifications"] == 0
    plain = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=20, prefix_interval=0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, sps)]


def test_a_logit_bias_of_100_forces_its_token_and_minus_100_bans_it(model):
    prompt = random_token_ids(13, 512, seed=2)
    eng = Engine(model, slots=2, step_tokens=16, block_tokens=16, num_blocks=16)
    plain, forced = eng.generate([prompt] * 2, [SamplingParams(max_tokens=6, ignore_eos=True),
                                                SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={77: 100})])
    assert forced.token_ids == [77] * 6
    banned = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True,
                                                   logit_bias={t: -100 for t in set(plain.token_ids)}))[0]
    assert not set(banned.token_ids) & set(plain.token_ids)


def test_min_tokens_holds_back_eos_and_stop_ids(model):
    """A bias makes EOS (508) the best token everywhere: the reply is EOS at once, or after min_tokens tokens;
    a stop token id is held back the same way."""
    prompt = random_token_ids(11, 512, seed=4)
    eng = Engine(model, slots=3, step_tokens=16, block_tokens=16, num_blocks=16)
    eos_first = SamplingParams(max_tokens=20, logit_bias={508: 100})
    outs = eng.generate([prompt] * 3, [eos_first, SamplingParams(max_tokens=20, logit_bias={508: 100}, min_tokens=5),
                                       SamplingParams(max_tokens=20, logit_bias={77: 100}, stop_token_ids=[77],
                                                      min_tokens=3)])
    assert outs[0].token_ids == [508]
    assert len(outs[1].token_ids) == 6 and outs[1].token_ids[-1] == 508 and 508 not in outs[1].token_ids[:5]
    assert len(outs[2].token_ids) == 4 and outs[2].token_ids[-1] == 77 and outs[2].finish_reason == "stop"


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -2.1),
                                          ("repetition_penalty", 0), ("repetition_penalty", 101),
                                          ("presence_penalty", "1"), ("logit_bias", {5: 100.5}),
                                          ("logit_bias", {-3: 1}), ("logit_bias", {i: 1 for i in range(1025)}),
                                          ("min_tokens", 300), ("min_tokens", -1)])
def test_out_of_range_penalties_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
