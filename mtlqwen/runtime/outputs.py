"""What the engine hands back: finished `Output`s, streamed `Delta`s, and the per-request text state
(streaming detokenizer + stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Output:
    """A finished request. finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens),
    "error" (the request failed alone; `error` says why) or "cancelled". `text` is "" without a tokenizer.
    Times in seconds from submission."""

    request_id: Any
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    ttft: float | None = None
    total_time: float | None = None
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    stop_reason: str | int | None = None  # what stopped it, when not EOS: the stop string, or the stop token id
    logprobs: list | None = None  # logprobs.TokenLogprob per generated token, when SamplingParams.logprobs is set
    prompt_logprobs: list | None = None  # per prompt token (None first), when SamplingParams.prompt_logprobs is set

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Delta:
    """New tokens of one request since its previous delta; the last one has finished=True and `output`."""

    request_id: Any
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    output: Output | None = None
    logprobs: list | None = None  # the new tokens' logprobs.TokenLogprob, when the request asked for them
    prompt_logprobs: list | None = None  # on a request's first delta: its prompt's (SamplingParams.prompt_logprobs)


class TextState:
    """Incremental text of one completion. Stop strings are searched in the decoded text; text that
    could still be the start of a stop string is held back from deltas until it cannot."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.detok = tokenizer.detokenizer() if tokenizer is not None else None
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, token_id: int) -> bool:
        """Append a token's text; True when a stop string is now complete (the text is cut before it)."""
        if self.detok is None:
            return False
        piece = self.detok.add(token_id)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += piece
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            i, self.matched = min(hits, key=lambda h: h[0])
            self.text = self.text[:i]
            return True
        return False

    def flush(self) -> None:
        """End of a completion not cut by a stop string: release a held-back partial character."""
        if self.detok is not None:
            self.text += self.detok.finish()

    def delta(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
