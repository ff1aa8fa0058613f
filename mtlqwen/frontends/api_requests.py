"""OpenAI request bodies for /v1/chat/completions and /v1/completions, declared as pydantic models (their
parts: api_fields.py).

A body is validated straight from its bytes by pydantic's JSON parser, strictly: malformed JSON,
nesting past the parser's depth limit, lone surrogates, NaN / Infinity and a wrong type anywhere are
each a 400 naming the field. Sampling ranges are SamplingParams' own (its constants, not restated
numbers). A field the engine cannot honour (suffix, audio...) is refused rather than
silently ignored; harmless unknown fields (user, metadata, store...) are ignored and never reach the
chat template. `tools` go to the chat template, and the reply's calls are read back (tool_calls.py)
unless `tool_choice` is "none"; "required" or a named function opens the call in the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

from pydantic import Field, field_validator, model_validator

from ..runtime.sampling import MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_K
from ..runtime.structured import Structure
from .api_fields import (MAX_BATCH, MAX_CHOICES, MAX_STOP, MAX_TOOLS, Fraction, JsonObjectFormat, JsonSchemaFormat, LogprobCount,
                         Message, NamedToolChoice, Positive, Probability, StopString, StreamOptions, StrictBody,
                         Temperature, TextFormat, TokenId, ToolDef, validate_body)
from .api_responses import APIError, not_supported

# Template variables a request may not set: the renderer's own arguments.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "add_generation_prompt", "tokenize", "tools", "documents",
                                    "continue_final_message", "return_dict"})


@dataclass
class Defaults:
    """Server-wide sampling defaults (the serve command's --temp, --top-p, ... flags)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str | None
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]  # SamplingParams fields; max_tokens None = the server default
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    prompts: list = field(default_factory=list)  # completions: every prompt of the request (prompt: the first)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] | None = None  # for the chat template
    read_tool_calls: bool = False  # tools were given and tool_choice is not "none"
    parallel_tool_calls: bool = True
    forced_call: str | None = None  # tool_choice "required" -> "" (any tool), a named function -> its name
    n: int = 1  # choices
    best_of: int = 1  # candidates generated, of which the n likeliest are answered (>= n)
    structure: tuple[str, str] | None = None  # the reply's form: (format, text), runtime/structured.py
    echo: bool = False  # completions: the prompt comes back before the completion
    source: Any = None  # the API's own request, for replies that echo its settings (Responses)






# Fields whose non-default value the engine cannot honour -> 400 (value -> True when it must be refused).
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "functions": bool, "function_call": lambda v: v not in ("none", "auto"),
    "suffix": bool,
    "audio": lambda v: True,
}
_WHY = {"functions": "send them as 'tools'", "function_call": "send 'tools' and 'tool_choice'"}


