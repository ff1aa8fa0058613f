"""Replies in the Responses API's shape: the whole `response` object, or its stream of events (response.created,
response.in_progress, then for each output item in turn, a reasoning item, a message, function calls, its
added / delta / done events, and response.completed or response.incomplete), each `event: <type>` + `data:`
with a sequence number. The text goes through the chat route's splitters (reasoning.py, tool_calls.py).
"""

from __future__ import annotations

import time

from .api_responses import APIError, random_id
from .reply_text import BlockEvents, ReplyText
from .tool_calls import ToolCall, ToolCallReader, new_call_id


def new_response_id() -> str:
    return random_id("resp_")


def _item_id(prefix: str) -> str:
    return random_id(prefix + "_")


def usage(output) -> dict:
    cached = getattr(output, "cached_tokens", 0) or 0
    n = len(output.token_ids)
    return {"input_tokens": output.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": output.prompt_tokens + n}


def _reasoning_item(iid: str, text: str) -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": iid, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _call_item(iid: str, call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": iid, "call_id": new_call_id(), "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


class ResponseShell:
    """What every response object of one request carries: its id, model and the request's echoed settings."""

    def __init__(self, rid: str, model: str, req, on_final=None):
        """on_final(body): called with the finished response's body (response_store keeps it)."""
        self.rid, self.model, self.created, self.on_final = rid, model, int(time.time()), on_final
        self.echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                     "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
                     "top_p": req.top_p,
                     "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                                     else req.tool_choice.model_dump()) or "auto",
                     "tools": [t.model_dump(exclude_none=True) for t in req.tools or []]}

    def body(self, output_items: list, status: str, output=None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.rid, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "incomplete_details": incomplete, "error": None, "output": output_items,
                "usage": usage(output) if output is not None else None, **self.echo}
        if output is not None and self.on_final is not None:
            self.on_final(body)
        return body


def _status(output) -> str:
    return "incomplete" if output.finish_reason == "length" else "completed"


def response(shell: ResponseShell, output, in_reasoning: bool, tools: ToolCallReader | None) -> dict:
    """The whole reply as one response object."""
    reasoning, content, calls = ReplyText.whole(output.text, in_reasoning, tools)
    items = [_reasoning_item(_item_id("rs"), reasoning)] if reasoning else []
    if content or not calls:
        items.append(_message_item(_item_id("msg"), content))
    items += [_call_item(_item_id("fc"), c) for c in calls]
    return shell.body(items, _status(output), output)


class ResponsesFormatter(BlockEvents):
    """One request's deltas -> Responses stream events (the SSE response's formatter for /v1/responses);
    response.completed or response.incomplete ends the stream."""

    REASONING, TEXT = "reasoning", "message"

    def __init__(self, shell: ResponseShell, in_reasoning: bool, tools: ToolCallReader | None):
        super().__init__(in_reasoning, tools)
        self.shell = shell
        self.seq = 0
        self.items: list[dict] = []  # finished output items
        self.open: tuple[str, str, str] | None = None  # (kind, item id, text so far) of the item being streamed

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def error(self, err: APIError) -> bytes:
        return self.encode(self._event("error", message=err.message, code=err.code, param=err.param))

    def start(self) -> list[dict]:
        body = self.shell.body([], "in_progress")
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        kind, iid, text = self.open
        self.open, idx = None, len(self.items)
        if kind == "reasoning":
            item = _reasoning_item(iid, text)
            part = {"type": "reasoning_text", "text": text}
            out = [self._event("response.reasoning_text.done", item_id=iid, output_index=idx, content_index=0,
                               text=text),
                   self._event("response.content_part.done", item_id=iid, output_index=idx, content_index=0, part=part)]
        else:
            item = _message_item(iid, text)
            part = item["content"][0]
            out = [self._event("response.output_text.done", item_id=iid, output_index=idx, content_index=0, text=text,
                               logprobs=[]),
                   self._event("response.content_part.done", item_id=iid, output_index=idx, content_index=0, part=part)]
        self.items.append(item)
        return out + [self._event("response.output_item.done", output_index=idx, item=item)]

    def _text(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        out = []
        if self.open is None or self.open[0] != kind:
            out += self._close()
            iid, idx = _item_id("rs" if kind == "reasoning" else "msg"), len(self.items)
            item = ({"type": "reasoning", "id": iid, "summary": [], "content": [], "status": "in_progress"}
                    if kind == "reasoning" else _message_item(iid, "", "in_progress"))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": []}
            out += [self._event("response.output_item.added", output_index=idx, item=item),
                    self._event("response.content_part.added", item_id=iid, output_index=idx, content_index=0,
                                part=part)]
            self.open = (kind, iid, "")
        k, iid, so_far = self.open
        self.open = (k, iid, so_far + text)
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(name, item_id=iid, output_index=len(self.items), content_index=0, delta=text,
                                  **extra)]

    def _call(self, call: ToolCall) -> list[dict]:
        out = self._close()
        iid, idx = _item_id("fc"), len(self.items)
        item = _call_item(iid, call)
        out += [self._event("response.output_item.added", output_index=idx, item={**item, "arguments": "",
                                                                                   "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=iid, output_index=idx,
                            delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=iid, output_index=idx,
                            arguments=call.arguments),
                self._event("response.output_item.done", output_index=idx, item=item)]
        self.items.append(item)
        return out

    def _end(self, output) -> list[dict]:
        out = self._close()
        if not any(it["type"] in ("message", "function_call") for it in self.items):  # an (empty) answer, as
            out += self._empty_message() + self._close()                           # `response` gives one
        status = _status(output)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.shell.body(self.items, status, output))]

    def _empty_message(self) -> list[dict]:
        iid, idx = _item_id("msg"), len(self.items)
        self.open = ("message", iid, "")
        return [self._event("response.output_item.added", output_index=idx, item=_message_item(iid, "", "in_progress")),
                self._event("response.content_part.added", item_id=iid, output_index=idx, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]
