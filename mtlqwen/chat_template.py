"""Jinja chat templates, rendered the way Hugging Face transformers renders them.

Checkpoint templates are written against transformers' environment, so we mirror its observable
behaviour: sandboxed, `trim_blocks`/`lstrip_blocks`, loop controls, a `raise_exception` global, a
`strftime_now` global, a `tojson` filter that is plain `json.dumps`, and a no-op `{% generation %}` tag.

Rendering can be bounded (`render_time_limit`): a template is code, and one sent by a client (or a
conversation that makes a slow template loop) must not hold a server thread without end. Repetition
operators that build a huge value in one C call (`'x' * 10**10`, `9 ** 9 ** 9`) are refused outright.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from contextlib import contextmanager
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


# One repetition (`s * n`, `'%9999s' % x`) builds at most this many items: real templates stay far below.
MAX_REPEAT_ITEMS = 1 << 20
MAX_POWER_EXPONENT = 256
_FORMAT_WIDTH = re.compile(r"%[#0\- +]*(\*|\d*)(?:\.(\*|\d*))?")


class TemplateTimeout(jinja2.exceptions.TemplateError):
    """Rendering ran past its time limit."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with the operators that can build an unbounded value in a single step checked."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator: str, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT_ITEMS:
                    raise jinja2.exceptions.SecurityError(f"template repetition of {len(seq) * n} items refused")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(right) > MAX_POWER_EXPONENT:
                raise jinja2.exceptions.SecurityError(f"template power with exponent {right} refused")
        elif operator == "%" and isinstance(left, str):
            for width, precision in _FORMAT_WIDTH.findall(left):
                if "*" in (width, precision) or int(width or 0) > MAX_REPEAT_ITEMS or int(precision or 0) > MAX_REPEAT_ITEMS:
                    raise jinja2.exceptions.SecurityError("template %-format width refused")
        return super().call_binop(context, operator, left, right)


@contextmanager
def render_time_limit(seconds: float | None):
    """Within the block, Python code of compiled templates on this thread raises TemplateTimeout once
    `seconds` have passed (None: no limit). A line tracer checks the clock; it is installed only for
    this thread and only while the block runs, and it traces template frames alone (cheap elsewhere)."""
    if seconds is None:
        yield
        return
    deadline = time.monotonic() + seconds

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template took longer than {seconds:g} s to render")
        return check if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        yield
    finally:
        sys.settrace(previous)


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template source (servers render the same template per request)."""
    env = _BoundedSandbox(
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
