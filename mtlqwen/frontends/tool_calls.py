"""Tool calls in a chat reply: the `<tool_call>...</tool_call>` blocks a model writes, as OpenAI `tool_calls`.

Qwen3.5 (like Qwen3-Coder) writes a call as XML lines,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Milan
    </parameter>
    </function>
    </tool_call>

and Qwen3 / Qwen2.5 (Hermes style) as JSON, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
Both are read. An XML parameter is text; the tool's JSON schema says whether it stands for a number, a
boolean, an object... (`convert_value`). A block that parses as neither stays in the reply's content as the
model wrote it, so nothing the model said is lost.

The splitter is incremental like reasoning.py's: text that could still open a block is held back, a block
is read once it closes, and whitespace-only text is held until text follows it (the newlines between a
reply's calls are not content). Feeding a reply in any pieces gives what feeding it whole gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .api_responses import random_id
from .reasoning import _partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_VALUE_END = re.compile(r"</parameter>|<parameter=|</function>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's `function.arguments`

    def to_openai(self, call_id: str, index: int | None = None) -> dict:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=call_id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


def new_call_id() -> str:
    return random_id("call_")


def schemas_of(tools: list[dict] | None) -> dict[str, dict]:
    """Request `tools` -> {function name: its parameters' JSON schema}."""
    out = {}
    for t in tools or []:
        fn = t.get("function") or {}
        out[fn.get("name")] = fn.get("parameters") or {}
    return out


_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", dict: "object",
              list: "array"}


def json_types(schema: Mapping) -> list[str]:
    """The JSON types a parameter's schema allows: `type`, the branches of `anyOf` / `oneOf`, an `enum`'s values."""
    t = schema.get("type")
    found = [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            if isinstance(branch, Mapping):
                found += json_types(branch)
    if not found and isinstance(schema.get("enum"), list):
        found = [_JSON_TYPE.get(type(v), "string") for v in schema["enum"]]
    return found


_CHECK = {"integer": lambda x: isinstance(x, int) and not isinstance(x, bool),
          "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          "object": lambda x: isinstance(x, dict), "array": lambda x: isinstance(x, list)}


def convert_value(text: str, schema: Mapping | None) -> Any:
    """An XML parameter's text as the value its schema asks for. The text itself when the schema allows a
    string (the model wrote text), names no type, or the text is a value of none of the types it names."""
    types = json_types(schema or {})
    if not types or "string" in types:
        return text
    s = text.strip()
    for t in types:
        if t == "null" and s == "null":
            return None
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t in _CHECK:
            try:
                v = json.loads(s)
            except ValueError:
                continue
            if _CHECK[t](v):
                return v
            if t == "integer" and isinstance(v, float) and v.is_integer():
                return int(v)
    return text


def _xml_call(body: str, schemas: Mapping[str, dict]) -> ToolCall | None:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    rest = body[m.end():]
    end = rest.find("</function>")
    if end >= 0:
        if rest[end + len("</function>"):].strip():
            return None  # text after the function: not a call this parser understands
        rest = rest[:end]
    props = (schemas.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    pos = 0
    for p in _PARAMETER.finditer(rest):
        if p.start() < pos or rest[pos:p.start()].strip():
            return None  # text between parameters
        key = p.group(1).strip()
        stop = _VALUE_END.search(rest, p.end())
        value_end = stop.start() if stop else len(rest)
        value = rest[p.end():value_end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = convert_value(value, props.get(key))
        pos = stop.end() if stop and stop.group(0) == "</parameter>" else value_end
    if rest[pos:].strip():
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_call(body: str, schemas: Mapping[str, dict] | None = None) -> ToolCall | None:
    """The text between `<tool_call>` and `</tool_call>` -> a call, or None when it is not one."""
    body = body.strip()
    if body.startswith("{"):
        return _json_call(body)
    if body.startswith("<function="):
        return _xml_call(body, schemas or {})
    return None


class ToolCallSplitter:
    """A reply's content -> (content without its calls, the calls). parallel=False keeps the first call only
    (the request's `parallel_tool_calls`); the later blocks are dropped."""

    def __init__(self, schemas: Mapping[str, dict] | None = None, parallel: bool = True):
        self.schemas, self.parallel = dict(schemas or {}), parallel
        self.buf = ""
        self.inside = False
        self.space = ""  # whitespace-only content held back until text follows it
        self.calls = 0  # calls found so far (kept or not)

    def _content(self, text: str) -> str:
        if not text:
            return ""
        if not text.strip():
            self.space += text
            return ""
        out, self.space = self.space + text, ""
        stripped = out.rstrip()  # trailing whitespace waits for what follows it
        self.space = out[len(stripped):]
        return stripped

    def _call(self, body: str) -> tuple[str, list[ToolCall]]:
        call = parse_call(body, self.schemas)
        if call is None:
            return self._content(OPEN + body + CLOSE), []
        self.calls += 1
        self.space = ""  # whitespace before a call is not content
        return "", [call] if self.parallel or self.calls == 1 else []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content -> (content that is now certain, calls completed)."""
        self.buf += text
        content, calls = "", []
        while self.buf:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buf, OPEN)
                    content += self._content(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content += self._content(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(OPEN):], True
                continue
            j = self.buf.find(CLOSE)
            if j < 0:
                break
            c, new = self._call(self.buf[:j])
            content, calls = content + c, calls + new
            self.buf, self.inside = self.buf[j + len(CLOSE):], False
        return content, calls

    def finish(self) -> str:
        """The end of the reply: an unclosed block and held text are content (held whitespace only when no
        call was made: after a call it is the gap before the end of the turn)."""
        rest = (OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        tail = self.space + rest
        self.space = ""
        if rest.strip():
            return tail
        return "" if self.calls else tail


def split_tool_calls(content: str, schemas: Mapping[str, dict] | None = None,
                     parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """A whole reply's content at once -> (content, calls)."""
    s = ToolCallSplitter(schemas, parallel)
    text, calls = s.feed(content)
    return text + s.finish(), calls


def forced_opening(name: str, xml: bool, opens_thinking: bool) -> str:
    """The text appended to a rendered prompt so that the reply is a call: `tool_choice` "required" (name "":
    the model picks the function) or a named function, opened in the form the chat template teaches (xml:
    Qwen3.5's `<function=...>`, else Hermes JSON). A prompt left inside a thinking block closes it first, as
    a template does with thinking off: the reply is the call."""
    out = "\n</think>\n\n" if opens_thinking else ""
    out += OPEN + "\n"
    if name:
        out += f"<function={name}>\n" if xml else '{"name": ' + json.dumps(name) + ', "arguments": '
    return out


@dataclass(frozen=True)
class ToolCallReader:
    """What a request asks of its reply's calls: the tools' schemas, whether several calls are kept, and the
    opening of a forced call that the prompt already holds (the reply continues it)."""

    schemas: dict
    parallel: bool = True
    opened: str = ""

    @classmethod
    def for_request(cls, req, opened: str = "") -> "ToolCallReader | None":
        """A parsed chat request -> its reader; None when its calls are not read (no tools, tool_choice none)."""
        return cls(schemas_of(req.tools), req.parallel_tool_calls, opened) if req.read_tool_calls else None

    def splitter(self) -> ToolCallSplitter:
        s = ToolCallSplitter(self.schemas, self.parallel)
        s.feed(self.opened[self.opened.find(OPEN):] if OPEN in self.opened else "")  # inside the opened block
        return s


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that ended by itself after making calls finished to let the client run them."""
    return "tool_calls" if called and reason == "stop" else reason
