"""OpenAI's Responses API (`POST /v1/responses`), stateless: request bodies declared as pydantic models and
turned into the chat request they amount to, so one prompt builder, engine loop, tool-call reader and
structured-output path serve it (replies: responses_reply.py).

The input maps onto the chat template's messages: `instructions` first, as the system message; a string input
is one user message; items in order: a `message` (developer is system), a `function_call` (the assistant's
call, consecutive calls one assistant turn), a `function_call_output` (a `tool` message), a `reasoning` item
(the next assistant turn's reasoning). Function tools map to chat tools, `tool_choice` as on the chat route,
`text.format` to `response_format`, `reasoning.effort` "none" turns the template's thinking off.
A finished response is stored (unless `store` is false; response_store.py) and `previous_response_id` continues
its conversation; `conversation` objects are refused, and items of other kinds (images, files, built-in tools) are
refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, TypeAdapter, model_validator

from .api_fields import MAX_TOOLS, Positive, Probability, Temperature, ToolName, validate_body
from .api_requests import Defaults, ParsedRequest, parse_chat
from .api_responses import APIError, not_supported


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherPart(_Body):
    type: str

    @model_validator(mode="after")
    def _refuse(self):
        raise not_supported("input", f"'{self.type:.40}' content (text is read)")


def _by_type(known: tuple[str, ...], default: str | None = None):
    """A discriminator: the value's `type` (default when absent) if known, else "other"; tags carry a hyphen so
    error locations leave them out (api_requests._param)."""
    def kind(v) -> str:
        t = v.get("type", default) if isinstance(v, dict) else getattr(v, "type", default)
        return f"is-{t}" if t in known else "is-other"
    return Discriminator(kind)


Part = Annotated[Union[Annotated[TextPart, Tag("is-input_text")], Annotated[TextPart, Tag("is-output_text")],
                       Annotated[TextPart, Tag("is-text")], Annotated[OtherPart, Tag("is-other")]],
                 _by_type(("input_text", "output_text", "text"))]


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningText(_Body):
    type: str
    text: str


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "\n".join(t.text for t in (self.content or self.summary))


class OtherItem(_Body):
    type: str

    @model_validator(mode="after")
    def _refuse(self):
        raise not_supported("input", f"'{self.type:.40}' items (messages, function calls and their outputs, "
                                     "reasoning are read)")


Item = Annotated[Union[Annotated[MessageItem, Tag("is-message")], Annotated[FunctionCallItem, Tag("is-function_call")],
                       Annotated[FunctionCallOutputItem, Tag("is-function_call_output")],
                       Annotated[ReasoningItem, Tag("is-reasoning")], Annotated[OtherItem, Tag("is-other")]],
                 _by_type(("message", "function_call", "function_call_output", "reasoning"), default="message")]


class FunctionTool(_Body):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _builtin(cls, v):
        if isinstance(v, dict) and v.get("type") != "function":
            raise not_supported("tools", f"built-in tool '{str(v.get('type')):.40}' (function tools are read)")
        return v


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class Reasoning(_Body):
    effort: str | None = None  # "none" turns thinking off; any other effort leaves it on
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stream: bool = False
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None  # not OpenAI's: as the chat route
    previous_response_id: str | None = None
    store: bool = True
    conversation: Any = None
    _prior: list = PrivateAttr(default_factory=list)  # the stored conversation previous_response_id continues

    @model_validator(mode="after")
    def _no_conversation(self):
        if self.conversation is not None:
            raise not_supported("conversation", "send previous_response_id or the whole input")
        return self

    def input_items(self) -> list[dict]:
        """The request's input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [it.model_dump(by_alias=True, exclude_none=True) for it in self.input]

    def conversation_items(self) -> list[dict]:
        """What a response to this request continues: the previous response's conversation, then this input."""
        return [it.model_dump(by_alias=True, exclude_none=True) for it in self._prior] + self.input_items()

    def messages(self) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        items = [*self._prior, *items]
        thought = None  # a reasoning item's text, for the assistant turn that follows it
        for it in items:
            if isinstance(it, ReasoningItem):
                thought = it.text()
            elif isinstance(it, MessageItem):
                role = "system" if it.role == "developer" else it.role
                msg: dict[str, Any] = {"role": role, "content": _text(it.content)}
                if role == "assistant" and thought is not None:
                    msg["reasoning_content"], thought = thought, None
                out.append(msg)
            elif isinstance(it, FunctionCallItem):
                call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and thought is None:
                    last.setdefault("tool_calls", []).append(call)  # the calls of one turn, with its text
                else:
                    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                    if thought is not None:
                        msg["reasoning_content"], thought = thought, None
                    out.append(msg)
            else:
                out.append({"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output)})
        return out

    def chat_body(self) -> dict:
        """The same request as an OpenAI chat body (what parse_chat validates further)."""
        body: dict[str, Any] = {"messages": self.messages(), "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        for key in ("model", "temperature", "top_p", "seed"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in self.tools]
        if self.tool_choice is not None:
            c = self.tool_choice
            body["tool_choice"] = c if isinstance(c, str) else {"type": "function", "function": {"name": c.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_ or {}}}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.reasoning.effort != "none"}
        return body


_ITEMS = TypeAdapter(list[Item])


def parse_responses(raw: bytes, d: Defaults, template_defaults: dict,
                    conversation_of=None) -> tuple[ParsedRequest, ResponsesRequest]:
    """A Responses body -> (the ParsedRequest its chat body gives, the body itself: the reply echoes parts).
    conversation_of(response id): a stored response's conversation items, or None (response_store.py)."""
    req = validate_body(ResponsesRequest, raw)
    if req.previous_response_id is not None:
        prior = conversation_of(req.previous_response_id) if conversation_of is not None else None
        if prior is None:
            raise APIError(f"no stored response '{req.previous_response_id:.100}' (it was not stored, was deleted, "
                           "or was dropped for newer ones)", 404, "previous_response_id", "previous_response_not_found")
        req._prior = _ITEMS.validate_python(prior)
    no_template = lambda template: False  # noqa: E731 - a Responses request cannot name a chat template
    return parse_chat(json.dumps(req.chat_body()).encode(), d, template_defaults, no_template), req
