"""Replies in Anthropic's Messages shape: the whole message, or its stream of events (message_start, a
content block's start / deltas / stop for each thinking, text and tool_use block in turn, message_delta with
the stop reason and usage, message_stop), each sent as `event: <type>` + `data: <json>`.

The text goes through the same splitters as a chat completion's (reasoning.py, tool_calls.py), so the two
APIs read one reply alike.
"""

from __future__ import annotations

import json

from .api_responses import APIError, random_id
from .messages_api import error_body
from .reply_text import BlockEvents, ReplyText
from .tool_calls import ToolCall, ToolCallReader


def new_message_id() -> str:
    return random_id("msg_")


def _tool_use_id() -> str:
    return random_id("toolu_")


def stop_reason(output, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished engine Output."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return ("tool_use" if called else "end_turn"), None


def usage(output) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from the input tokens."""
    cached = getattr(output, "cached_tokens", 0) or 0
    return {"input_tokens": output.prompt_tokens - cached, "output_tokens": len(output.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": json.loads(call.arguments)}


def message(rid: str, model: str, output, in_reasoning: bool, tools: ToolCallReader | None) -> dict:
    """The whole reply as one Message."""
    reasoning, content, calls = ReplyText.whole(output.text, in_reasoning, tools)
    blocks: list[dict] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content or not (blocks or calls):
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(c) for c in calls]
    reason, sequence = stop_reason(output, bool(calls))
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(output)}


class MessagesFormatter(BlockEvents):
    """One request's deltas -> Messages stream events (the SSE response's formatter for /v1/messages)."""

    REASONING, TEXT = "thinking", "text"

    def __init__(self, rid: str, model: str, prompt_tokens: int, in_reasoning: bool, tools: ToolCallReader | None):
        super().__init__(in_reasoning, tools)
        self.rid, self.model, self.prompt_tokens = rid, model, prompt_tokens
        self.block: str | None = None  # the open block's type
        self.index = -1
        self.called = False

    def error(self, err: APIError) -> bytes:
        return self.encode(error_body(err))

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}}]

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, kind: str, block: dict) -> list[dict]:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _text(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        out = [] if self.block == kind else self._open(kind, {"type": kind, kind: "", "signature": ""}
                                                       if kind == "thinking" else {"type": "text", "text": ""})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _call(self, call: ToolCall) -> list[dict]:
        self.called = True
        out = self._open("tool_use", {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": {}})
        out.append({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        return out + self._close()

    def _end(self, output) -> list[dict]:
        out = self._open("text", {"type": "text", "text": ""}) if self.index < 0 else []  # no text: one empty block
        reason, sequence = stop_reason(output, self.called)
        out += self._close()
        out.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(output)})
        return out + [{"type": "message_stop"}]
