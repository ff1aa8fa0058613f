"""Log probabilities of generated tokens (runtime/logprobs.py) on the CPU: each token's logprob and its top k are
the model's own distribution at that position, run alone (raw logits: before penalties and temperature),
whatever the batching, pipelining and preemptions; streamed deltas carry their tokens' logprobs; a request
asking for them never drafts."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_checkpoints import write_tiny_drafter
from engine_checks import assert_idle, close, ref_logits, run_preempting
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, SamplingParams, logprobs


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def check_logprobs(model, prompt, out, k: int):
    toks = out.token_ids
    assert out.logprobs is not None and [lp.token for lp in out.logprobs] == toks
    rows = ref_logits(model, prompt + toks[:-1])[len(prompt) - 1:]
    for tok, row, lp in zip(toks, rows, out.logprobs):
        want = log_softmax(row)
        assert close(lp.logprob, want[tok]), (lp.logprob, want[tok])
        assert len(lp.top) == k
        ids, vals = [t for t, _ in lp.top], [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert close(vals, want[ids])  # each listed logprob is its token's
        kth = np.sort(want)[::-1][k - 1] if k else None
        if k:  # and they are the k most likely (ties at the k-th value may be listed either way)
            assert close(vals[-1], kth) and all(want[t] <= vals[-1] + 2e-5 for t in set(range(len(want))) - set(ids))


REQS = [SamplingParams(max_tokens=9, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=9, ignore_eos=True, logprobs=0, presence_penalty=1.5),
        SamplingParams(max_tokens=9, ignore_eos=True, logprobs=20, temperature=0.8, seed=5),
        SamplingParams(max_tokens=9, ignore_eos=True)]


def test_logprobs_are_the_model_alone_at_each_position(model):
    reqs, outs = run_preempting(model, REQS, (25, 6, 40, 13, 19, 31), seed=60, spread=2, num_blocks=8)
    for (_, prompt, p), out in zip(reqs, outs):
        if p.logprobs is None:
            assert out.logprobs is None
        else:
            check_logprobs(model, prompt, out, p.logprobs)


def test_streamed_deltas_carry_their_tokens_logprobs(model):
    eng = Engine(model, slots=2, step_tokens=16, block_tokens=16, num_blocks=16)
    prompt = random_token_ids(21, 512, seed=3)
    rid = eng.submit(prompt, SamplingParams(max_tokens=7, logprobs=2, ignore_eos=True))
    toks, lps, final = [], [], None
    while eng.has_work():
        for d in eng.step():
            assert d.request_id == rid and len(d.logprobs) == len(d.token_ids)
            toks += d.token_ids
            lps += d.logprobs
            final = d.output if d.finished else final
    assert toks == final.token_ids and lps == final.logprobs


def test_a_request_asking_for_logprobs_never_drafts(ckpt, model, tmp_path):
    drafter = load_drafter(write_tiny_drafter(tmp_path / "drafter", ckpt, num_layers=2, block_size=16), model)
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=20, draft=drafter, n_draft=3,
                 prefix_interval=0)
    prompt = random_token_ids(15, 512, seed=8)
    out = eng.generate([prompt], SamplingParams(max_tokens=10, logprobs=1))[0]
    assert eng.stats()["draft_tokens"] == 0
    check_logprobs(model, prompt, out, 1)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_are_refused(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)


def test_prompt_logprobs_are_the_model_alone_and_the_engine_is_untouched(model, monkeypatch):
    """A 300-token prompt (past a 256-row head chunk and 128-token blocks): each token's logprob given the ones
    before it, the first None; the request's reply and the pool are as without it."""
    prompt = random_token_ids(300, 512, seed=11)
    eng = Engine(model, slots=2, step_tokens=64, block_tokens=16, num_blocks=40)
    out, plain = eng.generate([prompt, prompt], [SamplingParams(max_tokens=4, prompt_logprobs=2),
                                                 SamplingParams(max_tokens=4)])
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None
    lps = out.prompt_logprobs
    assert len(lps) == 300 and lps[0] is None and [lp.token for lp in lps[1:]] == prompt[1:]
    rows = ref_logits(model, prompt)
    for p in range(1, 300):
        want = log_softmax(rows[p - 1])
        assert close(lps[p].logprob, want[prompt[p]]) and close([v for _, v in lps[p].top], np.sort(want)[::-1][:2])
    monkeypatch.setattr(logprobs, "MAX_PROMPT_LOGPROB_TOKENS", 299)  # one pass outside the pool: bounded
    with pytest.raises(ValueError, match="prompt logprobs .* at most 299 tokens, got 300"):
        eng.submit(prompt, SamplingParams(prompt_logprobs=0))
    # under tensor parallelism rank 0 would run the pass alone, its collectives waiting for the other ranks
    monkeypatch.setattr(eng.model, "group", object(), raising=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        eng.submit(prompt[:10], SamplingParams(prompt_logprobs=0))
    assert not eng.has_work()


def test_the_prompt_logprob_pass_leaves_its_state_for_the_engine(ckpt, model, tmp_path):
    """The pass computes the prompt; its state before the last token becomes a prefix entry, so the engine runs
    only the last token (exactly: the counters), with the reply and logprobs of an engine without a prefix cache.
    Not for a salted request (its entries are its tenant's), nor with a drafter (the pass writes no drafter rows)."""
    prompt = random_token_ids(150, 512, seed=12)
    sp = SamplingParams(max_tokens=5, prompt_logprobs=1, logprobs=1)
    eng = Engine(model, slots=1, step_tokens=64, block_tokens=16, num_blocks=40)
    (out,) = eng.generate([prompt], sp)
    (alone,) = Engine(model, slots=1, step_tokens=64, block_tokens=16, num_blocks=40, prefix_interval=0).generate(
        [prompt], sp)
    assert out.cached_tokens == 149 and eng.counters["prefill_tokens"] == 1 and eng.stats()["prefix_hits"] == 1
    assert out.token_ids == alone.token_ids and alone.cached_tokens == 0
    assert [(lp.token, lp.top) for lp in out.prompt_logprobs[1:]] == [(lp.token, lp.top) for lp in alone.prompt_logprobs[1:]]
    assert all(close(a.logprob, b.logprob) for a, b in zip(out.logprobs, alone.logprobs))
    (salted,) = Engine(model, slots=1, step_tokens=64, block_tokens=16, num_blocks=40).generate(
        [prompt], SamplingParams(max_tokens=2, prompt_logprobs=0, cache_salt="t"))
    assert salted.cached_tokens == 0
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", ckpt, num_layers=2), model)
    (drafting,) = Engine(model, slots=1, step_tokens=64, block_tokens=16, num_blocks=40, draft=drafter).generate(
        [prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert drafting.cached_tokens == 0
    assert_idle(eng)
