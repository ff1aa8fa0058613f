"""The OpenAI-compatible HTTP app (Starlette): routes, API key, SSE streaming, disconnect handling.

Every request runs on the shared EngineLoop. A streaming response races the request's next delta
against the client's `http.disconnect`, so a client that goes away is cancelled at once (its slot
and KV blocks are free before the next engine step) even while its prompt is still prefilling.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import openai_schema as oa
from .engine_loop import Accepted, EngineLoop, Failed, RequestHandle
from .prompting import render
from .reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning

log = logging.getLogger("mtlqwen.serve")

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop")


@dataclass
class ServerConfig:
    model_name: str
    slots: int
    max_queue: int = 64
    api_key: str | None = None
    defaults: oa.Defaults = field(default_factory=oa.Defaults)
    template_defaults: dict = field(default_factory=dict)
    started: int = field(default_factory=lambda: int(time.time()))


def error_response(e: oa.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the request body was already read)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


KEEPALIVE = object()
KEEPALIVE_S = 15.0  # an SSE comment this often while nothing is produced (long prefills), so proxies keep the stream


async def _next_or_gone(handle: RequestHandle, watcher: asyncio.Task, keepalive: float | None = None):
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


class _Formatter:
    """Turns one request's deltas into OpenAI chunks (chat or completion)."""

    def __init__(self, kind: str, rid: str, model: str, in_reasoning: bool, include_usage: bool):
        self.kind, self.rid, self.model, self.include_usage = kind, rid, model, include_usage
        self.created = int(time.time())
        self.split = ReasoningSplitter(in_reasoning) if kind == "chat" else None

    def _chunk(self, reasoning: str, content: str, reason: str | None = None) -> list[dict]:
        if self.kind == "completion":
            return [oa.completion_chunk(self.rid, self.created, self.model, content, reason)] if content or reason else []
        out = []
        if reasoning:
            out.append(oa.chat_chunk(self.rid, self.created, self.model, {"reasoning_content": reasoning}))
        if content:
            out.append(oa.chat_chunk(self.rid, self.created, self.model, {"content": content}))
        if reason:
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
            out = self._chunk(r, c, d.finish_reason if d.finished else None)
        if d.finished and self.include_usage and d.output is not None:
            out.append(oa.usage_chunk(self.rid, self.created, self.model, self.kind, _usage(d.output)))
        return out


def _usage(output) -> dict:
    return oa.usage(output.prompt_tokens, len(output.token_ids), getattr(output, "cached_tokens", 0) or 0)


class SSEResponse:
    """text/event-stream of OpenAI chunks; cancels the request when the client disconnects."""

    def __init__(self, handle: RequestHandle, fmt: _Formatter):
        self.handle, self.fmt = handle, fmt

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for c in self.fmt.start():
                await send({"type": "http.response.body", "body": _sse(c), "more_body": True})
            while True:
                item = await _next_or_gone(self.handle, watcher, KEEPALIVE_S)
                if item is None:
                    return  # client gone: nothing more can be sent
                if item is KEEPALIVE:
                    await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
                    continue
                if isinstance(item, Failed):
                    body = _sse(oa.APIError(item.message, item.status, type_="server_error").body())
                elif item.finished and item.finish_reason == "error":  # the request failed alone
                    body = _sse(oa.APIError(item.error or "generation failed", 500, type_="server_error").body())
                else:
                    body = b"".join(_sse(c) for c in self.fmt.delta(item))
                done = isinstance(item, Failed) or item.finished
                if done:
                    body += b"data: [DONE]\n\n"
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": not done})
                if done:
                    return
        except OSError:  # the socket broke while sending
            self.handle.cancel()
        finally:
            watcher.cancel()
            self.handle.cancel()  # no-op when the request already finished


