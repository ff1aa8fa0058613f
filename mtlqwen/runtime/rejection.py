"""Verification of drafted tokens (dflash.md §4): greedy matching and rejection sampling.

Greedy (temperature 0): accept the longest prefix of drafts equal to the target's argmax, then the
target's argmax at the first mismatch (or after the last draft: the bonus) is the next token.

Sampling: drafts are drawn from the drafter's distribution q (same temperature / top-k / top-p / min-p
as the request, through sampling.py's filter, so p and q are transformed alike); draft i is accepted
with probability min(1, p(d_i) / q(d_i)); at the first rejection the token is drawn from
normalize(max(0, p - q)), and after all drafts the bonus is drawn from p. The output then follows the
target's distribution exactly (the standard speculative-sampling argument; q may be any distribution
fixed before d_i is drawn, so DFlash's one-pass block drafts qualify).

Shapes: S verifying sequences, N = the longest draft run; sequence s has n[s] <= N drafts. Row r of the
target logits [S, N + 1, V] scores the position after packed token r (anchor = token 0), so draft i
(0-based) is checked against row i. Slots at or past n[s] are padding: never accepted, and their q is 0,
which makes the "residual" at row n[s] plain p, i.e. the bonus.

Randomness is reproducible per request: each sequence's draws come from token_key(seed, index) of the
first token the step produces (split three ways: drafts, acceptance, residual), independent of batching.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import SamplingParams, _filter, token_key


def step_keys(seeds: list[int], indices: list[int]) -> list[mx.array]:
    """Per sequence [3, 2] keys: drafting, acceptance, residual/bonus draws of one speculative step."""
    return [mx.random.split(token_key(s, i), 3) for s, i in zip(seeds, indices)]


def probs(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """logits [R, V] (one row per params entry, all non-greedy) -> tempered, filtered probabilities fp32."""
    temps = mx.array([p.temperature for p in params], dtype=mx.float32)[:, None]
    x = logits.astype(mx.float32) / temps
    if any(p.filtered for p in params):
        x = _filter(x, params)
    return mx.softmax(x, axis=-1)


def _gumbel(keys: list[mx.array], which: int, shape: tuple[int, ...]) -> mx.array:
    """[S, *shape] Gumbel noise, row s drawn with keys[s][which]."""
    return mx.stack([mx.random.gumbel(shape=shape, key=k[which]) for k in keys])


def _draw(p: mx.array, noise: mx.array) -> mx.array:
    """Categorical draws from probabilities p [..., V] with Gumbel noise of the same shape (zeros never win)."""
    return mx.argmax(mx.where(p > 0, mx.log(mx.maximum(p, 1e-38)) + noise, -mx.inf), axis=-1).astype(mx.int32)


def sample_drafts(q_logits: mx.array, params: list[SamplingParams], keys: list[mx.array]) -> tuple[mx.array, mx.array]:
    """Draft logits [S, N, V] of non-greedy sequences -> (drafts [S, N] int32, q [S, N, V] fp32)."""
    S, N, V = q_logits.shape
    q = probs(q_logits.reshape(S * N, V), [p for p in params for _ in range(N)]).reshape(S, N, V)
    return _draw(q, _gumbel(keys, 0, (N, V))), q


def _leading(acc: mx.array) -> mx.array:
    """acc [S, N] bool -> the number of leading True per row [S] int32."""
    return mx.sum(mx.cumprod(acc.astype(mx.int32), axis=1), axis=1)


def verify_greedy(target_logits: mx.array, drafts: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
    """target_logits [S, N+1, V], drafts [S, N], valid [S, N] -> (accepted k [S], next token [S])."""
    best = mx.argmax(target_logits, axis=-1).astype(mx.int32)  # [S, N+1]
    k = _leading((drafts == best[:, :-1]) & valid)
    return k, mx.take_along_axis(best, k[:, None], axis=1)[:, 0]


def verify_sampled(
    target_logits: mx.array, drafts: mx.array, q: mx.array, valid: mx.array,
    params: list[SamplingParams], keys: list[mx.array],
) -> tuple[mx.array, mx.array]:
    """Rejection sampling. target_logits [S, N+1, V], drafts [S, N], q [S, N, V] (the distributions the
    drafts were drawn from), valid [S, N] -> (accepted k [S], next token [S])."""
    S, N1, V = target_logits.shape
    N = N1 - 1
    p = probs(target_logits.reshape(S * N1, V), [x for x in params for _ in range(N1)]).reshape(S, N1, V)
    idx = drafts[..., None]
    p_d = mx.take_along_axis(p[:, :N], idx, axis=2)[..., 0]
    q_d = mx.take_along_axis(q, idx, axis=2)[..., 0]
    u = mx.stack([mx.random.uniform(shape=(N,), key=k[1]) for k in keys])  # [S, N] in [0, 1)
    k = _leading((u * q_d < p_d) & valid)  # accept with probability min(1, p/q)
    # the distribution of the token after the k accepted drafts: residual at a rejection, p after all
    q_ext = mx.concatenate([q * valid[..., None], mx.zeros((S, 1, V), dtype=q.dtype)], axis=1)
    at = k[:, None, None]
    p_k = mx.take_along_axis(p, at, axis=1)[:, 0]
    res = mx.maximum(p_k - mx.take_along_axis(q_ext, at, axis=1)[:, 0], 0)
    # p == q exactly leaves no residual mass; then rejection has probability 0, so any choice is unreachable
    res = mx.where(mx.sum(res, axis=-1, keepdims=True) > 0, res, p_k)
    return k, _draw(res, _gumbel(keys, 2, (V,)))


def verify(
    target_logits: mx.array, drafts: mx.array, n: list[int], params: list[SamplingParams],
    q: mx.array | None, keys: list[mx.array] | None,
) -> tuple[mx.array, mx.array]:
    """Per sequence: greedy matching or rejection sampling by its params. q [S_sampled, N, V] holds the
    draft distributions of the non-greedy sequences in order (None when all are greedy); keys likewise."""
    S, N = drafts.shape
    valid = mx.arange(N)[None, :] < mx.array(n, dtype=mx.int32)[:, None]
    hot = [s for s, p in enumerate(params) if not p.greedy]
    if not hot:
        return verify_greedy(target_logits, drafts, valid)
    if len(hot) == S:
        return verify_sampled(target_logits, drafts, q, valid, params, keys)
    k, tok = verify_greedy(target_logits, drafts, valid)
    h = mx.array(hot, dtype=mx.int32)
    k_h, tok_h = verify_sampled(target_logits[h], drafts[h], q, valid[h], [params[s] for s in hot], keys)
    k[h], tok[h] = k_h, tok_h
    return k, tok
