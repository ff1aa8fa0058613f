"""Jinja chat templates, rendered the way Hugging Face transformers renders them.

Checkpoint templates are written against transformers' environment, so we mirror its observable
behaviour: sandboxed, `trim_blocks`/`lstrip_blocks`, loop controls, a `raise_exception` global, a
`strftime_now` global, a `tojson` filter that is plain `json.dumps`, and a no-op `{% generation %}` tag.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    # Templates call this to reject malformed conversations (e.g. a system message in the middle).
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes `<>&'` and sorts keys; tool schemas in prompts must not be mangled.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant spans for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template source (servers render the same template per request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# Clients send a turn's reasoning under any of these names; templates read `reasoning_content`.
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def _plain(value: Any) -> Any:
    """Rebuild template inputs from JSON types: the sandbox still lets a template call public methods of
    rich objects (arrays, images, pydantic models) that callers put in messages."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses such as enums carry extra methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if callable(getattr(value, "item", None)) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy scalars
    return f"<{type(value).__name__}>"


def normalize_messages(messages: list[Any]) -> list[dict]:
    """Plain-dict copies of `messages` without None fields (templates print or trip over `content: null`),
    with the reasoning also under `reasoning_content` and `thinking`, as transformers does."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **context: Any,
) -> str:
    """Render `messages` with the template `source`; extra keyword arguments become template variables."""
    return compile_chat_template(source).render(
        messages=normalize_messages(messages),
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(context),
    )
