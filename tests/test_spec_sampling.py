"""Speculative decoding with temperature > 0: rejection sampling keeps the target's distribution, alone
(one verification, many draws) and through the engine (many seeds, the joint law of a short completion)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dflash_checkpoints import write_tiny_drafter
from hf_checkpoints import random_token_ids
from mtlqwen.model.dflash import load_drafter
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.rejection import probs, step_keys, verify_sampled


@pytest.fixture(scope="module")
def drafter(ckpt, model, tmp_path_factory):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("drafter"), ckpt), model)


def test_rejection_sampling_keeps_the_target_distribution():
    """One verification, context-free target rows p_0..p_3 and draft rows q_1..q_3: the first emitted
    token follows p_0, the second (when the first draft was accepted) p_1, and drafts are accepted at
    the rate sum(min(p, q))."""
    S, N, V = 2000, 3, 6
    rng = np.random.default_rng(0)
    p_logits = mx.array(rng.normal(size=(N + 1, V)) * 1.5, dtype=mx.float32)
    q = mx.array(rng.dirichlet(np.ones(V), size=N), dtype=mx.float32)
    params = [SamplingParams(temperature=1.0)] * S
    keys = step_keys(list(range(S)), [0] * S)
    drafts = mx.stack([mx.random.categorical(mx.log(q), key=k[0]) for k in keys]).astype(mx.int32)
    k, tok = verify_sampled(mx.broadcast_to(p_logits, (S, N + 1, V)), drafts, mx.broadcast_to(q, (S, N, V)),
                            mx.ones((S, N), dtype=mx.bool_), params, keys)
    k, tok, d = np.array(k), np.array(tok), np.array(drafts)
    p = np.array(probs(p_logits, [params[0]] * (N + 1)))
    first = np.where(k >= 1, d[:, 0], tok)
    second = np.where(k >= 2, d[:, 1], tok)[k >= 1]
    chi_square_check(np.bincount(first, minlength=V), p[0])
    chi_square_check(np.bincount(second, minlength=V), p[1])
    rate = np.minimum(p[0], np.array(q[0])).sum()
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
