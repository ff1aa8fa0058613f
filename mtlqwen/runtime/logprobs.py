"""Log probabilities of sampled tokens (SamplingParams.logprobs = k: the chosen token's and the k most likely).

They are the model's own distribution, log_softmax of the raw logits, before penalties, temperature and
filters (vLLM's default, "raw logprobs"): what the model thought of each token, whatever the sampler then
did. They are computed on the device beside the sampler and read back with the step's tokens. A request that
asks for them never drafts (SamplingParams.drafts): a verification scores drafts, not samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

MAX_LOGPROBS = 20  # alternatives a token may report (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability, and the `k` most likely tokens at its position (most likely
    first; they may include the token itself)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepLogprobs:
    """One step's logprob rows, still on the device: row `rows[i]` of the step's sampling rows is index i."""

    rows: list[int]
    ks: list[int]
    chosen: mx.array  # [L] fp32
    top_ids: mx.array | None  # [L, K] int32, K = max(ks); None when every k is 0
    top_lp: mx.array | None  # [L, K] fp32

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_lp) if a is not None]

    def read(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """The host copies (the step's read-back): sampling row -> its token's logprob (tokens: by row)."""
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        lps = self.top_lp.tolist() if self.top_lp is not None else None
        out = {}
        for i, (r, k) in enumerate(zip(self.rows, self.ks)):
            top = tuple(zip(ids[i][:k], lps[i][:k])) if k else ()
            out[r] = TokenLogprob(tokens[r], chosen[i], top)
        return out


def step_logprobs(logits: mx.array, tokens: mx.array, params) -> StepLogprobs | None:
    """logits [R, V] the raw rows the step sampled from, tokens [R] what it sampled, params [R] SamplingParams
    -> the rows that asked for logprobs, lazily; None when none did."""
    rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    ks = [params[r].logprobs for r in rows]
    idx = mx.array(rows, dtype=mx.int32)
    x = logits[idx].astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[idx][:, None].astype(mx.int32), axis=-1)[:, 0]
    K = max(ks)
    top_ids = top_lp = None
    if K:
        part = mx.argpartition(-lp, kth=K - 1, axis=-1)[:, :K]
        vals = mx.take_along_axis(lp, part, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        top_ids = mx.take_along_axis(part, order, axis=-1).astype(mx.int32)
        top_lp = mx.take_along_axis(vals, order, axis=-1)
    return StepLogprobs(rows, ks, chosen, top_ids, top_lp)


MAX_PROMPT_LOGPROB_TOKENS = 16384  # prompt logprobs run the prompt in one pass, outside the engine's pool
_CHUNK = 256  # rows through the LM head at a time: [rows, vocab] fp32 stays small


def prompt_logprobs(model, ids: list[int], k: int, keep_prefix: bool = False):
    """Each prompt token's log probability given the tokens before it (None for the first), with k alternatives:
    the prompt run once through the model from an empty state, in a cache of its own (the engine's pool and
    prefix cache are untouched), its LM head applied a chunk of rows at a time.

    keep_prefix: also return the state after all but the last token, as KVManager.adopt takes it (per K/V pool
    the rows of those positions, per GDN pool the state), so that the engine restores it rather than computing
    the prompt a second time. Returns (the logprobs, that state; None unasked or for a one-token prompt)."""
    from ..kernels import SeqLayout  # noqa: PLC0415

    T = len(ids)
    if T > MAX_PROMPT_LOGPROB_TOKENS:
        raise ValueError(f"prompt logprobs are computed for prompts of at most {MAX_PROMPT_LOGPROB_TOKENS} tokens, "
                         f"got {T}")
    bt = 128
    nb = -(-T // bt)
    cache = model.make_cache(num_blocks=nb, num_slots=1, block_tokens=bt)
    x, blocks = mx.array(ids, dtype=mx.int32), [list(range(nb))]
    prefix = None
    if keep_prefix and T >= 2:  # the prompt less its last token, the state there taken, then the last token
        h0 = model.hidden(x[:-1], SeqLayout([0, T - 1], [0], blocks, [0], bt), cache)
        state = [mx.take(p, mx.array([0]), axis=0)[0] for p in (*cache.conv_states, *cache.rec_states)]
        mx.eval(h0, state)  # before the last token's state writes (in place on the GPU)
        h = mx.concatenate([h0, model.hidden(x[-1:], SeqLayout([0, 1], [T - 1], blocks, [0], bt), cache)])
        rows = [pool.reshape(nb * bt, *pool.shape[2:])[: T - 1] for pool in (*cache.k_pools, *cache.v_pools)]
        prefix = (rows, state)
    else:
        h = model.hidden(x, SeqLayout([0, T], [0], blocks, [0], bt), cache)
    mx.eval(h, *(prefix[0] if prefix else ()))
    out: list[TokenLogprob | None] = [None]
    for s in range(0, T - 1, _CHUNK):
        e = min(T - 1, s + _CHUNK)
        nxt = mx.array(ids[s + 1:e + 1], dtype=mx.int32)
        step = step_logprobs(model.head(h[s:e]), nxt, [_Asks(k)] * (e - s))
        mx.eval(*step.arrays())
        read = step.read(ids[s + 1:e + 1])
        out += [read[r] for r in range(e - s)]
    return out, prefix


@dataclass(frozen=True)
class _Asks:
    """What step_logprobs reads of a row's SamplingParams."""

    logprobs: int
