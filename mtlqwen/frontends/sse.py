"""Streaming one request to its client: OpenAI chunks over text/event-stream, and the race between the
request's next delta and the client's `http.disconnect` that cancels a request whose client left (its
slot and KV blocks are free before the next engine step), even while its prompt is still prefilling.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from . import api_responses as oa
from .engine_loop import Failed

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


async def next_or_gone(handle, watcher: asyncio.Task, keepalive: float | None = None):
    """The next item of `handle` (choices.Choices: a (choice index, item) pair); KEEPALIVE when `keepalive`
    seconds pass without one; None when the client disconnected first (the request is then cancelled). A
    cancelled queue read loses no item."""
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


class SSEResponse:
    """text/event-stream of the formatter's events (OpenAI chunks: openai_stream.py, or Anthropic events:
    messages_reply.py) for a request's choices (choices.Choices); ends when every choice has or one fails, and
    cancels them all when the client disconnects."""

    def __init__(self, handle, fmt):
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
                i, item = item
                err = failure(item)
                body = self.fmt.error(err) if err is not None else b"".join(
                    self.fmt.encode(c) for c in self.fmt.delta(i, item))
                done = err is not None or self.handle.done
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