def build_app(loop: EngineLoop, cfg: ServerConfig) -> Starlette:
    metrics = loop.metrics

    async def parse_body(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise oa.APIError(f"the request body is not valid JSON: {e}") from None

    def ready() -> None:
        if loop.state == "loading":
            raise oa.APIError("the model is still loading; retry when GET /health answers ok", 503,
                              code="model_loading", type_="server_error")
        if loop.state != "ok":
            raise oa.APIError(f"the engine is not running: {loop.error}", 503, type_="server_error")

    def sampling_params(req: oa.ParsedRequest, prompt_len: int):
        from ..runtime import SamplingParams  # noqa: PLC0415

        s = dict(req.sampling)
        if s["max_tokens"] is None:  # unset: the server default, but never past the context
            room = loop.engine.max_model_len - prompt_len
            s["max_tokens"] = max(1, min(cfg.defaults.max_tokens, room))
        try:
            return SamplingParams(**s)
        except ValueError as e:
            word = str(e).split(" ", 1)[0]
            raise oa.APIError(str(e), 400, word if word in _SAMPLING_FIELDS else None) from None

    def prompt_ids(req: oa.ParsedRequest) -> tuple[list[int], bool]:
        """(token ids, whether the prompt leaves the model inside a thinking block); runs in a thread."""
        tok = loop.tokenizer
        if req.kind == "completion":
            return (tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)), False
        try:
            text = render(tok, req.messages, add_generation_prompt=True, **req.template_kwargs)
        except Exception as e:  # the template rejected the conversation (jinja raise_exception, bad types)
            raise oa.APIError(f"the chat template rejected the messages: {e}", 400, "messages") from None
        return tok.encode(text), prompt_opens_thinking(text)

    async def run(request: Request, kind: str) -> Response:
        body = await parse_body(request)
        if kind == "chat":
            req = oa.parse_chat(body, cfg.defaults, cfg.template_defaults)
        else:
            req = oa.parse_completion(body, cfg.defaults)
        ready()
        ids, in_reasoning = await run_in_threadpool(prompt_ids, req)
        params = sampling_params(req, len(ids))
        if loop.live >= cfg.slots + cfg.max_queue:  # bounded queue: refuse rather than grow
            raise oa.APIError(f"the server is at capacity ({cfg.slots} running, {cfg.max_queue} waiting); retry later",
                              429, code="queue_full", type_="rate_limit_error")
        rid = oa.new_id(kind)
        handle = loop.submit(rid, ids, params)
        first = await handle.next()
        if isinstance(first, Failed):
            raise oa.APIError(first.message, first.status, "messages" if kind == "chat" else "prompt")
        assert isinstance(first, Accepted)
        fmt = _Formatter(kind, rid, cfg.model_name, in_reasoning, req.include_usage)
        if req.stream:
            return SSEResponse(handle, fmt)
        return await collect(request, handle, kind, rid, in_reasoning)

    async def collect(request: Request, handle: RequestHandle, kind: str, rid: str, in_reasoning: bool) -> Response:
        watcher = asyncio.ensure_future(_disconnected(request.receive))
        try:
            while True:
                item = await _next_or_gone(handle, watcher)
                if item is None:
                    return Response(status_code=499)  # nobody will read it
                if isinstance(item, Failed):
                    raise oa.APIError(item.message, item.status, type_="server_error")
                if not item.finished:
                    continue
                out = item.output
                if item.finish_reason == "error":
                    raise oa.APIError(item.error or "generation failed", 500, type_="server_error")
                if kind == "chat":
                    reasoning, content = split_reasoning(out.text, in_reasoning)
                    body = oa.chat_completion(rid, cfg.model_name, content, reasoning or None, out.finish_reason, _usage(out))
                else:
                    body = oa.completion(rid, cfg.model_name, out.text, out.finish_reason, _usage(out))
                return JSONResponse(body)
        finally:
            watcher.cancel()
            handle.cancel()

    async def chat_completions(request: Request) -> Response:
        return await guarded(run(request, "chat"))

    async def completions(request: Request) -> Response:
        return await guarded(run(request, "completion"))

    async def guarded(coro) -> Response:
        try:
            return await coro
        except oa.APIError as e:
            metrics.on_rejected(e.status)
            return error_response(e)

    async def models(request: Request) -> Response:
        card = {"id": cfg.model_name, "object": "model", "created": cfg.started, "owned_by": "mtlqwen"}
        if loop.engine is not None:
            card["max_model_len"] = loop.engine.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        if loop.state == "ok":
            return JSONResponse({"status": "ok"})
        if loop.state == "loading":
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "error", "message": loop.error}, status_code=503)

    async def metrics_endpoint(request: Request) -> Response:
        return PlainTextResponse(metrics.render(loop.stats), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(oa.APIError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code,
                                          code="not_found" if exc.status_code == 404 else None))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(oa.APIError(f"internal error: {type(exc).__name__}: {exc}", 500, type_="server_error"))

    @asynccontextmanager
    async def lifespan(app):
        loop.start()  # loads in the background: the socket is listening while the model loads
        try:
            yield
        finally:
            await run_in_threadpool(loop.stop)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    if cfg.api_key:
        app.add_middleware(APIKeyMiddleware, key=cfg.api_key, metrics=metrics)
    return app


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` (or `x-api-key`) on every path except /health."""

    def __init__(self, app, key: str, metrics):
        self.app, self.key, self.metrics = app, key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        self.metrics.on_rejected(401)
        e = oa.APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                        code="invalid_api_key")
        await error_response(e)(scope, receive, send)
