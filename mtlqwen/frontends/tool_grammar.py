"""The grammar of a forced tool call's rest (`tool_choice` "required" or a named function), so that the reply is a
call tool_calls.py reads, with arguments its tool's JSON schema allows (vLLM holds forced calls to the schema too).

The prompt already holds the call's opening (tool_calls.forced_opening); the grammar (llguidance's Lark,
runtime/structured.py) covers what follows it: the rest of that call, then, with parallel_tool_calls, any number
of further calls to any of the tools, each `\\n<tool_call>\\n...</tool_call>`; then the reply ends (EOS).

Qwen3.5's XML form: each parameter `<parameter=NAME>\\nVALUE\\n</parameter>\\n`, the schema's properties in their
order, the required ones present, the others optional. A value whose schema allows a string is text that holds
none of the markers the reader stops at (`</parameter>`, `<parameter=`, `</function>`), or one of its `enum`'s
strings; any other value is JSON of its schema (`%json`), which the reader decodes (tool_calls.convert_value). The
Hermes JSON form: the arguments object as JSON of the tool's schema.
"""

from __future__ import annotations

import json
from typing import Mapping

from .tool_calls import CLOSE, OPEN, json_types

_TEXT = r"/(?s:.*)/ & ~/(?s:.*)(<\/parameter>|<parameter=|<\/function>)(?s:.*)/"
_END_VALUE = "\n</parameter>\n"
_END_CALL = f"</function>\n{CLOSE}"


def _lit(s: str) -> str:
    """A Lark string literal of s."""
    return json.dumps(s, ensure_ascii=False)


def _json(schema: Mapping) -> str:
    return "%json " + json.dumps(schema, ensure_ascii=False)


class _Rules:
    def __init__(self):
        self.lines: list[str] = []
        self.n = 0

    def add(self, body: str, attrs: str = "") -> str:
        self.n += 1
        name = f"r{self.n}"
        self.lines.append(f"{name}{attrs}: {body}")
        return name


def _xml_value(rules: _Rules, schema: Mapping) -> str:
    """A rule for a parameter's value and the value's closing line."""
    types = json_types(schema)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return rules.add("(" + " | ".join(_lit(v) for v in enum) + f") {_lit(_END_VALUE)}")
    if not types or "string" in types:  # the reader keeps such a value as the text written
        return rules.add(_TEXT, f'[suffix={_lit(_END_VALUE)}]')
    if types == ["boolean"]:  # the template writes Python's True / False; the reader takes either case
        return rules.add(f'("true" | "false" | "True" | "False") {_lit(_END_VALUE)}')
    return rules.add(f"{_json(schema)} {_lit(_END_VALUE)}")


def _xml_call(rules: _Rules, schema: Mapping) -> str:
    """A rule for a call's parameters and closing (after its `<function=NAME>\\n`)."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for name, sub in props.items():
        value = _xml_value(rules, sub if isinstance(sub, Mapping) else {})
        param = rules.add(f"{_lit(f'<parameter={name}>' + chr(10))} {value}")
        parts.append(param if name in required else f"{param}?")
    return rules.add(" ".join(parts + [_lit(_END_CALL)]))


def _arguments_schema(schema: Mapping) -> dict:
    return dict(schema) if schema else {"type": "object"}


def call_grammar(schemas: Mapping[str, dict], name: str, xml: bool, parallel: bool) -> str:
    """The Lark grammar of a reply that continues a forced call's opening: name "" ("required": the opening ends
    at `<tool_call>\\n`, any tool may follow) or the named tool (the opening holds its name). schemas: the request's
    tools' parameter schemas (tool_calls.schemas_of)."""
    rules = _Rules()
    if xml:
        bodies = {n: _xml_call(rules, s or {}) for n, s in schemas.items()}
        any_call = rules.add(" | ".join(f"{_lit(f'<function={n}>' + chr(10))} {b}" for n, b in bodies.items()))
        first = bodies[name] if name else any_call
    else:
        def whole(n: str, s: Mapping) -> dict:
            return {"type": "object", "properties": {"name": {"const": n}, "arguments": _arguments_schema(s)},
                    "required": ["name", "arguments"], "additionalProperties": False}

        any_call = rules.add(_json({"anyOf": [whole(n, s) for n, s in schemas.items()]}) + f" {_lit(chr(10) + CLOSE)}")
        # a named call's opening ends after `"arguments": `: its arguments, the object's closing brace, the block's
        first = rules.add(f"{_json(_arguments_schema(schemas[name]))} {_lit('}' + chr(10) + CLOSE)}") if name else any_call
    more = f" ({_lit(chr(10) + OPEN + chr(10))} {any_call})*" if parallel else ""
    return "\n".join([f"start: {first}{more}", *rules.lines]) + "\n"
