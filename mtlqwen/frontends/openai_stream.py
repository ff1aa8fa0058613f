"""One request's deltas as OpenAI stream chunks (chat.completion.chunk or text_completion), per choice.

A chat choice's text goes through the reasoning splitter, then (when the request's calls are read) the
tool-call splitter: each call is one chunk once its block closes. A delta's tokens' logprobs ride on its first
chunk (one with an empty delta when the delta's text is all held back). With `include_usage`, the usage of
every choice comes in one last chunk once all have finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import api_responses as oa
from .logprob_format import LogprobFormat
from .reply_text import ReplyText
from .sse import sse, usage_of
from .tool_calls import ToolCallReader, finish_reason, new_call_id


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, sent back before its completion (`echo`)."""

    text: str
    ids: list[int]


class _Choice:
    """One choice's text state."""

    def __init__(self, kind: str, in_reasoning: bool, tools: ToolCallReader | None, tokenizer):
        self.reply = ReplyText(in_reasoning, tools) if kind == "chat" else None
        self.sent_calls = 0
        self.logprobs = LogprobFormat(tokenizer) if tokenizer is not None else None
        self.output = None
        self.echoed = False


def combined_usage(outputs: list, per_prompt: int | None = None) -> dict:
    """The usage of choices grouped by prompt, per_prompt each (default: all of one prompt): each prompt counted
    once, the completions summed (OpenAI's)."""
    firsts = [usage_of(o) for o in outputs[:: per_prompt or len(outputs)]]
    return oa.usage(sum(u["prompt_tokens"] for u in firsts), sum(len(o.token_ids) for o in outputs),
                    sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts))


class Formatter:
    end = b"data: [DONE]\n\n"
    encode = staticmethod(sse)

    @staticmethod
    def error(err: oa.APIError) -> bytes:
        return sse(err.body())

    def __init__(self, kind: str, rid: str, model: str, in_reasoning: bool, include_usage: bool,
                 tools: ToolCallReader | None = None, logprob_tokenizer=None, n: int = 1,
                 echoes: list[Echo] | None = None, prompts: int = 1):
        """n choices for each of `prompts` prompts (a completion's batch), grouped by prompt. logprob_tokenizer: the
        tokenizer, when the request asked for logprobs; echoes: a completion's prompts, each sent as its choices'
        first chunk (with its logprobs, which come on the choice's first delta)."""
        self.kind, self.rid, self.model, self.include_usage, self.n = kind, rid, model, include_usage, n
        self.echoes = echoes
        self.created = int(time.time())
        self.choices = [_Choice(kind, in_reasoning, tools, logprob_tokenizer) for _ in range(n * prompts)]

    def _chunk(self, i: int, delta: dict | str, reason: str | None = None) -> dict:
        if self.kind == "completion":
            return oa.completion_chunk(self.rid, self.created, self.model, delta, reason, index=i)
        return oa.chat_chunk(self.rid, self.created, self.model, delta, reason, index=i)

    def _text(self, i: int, ch: _Choice, reasoning: str, content: str, reason: str | None, calls) -> list[dict]:
        if self.kind == "completion":
            return [self._chunk(i, content, reason)] if content or reason else []
        out = []
        if reasoning:
            out.append(self._chunk(i, {"reasoning_content": reasoning}))
        if content:
            out.append(self._chunk(i, {"content": content}))
        for call in calls:
            out.append(self._chunk(i, {"tool_calls": [call.to_openai(new_call_id(), ch.sent_calls)]}))
            ch.sent_calls += 1
        if reason:
            out.append(self._chunk(i, {}, finish_reason(reason, ch.sent_calls > 0)))
        return out

    def start(self) -> list[dict]:
        if self.kind == "chat":
            return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.choices))]
        return []

    def delta(self, i: int, d) -> list[dict]:
        """Choice i's next delta -> its chunks (and the usage chunk after the last choice's end)."""
        ch = self.choices[i]
        reason = d.finish_reason if d.finished else None
        r, c, calls = ("", d.text, []) if ch.reply is None else ch.reply.feed(d.text, d.finished)
        head = []
        if self.echoes is not None and not ch.echoed:  # first: the prompt, and its logprobs' text offsets
            ch.echoed, echo = True, self.echoes[i // self.n]
            head = [self._chunk(i, echo.text)]
            if ch.logprobs is not None:
                head[0]["choices"][0]["logprobs"] = ch.logprobs.echoed(echo.ids, d.prompt_logprobs)
        out = self._text(i, ch, r, c, reason, calls)
        if ch.logprobs is not None and d.logprobs:
            lp = ch.logprobs.chat(d.logprobs) if self.kind == "chat" else ch.logprobs.completion(d.logprobs)
            out = out or [self._chunk(i, {} if self.kind == "chat" else "")]
            out[0]["choices"][0]["logprobs"] = lp
        out = head + out
        if d.finished:
            ch.output = d.output
            outputs = [c.output for c in self.choices]
            if self.include_usage and all(o is not None for o in outputs):
                out.append(oa.usage_chunk(self.rid, self.created, self.model, self.kind,
                                          combined_usage(outputs, self.n)))
        return out
