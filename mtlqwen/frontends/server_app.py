"""The OpenAI-compatible HTTP app (Starlette): one function per route, the API key, error handling.
(Anthropic's Messages route shares the generation path; token counting: token_routes.py.)

Every route reaches the server's state through `request.app.state.server` (server_state.py). The
event loop only moves bytes: parsing, prompt rendering and tokenisation run in worker threads, the
engine on its own thread (engine_loop.py). A request is refused with an OpenAI-style error before
it reaches the engine whenever the refusal can be decided there; each refusal is counted by status.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import api_responses as oa
from . import messages_reply, responses_reply
from .choices import Choices, choice_ids
from .engine_loop import EngineLoop
from .logprob_format import LogprobFormat
from .messages_reply import MessagesFormatter, new_message_id
from .openai_stream import Echo, Formatter, combined_usage
from .reply_text import ReplyText
from .responses_reply import ResponsesFormatter, ResponseShell, new_response_id
from .request_body import read_body
from .server_state import ServerConfig, ServerState, error_response, refusals, state
from .sse import SSEResponse, disconnected, failure, next_or_gone, usage_of
from .token_routes import count_tokens, detokenize, tokenize
from .tool_calls import ToolCallReader, new_call_id
from .tool_calls import finish_reason as tool_finish

log = logging.getLogger("mtlqwen.serve")


# ---- generation routes

async def generate(request: Request, kind: str) -> Response:
    st = state(request)
    raw = await read_body(request, st.cfg.max_body_bytes, st.cfg.body_timeout_s)
    req = await run_in_threadpool(st.parse, raw, kind)
    st.check_model(req.model)
    st.ready()
    # a completion may batch prompts; every prompt has best_of candidates, each an engine request
    subs = [replace(req, prompt=p) for p in req.prompts] if len(req.prompts) > 1 else [req]
    total = len(subs) * req.best_of
    st.check_capacity(total)  # before the work of tokenising, and again once it is done
    prompts = [await run_in_threadpool(st.prompts.prompt_ids, sub) for sub in subs]
    ids, in_reasoning, opened, _ = prompts[0]
    params = [st.prompts.sampling_params(sub, len(p.ids), p.in_reasoning, p.call_grammar) for sub, p in zip(subs, prompts)]
    st.check_capacity(total)
    rid = {"messages": new_message_id, "responses": new_response_id}.get(kind, lambda: oa.new_id(kind))()
    lp_tok = st.loop.tokenizer if params[0].logprobs is not None else None  # what the client asked to see
    ranked = req.best_of > req.n
    if ranked and params[0].logprobs is None:  # candidates are ranked by their tokens' logprobs
        params = [replace(sp, logprobs=0) for sp in params]
    rids = choice_ids(rid, total)
    choices = Choices([st.loop.submit(rids[k * req.best_of + i], p.ids, sp if i == 0 or sp.seed is None
                                      else replace(sp, seed=sp.seed + i))
                       for k, (p, sp) in enumerate(zip(prompts, params)) for i in range(req.best_of)])
    first = await choices.accepted()
    if first is not None:
        err = failure(first)
        if err.status < 500:  # the engine refused what the request asked (too long for the pool, ids...)
            err.param = err.param or ("prompt" if kind == "completion" else "messages")
        raise err
    tools = ToolCallReader.for_request(req, opened)
    name = st.cfg.model_name
    echoes = [Echo(sub.prompt if isinstance(sub.prompt, str) else st.loop.tokenizer.decode(p.ids), p.ids)
              for sub, p in zip(subs, prompts)] if req.echo else None
    shell = None
    if kind == "responses":
        src = req.source
        keep = (lambda body: st.responses.keep(body, src.conversation_items() + body["output"])) if src.store else None
        shell = ResponseShell(rid, name, src, keep)
    if req.stream:
        if kind == "messages":
            fmt = MessagesFormatter(rid, name, len(ids), in_reasoning, tools)
        elif kind == "responses":
            fmt = ResponsesFormatter(shell, in_reasoning, tools)
        else:
            fmt = Formatter(kind, rid, name, in_reasoning, req.include_usage, tools, lp_tok, req.n, echoes, len(subs))
        return SSEResponse(choices, fmt)
    per = req.best_of
    if ranked:  # each prompt's n likeliest answered, every candidate's tokens counted
        return await collect(request, choices, kind, lambda outs: reply_body(
            kind, rid, name, [o for k in range(len(subs)) for o in likeliest(outs[k * per:(k + 1) * per], req.n)],
            in_reasoning, tools, lp_tok, echoes, combined_usage(outs, per)))
    return await collect(request, choices, kind, lambda outs: reply_body(
        kind, rid, name, outs, in_reasoning, tools, lp_tok, echoes, combined_usage(outs, per) if len(subs) > 1 else None,
        shell=shell))


def likeliest(outs: list, n: int) -> list:
    """best_of: the n candidates whose tokens have the highest summed logprob (the model's own), in that order."""
    return sorted(outs, key=lambda o: -sum(lp.logprob for lp in o.logprobs if lp is not None))[:n]


def reply_body(kind: str, rid: str, name: str, outs: list, in_reasoning: bool, tools: ToolCallReader | None,
               lp_tok=None, echoes: list[Echo] | None = None, use: dict | None = None,
               shell: ResponseShell | None = None) -> dict:
    """A finished request's whole answer in its API's shape; outs: each choice's Output, prompt by prompt. lp_tok:
    the tokenizer, when the request asked for logprobs; echoes: a completion's prompts, each to come back before
    its choices; use: the usage of every candidate generated, when best_of ranked more than the answered choices
    or several prompts were batched; shell: a Responses request's echoed settings."""
    if kind == "messages":
        return messages_reply.message(rid, name, outs[0], in_reasoning, tools)
    if kind == "responses":
        return responses_reply.response(shell, outs[0], in_reasoning, tools)
    bodies = []
    for i, out in enumerate(outs):
        lpf = LogprobFormat(lp_tok) if lp_tok is not None else None
        echo = echoes[i * len(echoes) // len(outs)] if echoes else None  # the choices are grouped by prompt
        if kind == "completion":
            lp = None
            if lpf is not None:
                head = lpf.echoed(echo.ids, out.prompt_logprobs) if echo else None
                lp = lpf.completion(out.logprobs)
                lp = LogprobFormat.joined(head, lp) if head else lp
            text = (echo.text if echo else "") + out.text
            bodies.append(oa.completion(rid, name, text, out.finish_reason, usage_of(out), lp))
            continue
        reasoning, content, calls = ReplyText.whole(out.text, in_reasoning, tools)
        bodies.append(oa.chat_completion(rid, name, content, reasoning or None,
                                         tool_finish(out.finish_reason, bool(calls)), usage_of(out),
                                         [c.to_openai(new_call_id()) for c in calls],
                                         lpf.chat(out.logprobs) if lpf is not None else None))
    if len(bodies) == 1 and use is None:
        return bodies[0]
    return oa.merged(bodies, use or combined_usage(outs))


async def collect(request: Request, choices: Choices, kind: str, body_of) -> Response:
    """A non-streaming answer: every choice's deltas gathered; all cancelled if the client leaves first."""
    watcher = asyncio.ensure_future(disconnected(request.receive))
    outputs: list = [None] * len(choices.handles)
    try:
        while True:
            item = await next_or_gone(choices, watcher)
            if item is None:
                return Response(status_code=499)  # nobody will read it
            i, item = item
            err = failure(item)
            if err is not None:  # the engine failed this request while running it: not a refusal
                return error_response(err, kind)
            if item.finished:
                outputs[i] = item.output
                if choices.done:
                    return JSONResponse(body_of(outputs))
    finally:
        watcher.cancel()
        choices.cancel()


async def chat_completions(request: Request) -> Response:
    return await refusals(state(request), generate(request, "chat"))


async def completions(request: Request) -> Response:
    return await refusals(state(request), generate(request, "completion"))


async def responses(request: Request) -> Response:
    return await refusals(state(request), generate(request, "responses"))


async def stored_response(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response's body; DELETE: forget it."""
    st, rid = state(request), request.path_params["response_id"]
    if request.method == "DELETE":
        if st.responses.delete(rid):
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
    else:
        body = st.responses.body(rid)
        if body is not None:
            return JSONResponse(body)
    return error_response(oa.APIError(f"no stored response '{rid:.100}'", 404, "response_id", "not_found"), "responses")


async def messages(request: Request) -> Response:
    return await refusals(state(request), generate(request, "messages"), "messages")

# ---- information and operator routes

async def models(request: Request) -> Response:
    st = state(request)
    cards = []
    for name in st.cfg.listed_names:
        card = {"id": name, "object": "model", "created": st.cfg.started, "owned_by": "mtlqwen",
                "root": st.cfg.model_name}
        if st.loop.engine is not None:
            card["max_model_len"] = st.loop.engine.max_model_len
        cards.append(card)
    return JSONResponse({"object": "list", "data": cards})


async def health(request: Request) -> Response:
    loop = state(request).loop
    if loop.state == "ok":
        return JSONResponse({"status": "ok"})
    if loop.state == "loading":
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "error", "message": loop.error}, status_code=503)


async def metrics_endpoint(request: Request) -> Response:
    st = state(request)
    return PlainTextResponse(st.metrics.render(st.loop.stats), media_type="text/plain; version=0.0.4")


async def operator(request: Request, action) -> Response:
    """An operator endpoint: only on a server with an API key (the key middleware has checked it by the time this
    runs); action(st) -> (fn(engine) run on the engine thread, fn(its result) -> the answer's JSON)."""
    st = state(request)

    async def run() -> Response:
        if st.cfg.api_key is None:
            raise oa.APIError("operator endpoints need a server started with --api-key", 403, code="forbidden")
        on_engine, answer = action(st)
        st.ready()
        return JSONResponse(answer(await st.loop.call(on_engine)))

    return await refusals(st, run())


async def reset_prefix_cache(request: Request) -> Response:
    """Operator action: drop every prefix-cache entry."""
    def cleared(n: int) -> dict:
        log.info("prefix cache cleared: %d entries", n)
        return {"cleared_entries": n}

    return await operator(request, lambda st: (lambda engine: engine.clear_prefix_cache(), cleared))


async def save_prefix_cache(request: Request) -> Response:
    """Operator action: write the prefix cache to --prefix-cache-dir now, as a graceful stop does (a server that
    is killed later keeps what was written)."""
    def action(st):
        folder = st.cfg.prefix_cache_dir
        if folder is None:
            raise oa.APIError("this server keeps no prefix cache on disk: start it with --prefix-cache-dir", 400,
                              code="not_supported")

        def written(files: list) -> dict:
            log.info("prefix cache: %d entries written to %s", len(files), folder)
            return {"written_entries": len(files), "dir": folder}

        return (lambda engine: engine.save_prefix_cache(folder)), written

    return await operator(request, action)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics_endpoint, methods=["GET"]),
    Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    Route("/save_prefix_cache", save_prefix_cache, methods=["POST"]),
]


async def http_error(request: Request, exc: HTTPException) -> Response:
    state(request).metrics.on_rejected(exc.status_code)  # unknown paths and methods are refusals too
    return error_response(oa.APIError(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code,
                                      code="not_found" if exc.status_code == 404 else None))


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(oa.APIError(f"internal error: {type(exc).__name__}: {exc}", 500, type_="server_error"))


def build_app(loop: EngineLoop, cfg: ServerConfig) -> Starlette:
    @asynccontextmanager
    async def lifespan(app):
        loop.start()  # loads in the background: the socket is listening while the model loads
        try:
            yield
        finally:
            await run_in_threadpool(loop.stop)

    app = Starlette(routes=ROUTES, exception_handlers={HTTPException: http_error, Exception: server_error},
                    lifespan=lifespan)
    app.state.server = ServerState(loop, cfg)
    if cfg.api_key:
        app.add_middleware(APIKeyMiddleware, key=cfg.api_key, metrics=loop.metrics)
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
        e = oa.APIError("invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                        401, code="invalid_api_key")
        kind = "messages" if str(scope.get("path", "")).startswith("/v1/messages") else "chat"
        await error_response(e, kind)(scope, receive, send)
