"""Sampling parameters and the on-device sampler.

Draws are reproducible per request: the t-th generated token is argmax(scaled logits + Gumbel noise) with
the noise keyed on the host by (seed, t) alone (token_noise), so a request's samples do not depend on
what it is batched with, on chunking, on prefix hits, on being preempted and recomputed, or on speculative
decoding (rejection.py verifies drafts against the same noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx

from .logprobs import MAX_LOGPROBS, StepLogprobs, step_logprobs
from .penalties import apply_penalties, penalty_rows
from .structured import Structure, apply_masks

_MASK64 = (1 << 64) - 1
# Below this a temperature divides bf16/fp32 logits into inf/nan (1e-40 gave garbage, not greedy); vLLM
# clamps at the same value. Use 0 for greedy.
MIN_TEMPERATURE = 1e-2
# top_k is a count of vocabulary entries; the engine also checks it against its vocabulary at submit.
MAX_TOP_K = (1 << 31) - 1
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty|: OpenAI's range
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES = 100.0, 1024  # OpenAI's range of a bias; entries a request may give


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. Filters apply in the order top_k, top_p, min_p (min_p is relative to the
    most likely token, so it is unaffected by the other two). `stop` strings need a tokenizer; the
    completion text ends before the stop string. `stop_token_ids` and EOS (unless ignore_eos) end the
    completion and are kept in its token ids. Penalties (penalties.py) lower the logits of tokens already
    produced: repetition_penalty (1 = off) over prompt and reply, frequency_penalty and presence_penalty
    (0 = off) over the reply; logit_bias adds a fixed amount to given tokens' logits; a request with either
    never drafts."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    speculative: bool = True  # False: this request never drafts, even when the engine has a drafter
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # each token's log probability and this many alternatives (logprobs.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit); a dict is accepted
    cache_salt: str | None = None  # prefix-cache entries are shared only among requests with the same salt
    structured: Structure | None = None  # the reply held to a grammar (structured.py)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated (vLLM's)
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives (logprobs.py)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        self.validate()

    def validate(self) -> None:
        """ValueError naming the offending field."""
        def num(name, kinds=(int, float)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise ValueError(f"{name} must be a number, got {v!r}")
            return v

        t = num("temperature")
        if not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, inf), got {t}")
        if not 0 < num("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= num("top_k", (int,)) <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 = off), got {self.top_k}")
        if not 0 <= num("min_p") <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if num("max_tokens", (int,)) <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if any(not 0 <= t <= MAX_TOP_K for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= num(name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}] (0 = off), got {getattr(self, name)}")
        if not 0 < num("repetition_penalty") <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1 = off), "
                             f"got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= num("logprobs", (int,)) <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None (off) or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOP_K:
                raise ValueError(f"logit_bias keys must be token ids, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {b!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= 256):
            raise ValueError(f"cache_salt must be a non-empty string of at most 256 characters, got {self.cache_salt!r:.40}")
        if self.prompt_logprobs is not None and not 0 <= num("prompt_logprobs", (int,)) <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be None (off) or in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not 0 <= num("min_tokens", (int,)) <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if self.structured is not None:
            if not isinstance(self.structured, Structure):
                raise ValueError(f"structured must be a Structure, got {type(self.structured).__name__}")
            self.structured.validate()
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError for token-id fields outside a vocabulary of vocab_size entries."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be <= the vocabulary size {vocab_size} (0 = off), got {self.top_k}")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(f"logprobs must be <= the vocabulary size {vocab_size}, got {self.logprobs}")
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias: {bad[0]} is outside the vocabulary [0, {vocab_size})")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the request changes its logits before sampling: a penalty, a logit bias or min_tokens
        (penalties.py)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def drafts(self) -> bool:
        """Whether this request may draft: it asked to, no penalty makes its distribution depend on the drafts
        before each position, it wants no logprobs (a verification scores drafts, not samples), and no grammar
        masks its tokens."""
        return self.speculative and not self.penalized and self.logprobs is None and self.structured is None

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_key(seed: int, index: int) -> mx.array:
    """The PRNG key of a request's index-th generated token (host hashing: no device round trip)."""
    return mx.random.key(_splitmix64(_splitmix64(seed & _MASK64) ^ index))


def token_noise(seed: int, index: int, vocab: int) -> mx.array:
    """[V] fp32 Gumbel noise of a request's index-th generated token: sampling is argmax(scaled + this)."""
    return mx.random.gumbel(shape=(vocab,), key=token_key(seed, index))


