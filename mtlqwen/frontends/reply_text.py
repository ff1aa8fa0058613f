"""A chat reply's text as it streams, split the way every chat API reports it: the reasoning (reasoning.py),
then the answer's content and its tool calls (tool_calls.py). One per reply; the stream formatters of the
OpenAI chat, Messages and Responses routes each hold one. `BlockEvents` is what the Messages and Responses
formatters share: a reply streamed as a sequence of blocks (reasoning, text, each call), in their events.
"""

from __future__ import annotations

import json

from .reasoning import ReasoningSplitter
from .tool_calls import ToolCall, ToolCallReader


class ReplyText:
    def __init__(self, in_reasoning: bool, tools: ToolCallReader | None):
        self.split = ReasoningSplitter(in_reasoning)
        self.calls = tools.splitter() if tools is not None else None
        self.thought = False  # reasoning text was given out
        self.newlines = ""  # the reasoning's trailing newlines, held: the whole reply's reasoning has none

    def _reasoning(self, text: str) -> str:
        """Reasoning as split_reasoning gives the whole reply's: no newlines at its start or end."""
        text = self.newlines + (text if self.thought else text.lstrip("\n"))
        kept = text.rstrip("\n")
        self.newlines, self.thought = text[len(kept):], self.thought or bool(kept)
        return kept

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """New text (the last of the reply when finished) -> (reasoning, content, calls) now certain."""
        r, c = self.split.feed(text)
        if finished:
            r2, c2 = self.split.finish()
            r, c = r + r2, c + c2
        r = self._reasoning(r)
        calls: list[ToolCall] = []
        if self.calls is not None:
            c, calls = self.calls.feed(c)
            if finished:
                c += self.calls.finish()
        return r, c, calls

    @classmethod
    def whole(cls, text: str, in_reasoning: bool, tools: ToolCallReader | None) -> tuple[str, str, list[ToolCall]]:
        """A finished reply at once: what its stream gives, joined (the non-streamed answers)."""
        return cls(in_reasoning, tools).feed(text, finished=True)


class BlockEvents:
    """A reply as blocks, in an API's stream events. Subclasses name their two text kinds (REASONING, TEXT) and
    give `_text(kind, text)` (open or extend that block), `_call(call)` (one whole call block) and `_end(output)`
    (close what is open, then the API's closing events with the finished engine Output)."""

    REASONING = TEXT = ""
    end = b""  # the API's last event ends the stream (no [DONE])

    def __init__(self, in_reasoning: bool, tools: ToolCallReader | None):
        self.reply = ReplyText(in_reasoning, tools)

    @staticmethod
    def encode(event: dict) -> bytes:
        """An event as SSE, named by its type (`event:` then `data:`), as both APIs' clients read it."""
        return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"

    def _text(self, kind: str, text: str) -> list[dict]:
        raise NotImplementedError

    def _call(self, call: ToolCall) -> list[dict]:
        raise NotImplementedError

    def _end(self, output) -> list[dict]:
        raise NotImplementedError

    def delta(self, i: int, d) -> list[dict]:
        """The reply's next delta (i: its choice, always 0: these APIs answer one)."""
        r, c, calls = self.reply.feed(d.text, d.finished)
        out = self._text(self.REASONING, r) + self._text(self.TEXT, c)
        for call in calls:
            out += self._call(call)
        return out + self._end(d.output) if d.finished else out
