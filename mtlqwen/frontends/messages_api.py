"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): request bodies declared as
pydantic models, checked as strictly as the OpenAI ones (api_requests.py), and turned into the same
ParsedRequest, so one prompt builder, engine loop and tool-call reader serve both.

The conversation maps onto the chat template's messages: `system` first; a user turn's `tool_result` blocks
become `tool` messages and its text a user message, in their order; an assistant turn's `thinking` becomes
its reasoning, its `text` the content and its `tool_use` blocks the calls. Tools map to OpenAI function
tools (`input_schema` is the parameters' schema); `tool_choice` any -> required, tool -> a named function;
`thinking` enabled / disabled sets the template's enable_thinking; `output_config.format` (a JSON schema) holds
the reply to it. What the server cannot honour (images, documents, server tools) is refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .api_fields import MAX_STOP, MAX_TOOLS, Positive, Probability, StopString, Temperature, ToolName, validate_body
from .api_requests import Defaults, ParsedRequest, parse_chat
from .api_responses import APIError, not_supported

ANTHROPIC_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 408: "request_too_large", 413: "request_too_large",
                        429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: APIError) -> dict:
    """An APIError in Anthropic's shape."""
    kind = ANTHROPIC_ERROR_TYPE.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return ("Error: " + text) if self.is_error else text


_READ = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


class OtherBlock(_Body):
    """A block the server does not read (image, document, search results...): refused by name."""

    type: str

    @model_validator(mode="after")
    def _refuse(self):
        if self.type in _READ:  # one of ours with a missing or mistyped field
            raise ValueError(f"a malformed '{self.type}' block")
        raise not_supported("messages", f"'{self.type:.40}' content blocks ({', '.join(_READ)} are read)")


Block = Annotated[Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock, OtherBlock],
                  Field(union_mode="left_to_right")]


class Turn(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def for_template(self) -> list[dict]:
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(b.text for b in self.content if isinstance(b, TextBlock))}
            thinking = [b.thinking for b in self.content if isinstance(b, ThinkingBlock)]
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in self.content if isinstance(b, ToolUseBlock)]
            if calls:
                msg["tool_calls"] = calls
            return [msg]
        out: list[dict] = []  # a user turn: tool results and text in their order
        for b in self.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            elif isinstance(b, TextBlock):
                if out and out[-1]["role"] == "user":
                    out[-1]["content"] += b.text
                else:
                    out.append({"role": "user", "content": b.text})
        return out


class Tool(_Body):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, bash...) have other types: refused

    @model_validator(mode="before")
    @classmethod
    def _server_tools(cls, v):
        if isinstance(v, dict) and v.get("type") not in (None, "custom"):
            raise not_supported("tools", f"server tool '{str(v.get('type')):.40}' (only client tools are read)")
        return v


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]  # the last two: the template's default
    budget_tokens: int | None = None  # not enforced: the template's thinking is on or off


class JsonSchemaOutput(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    effort: str | None = None  # a hint for Anthropic's models; nothing here to scale
    format: JsonSchemaOutput | None = None  # the reply held to the schema (runtime/structured.py)


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: Positive | None = None  # required by /v1/messages, not by count_tokens
    messages: Annotated[list[Turn], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None  # not Anthropic's: as the OpenAI routes
    output_config: OutputConfig | None = None

    def chat_body(self) -> dict:
        """The same request as an OpenAI chat body (what parse_chat validates further)."""
        messages = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": text})
        for turn in self.messages:
            messages += turn.for_template()
        body: dict[str, Any] = {"messages": messages, "stream": self.stream}
        for key in ("model", "max_tokens", "temperature", "top_p", "top_k", "seed"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description} if t.description else {})}}
                             for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name or ""}}
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"schema": self.output_config.format.schema_}}
        if self.thinking is not None and self.thinking.type in ("enabled", "disabled"):
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        return body


def parse_messages(raw: bytes, d: Defaults, template_defaults: dict, count_only: bool = False) -> ParsedRequest:
    """An Anthropic body -> the ParsedRequest an equivalent OpenAI chat body gives (kind "chat")."""
    req = validate_body(MessagesRequest, raw)
    if req.max_tokens is None and not count_only:
        raise APIError("'max_tokens' is required", 400, "max_tokens")
    no_template = lambda template: False  # noqa: E731 - a Messages request cannot name a chat template
    return parse_chat(json.dumps(req.chat_body()).encode(), d, template_defaults, no_template)