def scaled(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """logits [R, V] (one row per params entry, all non-greedy) -> tempered, filtered logits fp32 [R, V]."""
    temps = mx.array([p.temperature for p in params], dtype=mx.float32)[:, None]
    x = logits.astype(mx.float32) / temps
    return _filter(x, params) if any(p.filtered for p in params) else x


def _filter(x: mx.array, params: list[SamplingParams]) -> mx.array:
    """x [R, V] fp32 scaled logits -> the same with filtered-out entries at -inf."""
    R, V = x.shape
    neg = mx.array(-mx.inf, dtype=x.dtype)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        srt = -mx.sort(-x, axis=-1)  # descending
        rank = mx.arange(V)[None, :]
        k = mx.array([min(p.top_k, V) if p.top_k > 0 else V for p in params])[:, None]
        srt = mx.where(rank < k, srt, neg)  # top_k, on the sorted copy
        probs = mx.softmax(srt, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each sorted entry
        top_p = mx.array([p.top_p for p in params], dtype=x.dtype)[:, None]
        # the smallest prefix whose mass reaches top_p; never empty (a top_p below fp32's range keeps the top)
        keep = ((before < top_p) | (rank == 0)) & (rank < k)
        cut = mx.min(mx.where(keep, srt, mx.inf), axis=-1, keepdims=True)  # the smallest kept logit
        x = mx.where(x < cut, neg, x)
    if any(p.min_p > 0 for p in params):
        min_p = mx.array([p.min_p for p in params], dtype=x.dtype)[:, None]
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        floor = mx.max(x, axis=-1, keepdims=True) + mx.log(mx.maximum(min_p, 1e-30))
        x = mx.where((min_p > 0) & (x < floor), neg, x)
    return x


def sample(logits: mx.array, params: list[SamplingParams], seeds: list[int], indices: list[int]) -> mx.array:
    """logits [R, V] (one row per sampling sequence) -> token ids [R] int32, lazily (no host sync).
    Row r draws with token_noise(seeds[r], indices[r])."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    rows = [r for r, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    V = logits.shape[-1]
    x = scaled(logits[mx.array(rows)], [params[r] for r in rows])
    noise = mx.stack([token_noise(seeds[r], indices[r], V) for r in rows])
    tokens[mx.array(rows)] = mx.argmax(x + noise, axis=-1).astype(mx.int32)
    return tokens


def sample_isolating(logits: mx.array, params: list[SamplingParams], seeds: list[int],
                     indices: list[int]) -> tuple[mx.array, dict[int, Exception]]:
    """sample(), and when building it raises, the rows that raise on their own: those rows get token 0 and
    their errors come back by row, the others are sampled exactly as sample() samples them (rows are
    independent). Re-raises when no row fails alone (the failure is the batch's, not a request's)."""
    try:
        return sample(logits, params, seeds, indices), {}
    except Exception:
        failed: dict[int, Exception] = {}
        for r in range(len(params)):
            try:
                sample(logits[r : r + 1], [params[r]], [seeds[r]], [indices[r]])
            except Exception as e:  # noqa: PERF203 - only on the failure path
                failed[r] = e
        if not failed:
            raise
    ok = [r for r in range(len(params)) if r not in failed]
    tokens = mx.zeros((len(params),), dtype=mx.int32)
    if ok:
        rows = mx.array(ok, dtype=mx.int32)
        tokens[rows] = sample(logits[rows], [params[r] for r in ok], [seeds[r] for r in ok], [indices[r] for r in ok])
    return tokens, failed


@dataclass
class SampledRows:
    tokens: mx.array  # [R] int32, on the device
    failed: dict[int, Exception]  # rows whose own sampling raised (sample_isolating)
    logprobs: StepLogprobs | None  # the rows that asked for them


def sample_rows(logits: mx.array, sampling, input_ids: mx.array, logits_rows: mx.array | None,
                constraints=None, eos=()) -> SampledRows:
    """A step's plain sampling rows (scheduler.ScheduledSeq, one per logits row [R, V]): penalties
    (penalties.py; eos: the engine's end ids, which min_tokens holds back), grammar masks (structured.Constraints,
    when given), the sampler, and the logprobs of what it drew (logprobs.py), all lazily."""
    params = [s.seq.params for s in sampling]
    adjusted = apply_penalties(logits, penalty_rows(sampling, input_ids, logits_rows, eos))
    if constraints is not None:
        adjusted = apply_masks(adjusted, constraints.masks(sampling))
    tokens, failed = sample_isolating(adjusted, params, [s.seq.seed for s in sampling],
                                      [s.sample_index for s in sampling])
    return SampledRows(tokens, failed, step_logprobs(logits, tokens, params))
