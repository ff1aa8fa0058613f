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
        """The host copies (the step's read-back): sampling row -> its token's logprob."""
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
