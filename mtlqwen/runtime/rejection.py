"""Verification of drafted tokens (dflash.md §4): accept the drafts the target itself would produce.

Greedy (temperature 0): accept the longest prefix of drafts equal to the target's argmax, then the
target's argmax at the first mismatch (or after the last draft: the bonus) is the next token.

Sampling, by the Gumbel-max coupling: the plain sampler draws a request's j-th generated token as
argmax(x_j + G_j), where x_j are the tempered, filtered target logits (sampling.scaled) and G_j is Gumbel
noise keyed by (seed, j) alone (sampling.token_noise). A verification uses the same G_j at every position
it covers: draft j is argmax(x^q_j + G_j) over the drafter's logits (the same transform), the target's
token is y_j = argmax(x_j + G_j), and the drafts are accepted while they equal y_j; the next token is y
at the first mismatch (or the bonus after the last draft). Every emitted token is then exactly the token
the plain sampler emits at that position with that seed: the output follows the target's distribution
(it *is* the non-speculative sample), and a seeded request gives the same tokens with or without a
drafter, whatever the draft lengths, batch, chunking or prefix hits. Sharing the noise makes the draft
agree with the target as often as the coupling allows (for two candidate tokens exactly sum(min(p, q)),
the rejection-sampling rate; a little below it in general).

Shapes: S verifying sequences, N = the longest draft run; sequence s has n[s] <= N drafts. Row r of the
target logits [S, N + 1, V] scores the position after packed token r (anchor = token 0), so draft i
(0-based) is checked against row i. Slots at or past n[s] are padding and never accepted. Row t of a
sequence's noise is keyed by its own (seed, first index + t): the batch's N only adds rows nobody reads.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import SamplingParams, scaled, token_noise


def position_noise(seeds: list[int], indices: list[int], rows: int, vocab: int) -> mx.array:
    """[S, rows, V] fp32: row t of sequence s is token_noise(seeds[s], indices[s] + t), the noise the plain
    sampler uses for that generated token."""
    return mx.stack([mx.stack([token_noise(s, i + t, vocab) for t in range(rows)]) for s, i in zip(seeds, indices)])


def probs(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """logits [R, V] (one row per params entry, all non-greedy) -> tempered, filtered probabilities fp32."""
    return mx.softmax(scaled(logits, params), axis=-1)


def _perturbed_argmax(logits: mx.array, params: list[SamplingParams], noise: mx.array) -> mx.array:
    """logits [S, P, V], noise [S, >= P, V] -> argmax(scaled(logits) + noise) [S, P] int32."""
    S, P, V = logits.shape
    x = scaled(logits.reshape(S * P, V), [p for p in params for _ in range(P)]).reshape(S, P, V)
    return mx.argmax(x + noise[:, :P], axis=-1).astype(mx.int32)


def sample_drafts(q_logits: mx.array, params: list[SamplingParams], noise: mx.array) -> mx.array:
    """Draft logits [S, N, V] of non-greedy sequences, their position noise [S, N + 1, V] -> drafts [S, N] int32."""
    return _perturbed_argmax(q_logits, params, noise)


def _leading(acc: mx.array) -> mx.array:
    """acc [S, N] bool -> the number of leading True per row [S] int32."""
    return mx.sum(mx.cumprod(acc.astype(mx.int32), axis=1), axis=1)


def _match(best: mx.array, drafts: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
    """best [S, N+1] target tokens per row -> (accepted k [S], next token [S])."""
    k = _leading((drafts == best[:, :-1]) & valid)
    return k, mx.take_along_axis(best, k[:, None], axis=1)[:, 0]


def verify_greedy(target_logits: mx.array, drafts: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
    """target_logits [S, N+1, V], drafts [S, N], valid [S, N] -> (accepted k [S], next token [S])."""
    return _match(mx.argmax(target_logits, axis=-1).astype(mx.int32), drafts, valid)


def verify_sampled(target_logits: mx.array, drafts: mx.array, valid: mx.array, params: list[SamplingParams],
                   noise: mx.array) -> tuple[mx.array, mx.array]:
    """The coupled verification. target_logits [S, N+1, V], drafts [S, N], valid [S, N], noise [S, N+1, V]
    (position_noise of the sequences) -> (accepted k [S], next token [S])."""
    return _match(_perturbed_argmax(target_logits, params, noise), drafts, valid)


def verify(
    target_logits: mx.array, drafts: mx.array, n: list[int], params: list[SamplingParams], noise: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """Per sequence: greedy matching or the coupled verification by its params. noise [S_sampled, N+1, V]
    holds the position noise of the non-greedy sequences in order (None when all are greedy)."""
    S, N = drafts.shape
    valid = mx.arange(N)[None, :] < mx.array(n, dtype=mx.int32)[:, None]
    hot = [s for s, p in enumerate(params) if not p.greedy]
    if not hot:
        return verify_greedy(target_logits, drafts, valid)
    if len(hot) == S:
        return verify_sampled(target_logits, drafts, valid, params, noise)
    k, tok = verify_greedy(target_logits, drafts, valid)
    h = mx.array(hot, dtype=mx.int32)
    k_h, tok_h = verify_sampled(target_logits[h], drafts[h], valid[h], [params[s] for s in hot], noise)
    k[h], tok[h] = k_h, tok_h
    return k, tok
