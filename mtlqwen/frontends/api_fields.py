"""The parts request bodies are made of, declared as pydantic models, and the one validation step that turns a
body's bytes into a model or an APIError naming the field (api_requests.py assembles the OpenAI requests;
messages_api.py and responses_api.py the others).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..runtime.logprobs import MAX_LOGPROBS
from ..runtime.sampling import MAX_TOP_K, MIN_TEMPERATURE
from .api_responses import APIError

MAX_STOP = 16  # stop strings per request: each one is searched for in the text at every step
MAX_STOP_CHARS = 256
MAX_TOOLS = 128
MAX_CHOICES = 16  # `n`: each choice is an engine request
MAX_BATCH = 256  # a completion request's prompts x choices: each an engine request (the queue bounds them too)


def _temperature(t: float) -> float:
    if t != 0 and t < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return t


Temperature = Annotated[float, Field(ge=0), AfterValidator(_temperature)]
Probability = Annotated[float, Field(gt=0, le=1)]
Fraction = Annotated[float, Field(ge=0, le=1)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOP_K)]
Positive = Annotated[int, Field(ge=1)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictBody):
    include_usage: bool = False


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(StrictBody):
    type: Literal["text"]


class JsonObjectFormat(StrictBody):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class JsonSchemaFormat(StrictBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class TextPart(StrictBody):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text" or self.text is None:
            raise PydanticCustomError("not_supported", "only text content parts are accepted, got '{kind}'",
                                      {"kind": self.type})
        return self


class FunctionCall(StrictBody):
    """A past call in the history. OpenAI sends `arguments` as a JSON object's text; chat templates iterate
    it as a mapping (Qwen3.5 writes one line per argument), so it is parsed here."""

    name: str
    arguments: str | dict[str, Any]

    @model_validator(mode="after")
    def _parsed(self):
        if isinstance(self.arguments, str):
            try:
                value = json.loads(self.arguments) if self.arguments.strip() else {}
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise ValueError("'arguments' must be the text of a JSON object")
            self.arguments = value
        return self


class ToolCall(StrictBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # other clients' names for reasoning_content
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The plain dict a chat template reads: text parts joined, `developer` as `system`."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        reasoning = next((r for r in (self.reasoning_content, self.reasoning, self.thinking) if r is not None), None)
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]


class FunctionDef(StrictBody):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema: shown to the model, and types XML arguments
    strict: bool | None = None  # accepted for OpenAI clients that always send it; decoding is not constrained


class ToolDef(StrictBody):
    type: Literal["function"]
    function: FunctionDef


LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class TokenizeText(StrictBody):
    """vLLM's /tokenize of a raw prompt (a chat's messages go through parse_chat instead)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = False  # as the completions route encodes a prompt


class Detokenize(StrictBody):
    model: str | None = None
    tokens: list[TokenId]


# ---- bytes -> ParsedRequest

_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param(loc: tuple) -> str:
    """('messages', 0, 'content', 'list[TextPart]', 0) -> 'messages[0].content[0]' (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or "-" in part or part[:1].isupper():  # a union member's tag
            continue
        else:
            out += f".{part}" if out else part
    return out


def _api_error(e: ValidationError) -> APIError:
    errs = e.errors(include_url=False)
    first = errs[0]
    if first["type"] == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}")
    if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
        return APIError("the request body must be a JSON object")
    deepest = max(errs, key=lambda x: len(x["loc"]))
    param = _param(deepest["loc"])
    msgs = list(dict.fromkeys(x["msg"].removeprefix("Value error, ") for x in errs if _param(x["loc"]) == param))
    if deepest["type"] == "missing":
        return APIError(f"'{param}' is required", 400, param)
    got = deepest.get("input")
    shown = "" if isinstance(got, (dict, type(None))) else f", got {got!r:.60}"
    code = "not_supported" if deepest["type"] == "not_supported" else None
    return APIError(f"'{param}': {' or '.join(msgs)}{shown}", 400, param, code)


def validate_body(model: type[BaseModel], raw: bytes) -> Any:
    """A body validated strictly from its bytes; every failure an APIError naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _api_error(e) from None
    except RecursionError:  # the parser has its own depth limit; this is the backstop
        raise APIError("the request body is nested too deeply") from None
