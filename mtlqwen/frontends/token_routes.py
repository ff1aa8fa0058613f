"""Routes that count or convert tokens without generating: Anthropic's /v1/messages/count_tokens and vLLM's
/tokenize and /detokenize. Each answers what the generation routes would run, through the same parsing and
prompt building.
"""

from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import api_responses as oa
from .api_fields import Detokenize, TokenizeText, validate_body
from .request_body import read_body
from .server_state import refusals, state


async def count_tokens(request: Request) -> Response:
    """Anthropic's count of a Messages request's input tokens: its prompt as the server would render it."""
    st = state(request)

    async def run() -> Response:
        raw = await read_body(request, st.cfg.max_body_bytes, st.cfg.body_timeout_s)
        req = await run_in_threadpool(st.parse, raw, "count_tokens")
        st.check_model(req.model)
        st.ready()
        prompt = await run_in_threadpool(st.prompts.prompt_ids, req)
        return JSONResponse({"input_tokens": len(prompt.ids)})

    return await refusals(st, run(), "count_tokens")


def _has_key(raw: bytes, key: str) -> bool:
    try:
        body = json.loads(raw)
    except ValueError:
        return False  # the strict validation that follows says what is wrong
    return isinstance(body, dict) and key in body


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a raw prompt's ids, or a chat's (`messages`, with `tools` and template kwargs) as the
    chat route renders them."""
    st = state(request)

    async def run() -> Response:
        raw = await read_body(request, st.cfg.max_body_bytes, st.cfg.body_timeout_s)
        chat = _has_key(raw, "messages")
        req = await run_in_threadpool(st.parse, raw, "chat") if chat else validate_body(TokenizeText, raw)
        st.check_model(req.model)
        st.ready()
        if chat:
            ids = (await run_in_threadpool(st.prompts.prompt_ids, req)).ids
        else:
            ids = await run_in_threadpool(st.loop.tokenizer.encode, req.prompt, req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": st.prompts.limit(), "tokens": ids})

    return await refusals(st, run())


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: token ids -> their text."""
    st = state(request)

    async def run() -> Response:
        req = validate_body(Detokenize, await read_body(request, st.cfg.max_body_bytes, st.cfg.body_timeout_s))
        st.check_model(req.model)
        st.ready()
        vocab = st.loop.engine.config.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise oa.APIError(f"'tokens': {bad} is outside the vocabulary [0, {vocab})", 400, "tokens")
        return JSONResponse({"prompt": st.loop.tokenizer.decode(req.tokens)})

    return await refusals(st, run())
