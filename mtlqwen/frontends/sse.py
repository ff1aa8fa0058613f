"""Streaming one request to its client: OpenAI chunks over text/event-stream, and the race between the
request's next delta and the client's `http.disconnect` that cancels a request whose client left (its
slot and KV blocks are free before the next engine step), even while its prompt is still prefilling.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from . import api_responses as oa
from .engine_loop import Failed, RequestHandle
from .logprob_format import LogprobFormat
from .reasoning import ReasoningSplitter
from .tool_calls import ToolCallReader, finish_reason, new_call_id

KEEPALIVE = object()
KEEPALIVE_S = 15.0  # an SSE comment this often while nothing is produced (long prefills), so proxies keep the stream


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def disconnected(receive) -> None:
    """Returns when the client has gone (the request body was already read)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def next_or_gone(handle: RequestHandle, watcher: asyncio.Task, keepalive: float | None = None):
    """The handle's next item; KEEPALIVE when `keepalive` seconds pass without one; None when the client
    disconnected first (the request is then cancelled). A cancelled queue read loses no item."""
    get = asyncio.ensure_future(handle.next())
    done, _ = await asyncio.wait({get, watcher}, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    if watcher in done:
        handle.cancel()
        return None
    return KEEPALIVE


def usage_of(output) -> dict:
    return oa.usage(output.prompt_tokens, len(output.token_ids), getattr(output, "cached_tokens", 0) or 0)


def failure(item) -> oa.APIError | None:
    """The error a queue item stands for: the engine refused or lost the request, or failed it alone
    (an error inside a step: a 500 carrying the engine's reason)."""
    if isinstance(item, Failed):
        return oa.APIError(item.message, item.status, type_="server_error" if item.status >= 500 else "invalid_request_error")
    if item.finished and item.finish_reason == "error":
        return oa.APIError(item.error or "generation failed", 500, code="engine_error", type_="server_error")
    return None


class Formatter:
    """Turns one request's deltas into OpenAI chunks (chat or completion). A chat reply's text goes through
    the reasoning splitter, then (when the request's calls are read) the tool-call splitter: each call is
    one chunk once its block closes."""

    end = b"data: [DONE]\n\n"
    encode = staticmethod(sse)

    @staticmethod
    def error(err: oa.APIError) -> bytes:
        return sse(err.body())

    def __init__(self, kind: str, rid: str, model: str, in_reasoning: bool, include_usage: bool,
                 tools: ToolCallReader | None = None, logprobs: LogprobFormat | None = None):
        """logprobs: set when the request asked for them; each delta's tokens' logprobs ride on its first
        chunk (a chunk with an empty delta when the delta's text is all held back)."""
        self.kind, self.rid, self.model, self.include_usage = kind, rid, model, include_usage
        self.created = int(time.time())
        self.split = ReasoningSplitter(in_reasoning) if kind == "chat" else None
        self.calls = tools.splitter() if tools is not None and kind == "chat" else None
        self.sent_calls = 0
        self.logprobs = logprobs

    def _with_logprobs(self, out: list[dict], d) -> list[dict]:
        if self.logprobs is None or not d.logprobs:
            return out
        lp = self.logprobs.chat(d.logprobs) if self.kind == "chat" else self.logprobs.completion(d.logprobs)
        if not out:
            out = [oa.chat_chunk(self.rid, self.created, self.model, {}) if self.kind == "chat"
                   else oa.completion_chunk(self.rid, self.created, self.model, "")]
        out[0]["choices"][0]["logprobs"] = lp
        return out

    def _chunk(self, reasoning: str, content: str, reason: str | None = None, calls=()) -> list[dict]:
        if self.kind == "completion":
            return [oa.completion_chunk(self.rid, self.created, self.model, content, reason)] if content or reason else []
        out = []
        if reasoning:
            out.append(oa.chat_chunk(self.rid, self.created, self.model, {"reasoning_content": reasoning}))
        if content:
            out.append(oa.chat_chunk(self.rid, self.created, self.model, {"content": content}))
        for call in calls:
            delta = {"tool_calls": [call.to_openai(new_call_id(), self.sent_calls)]}
            out.append(oa.chat_chunk(self.rid, self.created, self.model, delta))
            self.sent_calls += 1
        if reason:
            reason = finish_reason(reason, self.sent_calls > 0)
            out.append(oa.chat_chunk(self.rid, self.created, self.model, {}, reason))
        return out

    def start(self) -> list[dict]:
        if self.kind == "chat":
            return [oa.chat_chunk(self.rid, self.created, self.model, {"role": "assistant", "content": ""})]
        return []

    def delta(self, d) -> list[dict]:
        if self.split is None:
            out = self._chunk("", d.text, d.finish_reason if d.finished else None)
        else:
            r, c = self.split.feed(d.text)
            if d.finished:
                r2, c2 = self.split.finish()
                r, c = r + r2, c + c2
            calls = []
            if self.calls is not None:
                c, calls = self.calls.feed(c)
                if d.finished:
                    c += self.calls.finish()
            out = self._chunk(r, c, d.finish_reason if d.finished else None, calls)
        out = self._with_logprobs(out, d)
        if d.finished and self.include_usage and d.output is not None:
            out.append(oa.usage_chunk(self.rid, self.created, self.model, self.kind, usage_of(d.output)))
        return out


class SSEResponse:
    """text/event-stream of the formatter's events (OpenAI chunks, or Anthropic events: messages_reply.py);
    cancels the request when the client disconnects."""

    def __init__(self, handle: RequestHandle, fmt):
        self.handle, self.fmt = handle, fmt

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        watcher = asyncio.ensure_future(disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for c in self.fmt.start():
                await send({"type": "http.response.body", "body": self.fmt.encode(c), "more_body": True})
            while True:
                item = await next_or_gone(self.handle, watcher, KEEPALIVE_S)
                if item is None:
                    return  # client gone: nothing more can be sent
                if item is KEEPALIVE:
                    await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
                    continue
                err = failure(item)
                body = self.fmt.error(err) if err is not None else b"".join(self.fmt.encode(c) for c in self.fmt.delta(item))
                done = err is not None or item.finished
                if done:
                    body += self.fmt.end
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": not done})
                if done:
                    return
        except OSError:  # the socket broke while sending
            self.handle.cancel()
        finally:
            watcher.cancel()
            self.handle.cancel()  # no-op when the request already finished
