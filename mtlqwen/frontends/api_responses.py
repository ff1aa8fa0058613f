"""OpenAI error and response bodies for /v1/chat/completions and /v1/completions (chunks included).

Requests are declared in api_requests.py; every refusal, there or in the routes, is an APIError.
"""

from __future__ import annotations

import time
import uuid
from typing import Any


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`, with extra HTTP headers
    (Retry-After on a 429)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_supported(param: str, why: str = "") -> APIError:
    return APIError(f"'{param}' is not supported by this server{': ' + why if why else ''}", 400, param, "not_supported")


# ---- responses

def random_id(prefix: str) -> str:
    """An id no other request or item gets: the API's prefix and 24 random hex digits."""
    return prefix + uuid.uuid4().hex[:24]


def new_id(kind: str) -> str:
    return random_id("chatcmpl-" if kind == "chat" else "cmpl-")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length", "tool_calls") else ("stop" if reason else None)


def _envelope(rid: str, obj: str, created: int, model: str, choices: list, use: dict | None = None) -> dict:
    """The fields every OpenAI response and stream chunk carries; `usage` only when given."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def _choice(reason: str | None, logprobs: dict | None = None, index: int = 0, **fields) -> dict:
    return {"index": index, **fields, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def chat_completion(rid: str, model: str, content: str, reasoning: str | None, reason: str, use: dict,
                    tool_calls: list[dict] | None = None, logprobs: dict | None = None) -> dict:
    """tool_calls: the reply's calls as OpenAI objects; with them an empty content is null, as OpenAI sends it."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or None if tool_calls else content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return _envelope(rid, "chat.completion", int(time.time()), model, [_choice(reason, logprobs, message=msg)], use)


def chat_chunk(rid: str, created: int, model: str, delta: dict, reason: str | None = None,
               logprobs: dict | None = None, index: int = 0) -> dict:
    return _envelope(rid, "chat.completion.chunk", created, model, [_choice(reason, logprobs, index, delta=delta)])


def completion(rid: str, model: str, text: str, reason: str, use: dict, logprobs: dict | None = None) -> dict:
    return _envelope(rid, "text_completion", int(time.time()), model, [_choice(reason, logprobs, text=text)], use)


def completion_chunk(rid: str, created: int, model: str, text: str, reason: str | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    return _envelope(rid, "text_completion", created, model, [_choice(reason, logprobs, index, text=text)])


def merged(bodies: list[dict], use: dict) -> dict:
    """n one-choice bodies of one request -> one body whose choices are theirs, indexed in order."""
    out = dict(bodies[0])
    out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    out["usage"] = use
    return out


def usage_chunk(rid: str, created: int, model: str, kind: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return _envelope(rid, obj, created, model, [], use)
