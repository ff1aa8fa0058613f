"""Speculative decoding with temperature > 0: the coupled verification emits the plain sampler's tokens
and so keeps the target's distribution, alone (one verification, many draws) and through the engine (many
seeds, the joint law of a short completion)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dflash_checkpoints import write_tiny_drafter
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.rejection import position_noise, probs, sample_drafts, verify_sampled
from mtlqwen.runtime.sampling import sample


@pytest.fixture(scope="module")
def drafter(ckpt, model, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt), model)


def _one_verification(p_logits, q_logits, S, N, V):
    """S seeds verify N drafts against context-free target rows p_0..p_N (the same whatever the prefix, so
    the plain sampler's token at position t is its draw from row t). Returns k, next token, drafts and the
    plain sampler's tokens [N + 1, S], all numpy."""
    params, seeds = [SamplingParams(temperature=1.0)] * S, list(range(S))
    noise = position_noise(seeds, [0] * S, N + 1, V)
    drafts = sample_drafts(mx.broadcast_to(q_logits, (S, N, V)), params, noise)
    k, tok = verify_sampled(mx.broadcast_to(p_logits, (S, N + 1, V)), drafts, mx.ones((S, N), dtype=mx.bool_),
                            params, noise)
    plain = [sample(mx.broadcast_to(p_logits[t], (S, V)), params, seeds, [t] * S) for t in range(N + 1)]
    return np.array(k), np.array(tok), np.array(drafts), np.array(mx.stack(plain))


def test_coupled_verification_emits_the_plain_samplers_tokens():
    """Every token a verification emits (accepted drafts, then the correction or bonus) is the token the
    plain sampler draws at that position with that seed, a draft is accepted exactly when it is that token,
    and so the first token follows p_0 and the second p_1."""
    S, N, V = 2000, 3, 6
    rng = np.random.default_rng(0)
    p_logits = mx.array(rng.normal(size=(N + 1, V)) * 1.5, dtype=mx.float32)
    q_logits = mx.array(np.log(rng.dirichlet(np.ones(V), size=N)), dtype=mx.float32)
    k, tok, d, plain = _one_verification(p_logits, q_logits, S, N, V)
    for s in range(S):
        emitted = d[s, : k[s]].tolist() + [int(tok[s])]
        assert emitted == plain[: k[s] + 1, s].tolist()
        match = (d[s] == plain[:N, s]).tolist() + [False]
        assert k[s] == match.index(False)
    p = np.array(probs(p_logits, [SamplingParams(temperature=1.0)] * (N + 1)))
    chi_square_check(np.bincount(plain[0], minlength=V), p[0])
    chi_square_check(np.bincount(plain[1][k >= 1], minlength=V), p[1])
    assert 0 < (k >= 1).mean() < 1 and (k == N).any()


def test_coupled_acceptance_of_two_candidates_is_the_rejection_sampling_rate():
    """With two candidate tokens the shared noise accepts a draft with probability sum(min(p, q)), the
    most any verification keeping the target's distribution can accept."""
    S, N, V = 4000, 1, 2
    p_logits = mx.array([[0.8, -0.4], [0.0, 0.0]], dtype=mx.float32)
    q_logits = mx.array([[-1.0, 1.0]], dtype=mx.float32)
    k, _, _, _ = _one_verification(p_logits, q_logits, S, N, V)
    p = np.array(probs(p_logits[:1], [SamplingParams(temperature=1.0)]))[0]
    q = np.array(mx.softmax(q_logits, axis=-1))[0]
    rate = np.minimum(p, q).sum()
    assert abs((k >= 1).mean() - rate) < 4 * math.sqrt(rate * (1 - rate) / S)


def chi_square_check(counts, expected_p, p_value=1e-4):
    """Pearson's chi-square goodness of fit (cells with expected count < 5 pooled); fails only when the
    counts are this unlikely under expected_p."""
    from scipy.stats import chi2  # noqa: PLC0415

    n = counts.sum()
    exp = np.asarray(expected_p, dtype=np.float64) * n
    assert counts[exp == 0].sum() == 0, "a token the target gives probability 0"
    small = exp < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    limit = chi2.ppf(1 - p_value, max(1, keep.sum() - 1))
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f} (counts {obs.tolist()}, expected {np.round(exp, 1).tolist()})"


def test_sampled_speculation_follows_the_target_distribution(model, drafter):
    """Many seeds, one prompt, top_k=2, 4 tokens: the joint frequency of the 16 possible completions
    matches the target's own probabilities. Drafts come from a q that favours the target's second choice
    on the greedy path, so drafts are accepted often but not always and the residual and bonus paths are
    both taken (accepting every draft, or drawing a rejection's token from p, fails this test)."""
    prompt, N = random_token_ids(6, 512, seed=11), 400
    cache: dict = {}

    def logits_at(tokens):
        key = tuple(tokens)
        if key not in cache:
            cache[key] = model.logits(list(tokens))[-1]
        return cache[key]

    def skewed_oracle(seqs, layout, n):
        """q on the greedy path: the target's top two tokens, but 0.12 / 0.88 the wrong way round."""
        q = np.full((len(seqs), n, 512), -1e9, dtype=np.float32)
        for j, s in enumerate(seqs):
            ctx = list(s.seq.tokens)
            for i in range(n):
                top = np.argsort(-np.array(logits_at(ctx)))[:2]
                q[j, i, top] = (0.0, 2.0)
                ctx.append(int(top[0]))
        q = mx.array(q)
        return mx.argmax(q, axis=-1).astype(mx.int32), q

    sps = [SamplingParams(temperature=1.0, top_k=2, max_tokens=4, seed=i, ignore_eos=True) for i in range(N)]
    eng = Engine(model, slots=16, step_tokens=48, block_tokens=16, num_blocks=40, draft=drafter, n_draft=2, prefix_interval=0)
    eng.spec.propose = skewed_oracle
    outs = eng.generate([prompt] * N, sps)
    s = eng.stats()
    assert 0.2 * s["draft_tokens"] < s["accepted_tokens"] < 0.95 * s["draft_tokens"]
    # the target's distribution over the completions (same temperature / top_k transform)
    dist: dict[tuple, float] = {(): 1.0}
    for _ in range(4):
        nxt = {}
        for pre, pr in dist.items():
            row = np.array(probs(logits_at(prompt + list(pre))[None], [sps[0]]))[0]
            for t in np.nonzero(row)[0]:
                nxt[pre + (int(t),)] = pr * float(row[t])
        dist = nxt
    cells = sorted(dist)
    assert len(cells) == 16
    counts = np.zeros(len(cells) + 1, dtype=np.int64)
    for o in outs:
        t = tuple(o.token_ids)
        counts[cells.index(t) if t in dist else -1] += 1
    chi_square_check(counts, [dist[c] for c in cells] + [0.0])