class _Request(StrictBody):
    """What both endpoints share: the model name, sampling, stopping, streaming, refused features."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] | None = None  # vLLM spells "off" as -1
    min_p: Fraction | None = None
    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 64)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool = False
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # chat: ChatRequest checks it
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    presence_penalty: float | None = None  # the ranges: SamplingParams'
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices of one prompt (choices.py)
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM's: no EOS or stop token id before this many tokens
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's: prefix-cache isolation
    # the reply's form (runtime/structured.py): OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # declared so their types are checked; any value but the default is refused below
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None  # candidates; the n likeliest are answered
    suffix: str | None = None
    audio: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for key, refused in _REFUSED.items():
            v = getattr(self, key)
            if v is not None and refused(v):
                raise not_supported(key, _WHY.get(key, ""))  # not a ValueError: it leaves pydantic as is
        return self

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None:
            if self.best_of < self.n:
                raise APIError(f"'best_of' ({self.best_of}) must be at least 'n' ({self.n})", 400, "best_of")
            if self.best_of > self.n and self.stream:
                raise APIError("'best_of' above 'n' cannot stream: the replies are ranked once all are done", 400,
                               "best_of")
        return self

    def sampling(self, d: Defaults) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        top_k = d.top_k if self.top_k is None else self.top_k
        pick = lambda v, default: default if v is None else v  # noqa: E731
        return dict(
            temperature=pick(self.temperature, d.temperature), top_p=pick(self.top_p, d.top_p),
            top_k=0 if top_k == -1 else top_k, min_p=pick(self.min_p, d.min_p),
            max_tokens=self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            seed=pick(self.seed, d.seed), stop=tuple(s for s in stop if s),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            presence_penalty=pick(self.presence_penalty, d.presence_penalty),
            frequency_penalty=pick(self.frequency_penalty, d.frequency_penalty),
            repetition_penalty=pick(self.repetition_penalty, d.repetition_penalty),
            logprobs=self.logprob_count(), logit_bias=self.token_bias(), cache_salt=self.cache_salt,
            min_tokens=self.min_tokens,
        )

    def structure_fields(self) -> list[tuple[str, Any]]:
        """(name, value) of each field given that constrains the reply's form."""
        return [(name, v) for name, v in (("response_format", self.response_format), ("guided_json", self.guided_json),
                                          ("guided_regex", self.guided_regex), ("guided_choice", self.guided_choice),
                                          ("guided_grammar", self.guided_grammar))
                if v is not None and not isinstance(v, TextFormat)]

    def structure(self) -> tuple[str, str] | None:
        """(format, text) of the reply's form (structured.Structure without `after`); None: free text."""
        given = self.structure_fields()
        if not given:
            return None
        if len(given) > 1:
            raise APIError(f"one of response_format and the guided_* fields, got {' and '.join(n for n, _ in given)}",
                           400, given[1][0])
        name, v = given[0]
        if isinstance(v, JsonObjectFormat):
            out = ("json_schema", '{"type": "object"}')
        elif isinstance(v, JsonSchemaFormat):
            out = ("json_schema", json.dumps(v.json_schema.schema_))
        elif name == "guided_json":
            out = ("json_schema", v if isinstance(v, str) else json.dumps(v))
        elif name == "guided_choice":
            out = ("choice", json.dumps(v))
        else:
            out = ("regex" if name == "guided_regex" else "lark", v)
        try:  # the text's own errors (a bad schema or regex) before anything is queued
            Structure(*out).grammar()
        except ValueError as e:
            raise APIError(str(e), 400, name) from None
        return out

    def token_bias(self) -> dict[int, float]:
        """OpenAI's logit_bias (token ids as strings) as SamplingParams takes it."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise APIError(f"'logit_bias' keys are token ids, got {key!r:.40}", 400, "logit_bias")
            out[int(key)] = bias
        return out

    def logprob_count(self) -> int | None:
        """Alternatives each token reports (SamplingParams.logprobs); None: no logprobs."""
        return None

    def stream_flags(self) -> tuple[bool, bool]:
        stream = bool(self.stream)
        return stream, stream and self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    parallel_tool_calls: bool = True

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools):
        names = [t.function.name for t in tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tool names must be unique")
        return tools

    @model_validator(mode="after")
    def _choice_among_tools(self):
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return self
        if not self.tools:
            raise APIError("'tool_choice' asks for a call but the request has no 'tools'", 400, "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise APIError(f"'tool_choice' names '{choice.function.name:.100}', which is not one of the 'tools'", 400,
                           "tool_choice.function.name")
        fields = self.structure_fields()
        if fields:  # the forced call's arguments open the reply, where the grammar would hold it to the format
            raise APIError(f"'tool_choice' forces a tool call and '{fields[0][0]}' a form for the whole reply: "
                           "send one of them", 400, fields[0][0])
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", 400, "top_logprobs")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def forced_call(self) -> str | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class CompletionRequest(_Request):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: LogprobCount | None = None  # the legacy API's: alternatives a token reports
    echo: bool = False  # the prompt before the completion, in `text` and (with logprobs) in `logprobs`

    def sampling(self, d: Defaults) -> dict[str, Any]:
        s = super().sampling(d)
        if self.echo and self.logprobs is not None:  # the prompt's own logprobs (lm-eval's loglikelihood asks)
            s["prompt_logprobs"] = self.logprobs
        return s

    def logprob_count(self) -> int | None:
        return self.logprobs
    tools: list[Any] | None = None  # declared to be refused: a raw prompt has no template to show them

    @model_validator(mode="after")
    def _no_tools(self):
        if self.tools:
            raise not_supported("tools", "tools are read on /v1/chat/completions")
        if self.tool_choice not in (None, "none", "auto"):
            raise not_supported("tool_choice", "tools are read on /v1/chat/completions")
        return self


def parse_chat(raw: bytes, d: Defaults, template_defaults: dict, allowed_templates: Callable[[str], bool]) -> ParsedRequest:
    """allowed_templates(name_or_source): whether a request's `chat_template` may be used."""
    req = validate_body(ChatRequest, raw)
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_ARGS:
            raise APIError(f"chat_template_kwargs.{key} cannot be set by a request", 400, f"chat_template_kwargs.{key}")
    template = kwargs.get("chat_template")
    if template is not None and (not isinstance(template, str) or not allowed_templates(template)):
        raise APIError("a request-supplied chat template is refused: this server uses the checkpoint's templates "
                       "(start it with --trust-request-chat-template to allow them)", 400,
                       "chat_template_kwargs.chat_template", "not_supported")
    stream, usage = req.stream_flags()
    tools = req.template_tools()
    return ParsedRequest("chat", req.model, stream, usage, req.sampling(d),
                         messages=[m.for_template() for m in req.messages],
                         template_kwargs={**template_defaults, **kwargs}, tools=tools,
                         read_tool_calls=tools is not None and req.tool_choice != "none",
                         parallel_tool_calls=req.parallel_tool_calls, forced_call=req.forced_call(), n=req.n,
                         structure=req.structure(), best_of=req.best_of or req.n)


def parse_completion(raw: bytes, d: Defaults) -> ParsedRequest:
    req = validate_body(CompletionRequest, raw)
    prompt = req.prompt
    batch = list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if not all(batch):
        raise APIError("'prompt' must be a non-empty string or a list of token ids, or a list of those", 400, "prompt")
    best_of = req.best_of or req.n
    if len(batch) * best_of > MAX_BATCH:
        raise APIError(f"{len(batch)} prompts x {best_of} choices is {len(batch) * best_of} replies; at most "
                       f"{MAX_BATCH} a request (send the rest in another)", 400, "prompt")
    stream, usage = req.stream_flags()
    return ParsedRequest("completion", req.model, stream, usage, req.sampling(d), prompt=batch[0], prompts=batch,
                         n=req.n, structure=req.structure(), echo=req.echo, best_of=best_of)
