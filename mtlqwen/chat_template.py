"""Jinja chat templates, rendered the way Hugging Face transformers renders them.

Checkpoint templates are written against transformers' environment, so we mirror its observable
behaviour: sandboxed, `trim_blocks`/`lstrip_blocks`, loop controls, a `raise_exception` global, a
`strftime_now` global, a `tojson` filter that is plain `json.dumps`, and a no-op `{% generation %}` tag.
"""

from __future__ import annotations

import json
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
        messages=messages,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **context,
    )
