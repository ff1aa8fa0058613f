"""OpenAI request parsing and response bodies for /v1/chat/completions and /v1/completions.

Requests are checked by hand so every rejection is an OpenAI-style error naming the field, and a
field the engine cannot honour (tools, logprobs, n > 1, logit_bias, penalties...) is refused with a
400 instead of being silently ignored. Harmless fields (user, metadata, store...) are ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_supported(param: str, why: str = "") -> APIError:
    return APIError(f"'{param}' is not supported by this server{': ' + why if why else ''}", 400, param, "not_supported")


@dataclass
class Defaults:
    """Server-wide sampling defaults (the serve command's --temp, --top-p, ... flags)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    seed: int | None = None


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]  # SamplingParams fields; max_tokens None = the default, clamped to the context
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


# Fields whose non-default value we cannot honour -> 400 (value -> True when it must be refused).
_REFUSED = {
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "tool_choice": lambda v: v not in ("none", "auto"),
    "function_call": lambda v: v not in ("none", "auto"),
    "logprobs": lambda v: bool(v),
    "top_logprobs": lambda v: bool(v),
    "logit_bias": lambda v: bool(v),
    "n": lambda v: v != 1,
    "best_of": lambda v: v != 1,
    "presence_penalty": lambda v: v != 0,
    "frequency_penalty": lambda v: v != 0,
    "repetition_penalty": lambda v: v != 1,
    "response_format": lambda v: not (isinstance(v, dict) and v.get("type") == "text"),
    "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v),
    "audio": lambda v: True,
    "min_tokens": lambda v: v != 0,
    "guided_json": lambda v: True,
    "guided_regex": lambda v: True,
    "guided_choice": lambda v: True,
    "guided_grammar": lambda v: True,
}
_WHY = {"n": "one choice per request (send n separate requests)", "best_of": "one choice per request"}


def _refuse_unsupported(body: dict) -> None:
    for key, refused in _REFUSED.items():
        v = body.get(key)
        if v is not None and refused(v):
            raise not_supported(key, _WHY.get(key, ""))


def _number(body: dict, key: str, default, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise APIError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", 400, key)
    return v


def _sampling(body: dict, d: Defaults) -> dict[str, Any]:
    max_tokens = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise APIError(f"'{key}' must be an integer >= 1, got {max_tokens!r}", 400, key)
    top_k = _number(body, "top_k", d.top_k, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(s for s in stop if s)
    else:
        raise APIError(f"'stop' must be a string or a list of strings, got {stop!r:.80}", 400, "stop")
    stop_ids = body.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError("'stop_token_ids' must be a list of integers", 400, "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError("'ignore_eos' must be a boolean", 400, "ignore_eos")
    return dict(
        temperature=_number(body, "temperature", d.temperature),
        top_p=_number(body, "top_p", d.top_p),
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        min_p=_number(body, "min_p", d.min_p),
        max_tokens=max_tokens,
        seed=_number(body, "seed", d.seed, integer=True),
        stop=stop,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
    )


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError("'stream' must be a boolean", 400, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError("'stream_options' must be an object", 400, "stream_options")
    return stream, bool(opts.get("include_usage", False)) and stream


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _message(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise APIError(f"messages[{i}] must be an object", 400, f"messages[{i}]")
    role = m.get("role")
    if role not in _ROLES:
        raise APIError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}", 400, f"messages[{i}].role")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise not_supported(f"messages[{i}].content[{j}]", f"only text content parts are accepted, got {kind!r}")
            parts.append(part["text"])
        content = "".join(parts)
    elif content is not None and not isinstance(content, str):
        raise APIError(f"messages[{i}].content must be a string or a list of text parts", 400, f"messages[{i}].content")
    out = {k: v for k, v in m.items() if k not in ("content", "name")}
    out["role"] = "system" if role == "developer" else role  # OpenAI's newer name for system
    out["content"] = content
    return out


def parse_chat(body: Any, d: Defaults, template_defaults: dict) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list", 400, "messages")
    _refuse_unsupported(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError("'chat_template_kwargs' must be an object", 400, "chat_template_kwargs")
    stream, usage = _stream_flags(body)
    return ParsedRequest("chat", stream, usage, _sampling(body, d), messages=[_message(i, m) for i, m in enumerate(msgs)],
                         template_kwargs={**template_defaults, **kwargs})


def parse_completion(body: Any, d: Defaults) -> ParsedRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise not_supported("prompt", "one prompt per request (send a batch as separate requests)")
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise APIError("'prompt' must be a non-empty string or a list of token ids", 400, "prompt")
    _refuse_unsupported(body)
    stream, usage = _stream_flags(body)
    return ParsedRequest("completion", stream, usage, _sampling(body, d), prompt=prompt)


# ---- responses

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else ("stop" if reason else None)


def _envelope(rid: str, obj: str, created: int, model: str, choices: list, use: dict | None = None) -> dict:
    """The fields every OpenAI response and stream chunk carries; `usage` only when given."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def _choice(reason: str | None, **fields) -> dict:
    return {"index": 0, **fields, "logprobs": None, "finish_reason": finish_reason(reason)}


def chat_completion(rid: str, model: str, content: str, reasoning: str | None, reason: str, use: dict) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return _envelope(rid, "chat.completion", int(time.time()), model, [_choice(reason, message=msg)], use)


def chat_chunk(rid: str, created: int, model: str, delta: dict, reason: str | None = None) -> dict:
    return _envelope(rid, "chat.completion.chunk", created, model, [_choice(reason, delta=delta)])


def completion(rid: str, model: str, text: str, reason: str, use: dict) -> dict:
    return _envelope(rid, "text_completion", int(time.time()), model, [_choice(reason, text=text)], use)


def completion_chunk(rid: str, created: int, model: str, text: str, reason: str | None = None) -> dict:
    return _envelope(rid, "text_completion", created, model, [_choice(reason, text=text)])


def usage_chunk(rid: str, created: int, model: str, kind: str, use: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return _envelope(rid, obj, created, model, [], use)
