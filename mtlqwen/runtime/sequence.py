"""A request and the sequence state the runtime keeps for it while it waits or occupies a slot."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # in the FIFO queue: new, or preempted for recompute
    RUNNING = "running"  # holds a slot (and blocks)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`tokens` is the request: prompt then the sampled tokens read back so far. `pending` counts tokens
    sampled by steps still in flight (the host has not read them yet); they come after `tokens`.
    `kv_valid` counts tokens whose K/V and GDN state are computed or being computed by a launched step;
    in decode kv_valid == num_tokens - 1 and the last token is the anchor. kv_valid, block_table and
    restore are written only by kv_manager.KVManager."""

    request_id: Any
    tokens: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn at submit so recompute after preemption redraws the same
    prompt_len: int = 0
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    kv_valid: int = 0
    pending: int = 0
    fresh: bool = False  # admitted since the last step: its slot's GDN state must be zeroed first
    spec_drafts: int = 0  # drafts this decoding sequence sends next step (set by the engine's Speculator)
    # a pipelined verification launched after the last step read back computes this slot's GDN state past
    # kv_valid (spec_pipeline.py): a finish then keeps no turn entry of it
    state_ahead: bool = False
    draft_estimate: Any = None  # draft_policy.AcceptanceEstimate: its running acceptance (the adaptive policy's)
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    text: Any = None  # outputs.TextState, when the engine has a tokenizer
    prefix_keys: list[int] = field(default_factory=list)  # chained prefix-cache keys of whole intervals, memoised
    restore: Any = None  # prefix_cache.PrefixEntry to load into the slot before the first chunk (a hit)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache at the latest admission
    _prompt_vocab: tuple[int, ...] | None = field(default=None, repr=False)  # prompt_vocab()'s memo
    logprobs: list = field(default_factory=list)  # logprobs.TokenLogprob per generated token (params.logprobs set)
    prompt_logprobs: list | None = None  # per prompt token, computed at submit (params.prompt_logprobs set)
    delivered: bool = False  # a delta was sent (the first one carries prompt_logprobs)

    def __post_init__(self):
        if not self.prompt_len:
            self.prompt_len = len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self.pending

    @property
    def num_generated(self) -> int:
        """Sampled tokens, including those still in flight."""
        return self.num_tokens - self.prompt_len

    @property
    def need(self) -> int:
        """Tokens not yet computed: the rest of the prompt in prefill, 1 (the anchor) in decode."""
        return self.num_tokens - self.kv_valid

    @property
    def sampling_done(self) -> bool:
        """max_tokens reached counting in-flight tokens: nothing more to schedule, only to read back."""
        return self.num_generated >= self.params.max_tokens

    @property
    def active(self) -> bool:
        """Occupies a slot."""
        return self.status is SeqStatus.RUNNING

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def prompt_vocab(self) -> tuple[int, ...]:
        """The distinct prompt tokens (what a repetition penalty marks besides the reply); computed once."""
        if self._prompt_vocab is None:
            self._prompt_vocab = tuple(sorted(set(self.tokens[: self.prompt_len])))
        return self._prompt_vocab
