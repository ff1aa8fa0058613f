"""A chat reply's text as it streams, split the way every chat API reports it: the reasoning (reasoning.py),
then the answer's content and its tool calls (tool_calls.py). One per reply; the stream formatters of the
OpenAI chat, Messages and Responses routes each hold one.
"""

from __future__ import annotations

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
