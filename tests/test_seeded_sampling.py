"""Seeded sampling is a function of (seed, request, position) only: the same seeded request (temperature
> 0) gives the same tokens alone, batched with other requests (seeded, unseeded and greedy, whose draft
runs differ), with or without a drafter (any n_draft), and with or without a prefix-cache hit.

"With or without a drafter" holds token for token because verification uses the plain sampler's
per-position noise (rejection.py): every emitted token is the one the plain sampler draws there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_checkpoints import write_tiny_drafter
from engine_checks import assert_idle, greedy
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, SamplingParams

SMALL = dict(step_tokens=48, block_tokens=16, num_blocks=40)


@pytest.fixture(scope="module")
def drafter(ckpt, model, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt), model)


class SampledOracle:
    """A proposer that knows the seeded request's plain continuation (`ref`: prompt -> full tokens) and
    proposes it through draft logits peaked on it (so the noise cannot move the draft), a fraction `wrong`
    of the drafts (and every other request's) peaked on a random token instead."""

    def __init__(self, ref: dict, wrong: float, seed: int, vocab: int = 512):
        self.ref, self.wrong, self.rng, self.vocab = ref, wrong, np.random.default_rng(seed), vocab

    def __call__(self, seqs, layout, n):
        q = np.full((len(seqs), n, self.vocab), -50.0, dtype=np.float32)
        for j, s in enumerate(seqs):
            full = self.ref.get(tuple(s.seq.tokens[: s.seq.prompt_len]), ())
            for i in range(n):
                pos = s.start + 1 + i
                good = pos < len(full) and self.rng.random() >= self.wrong
                q[j, i, full[pos] if good else int(self.rng.integers(self.vocab))] = 50.0
        q = mx.array(q)
        return mx.argmax(q, axis=-1).astype(mx.int32), q


def _requests(draw_seed: int, n: int):
    """Bystanders: prompts of several lengths, greedy, seeded and unseeded sampling, several lengths."""
    out = []
    for j in range(n):
        prompt = random_token_ids(5 + 9 * j, 512, seed=draw_seed + j)
        kind = j % 3
        sp = (greedy(3 + j) if kind == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4 + j, seed=draw_seed + 100 + j) if kind == 1 else
              SamplingParams(temperature=1.2, max_tokens=2 + 2 * j))
        out.append((prompt, sp))
    return out


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(seed=st.integers(0, 2**40), temperature=st.sampled_from([0.6, 1.0, 1.5]), top_k=st.sampled_from([0, 5]),
       plen=st.integers(17, 40), n_draft=st.integers(1, 3), bystanders=st.integers(1, 4))
def test_a_seeded_request_gives_the_same_tokens_everywhere(model, drafter, seed, temperature, top_k, plen, n_draft,
                                                            bystanders):
    prompt = random_token_ids(plen, 512, seed=seed % 1000)
    sp = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=9, seed=seed, ignore_eos=True)
    others = _requests(seed % 997, bystanders)
    ref = Engine(model, slots=1, prefix_interval=0, **SMALL).generate([prompt], sp)[0].token_ids
    assert len(ref) == 9

    def batched(oracle=None, **kw):
        eng = Engine(model, slots=4, **SMALL, **kw)
        if oracle is not None:
            eng.spec.propose = oracle
        outs = eng.generate([p for p, _ in others[:1]] + [prompt] + [p for p, _ in others[1:]],
                            [s for _, s in others[:1]] + [sp] + [s for _, s in others[1:]])
        assert_idle(eng)
        if oracle is not None:  # the accepted drafts are the plain sampler's tokens too
            assert eng.stats()["accepted_tokens"] > 0
        return outs[1].token_ids

    assert batched(prefix_interval=0) == ref
    spec = dict(draft=drafter, n_draft=n_draft)
    assert Engine(model, slots=1, prefix_interval=0, **SMALL, **spec).generate([prompt], sp)[0].token_ids == ref
    assert batched(prefix_interval=0, **spec) == ref
    assert batched(SampledOracle({tuple(prompt): prompt + ref}, 0.3, seed), prefix_interval=0, **spec) == ref
    for kw in ({}, spec):  # the second run of the prompt restores its first 16 tokens from the cache
        eng = Engine(model, slots=2, prefix_interval=16, **SMALL, **kw)
        assert eng.generate([prompt], sp)[0].token_ids == ref
        assert eng.generate([prompt], sp)[0].token_ids == ref
        assert eng.stats()["prefix_hits"] >= 1
        if kw:
            assert eng.stats()["draft_tokens"] > 0
