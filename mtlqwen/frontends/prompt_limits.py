"""A parsed request -> prompt token ids and SamplingParams, within the server's limits.

Runs in worker threads (never on the event loop). The order is the cheap checks first: a prompt
whose byte count alone proves it cannot fit the context is refused before it is tokenised; chat
templates render under a time limit; what the messages say is tokenised as text (special-token
strings in them stay characters) unless the server was started to trust its clients with them.

The context rule is the CLI's: a prompt that leaves no room for one reply token is refused with what
to do; a reply budget (given or the default) larger than the room left is trimmed to it, so the reply
ends with finish_reason "length" at the context's edge.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from typing import Any, NamedTuple

from ..chat_template import TemplateTimeout, render_time_limit
from .api_requests import ParsedRequest
from .api_responses import APIError
from .prompting import has_chat_template, render_ids
from .reasoning import CLOSE, prompt_opens_thinking
from .tool_calls import forced_opening, schemas_of
from .tool_grammar import call_grammar

log = logging.getLogger("mtlqwen.serve")



class Prompt(NamedTuple):
    ids: list[int]
    in_reasoning: bool  # the prompt leaves the model inside a thinking block
    opened_call: str = ""  # the opening of a call the prompt forces (tool_calls.forced_opening); the reply continues it
    call_grammar: str | None = None  # the forced call's rest (tool_grammar.call_grammar), None where not held to it


def forced_call_grammar(req: ParsedRequest, xml: bool) -> str | None:
    """The grammar of a forced call's rest for the request's tools; None where llguidance cannot compile one from
    their schemas (a schema feature it does not support): the call is then forced without it, as the model writes it."""
    from ..runtime.structured import Structure  # noqa: PLC0415

    g = call_grammar(schemas_of(req.tools), req.forced_call, xml, req.parallel_tool_calls)
    try:
        Structure("lark", g).grammar()
    except ValueError as e:
        log.warning("a forced tool call runs without its grammar: %s", e)
        return None
    return g


class PromptBuilder:
    def __init__(self, loop, cfg):
        self.loop, self.cfg = loop, cfg

    # ---- the context
    def limit(self) -> int:
        """Most tokens a prompt plus its reply may have: the context, and what the KV pool can hold
        (the last sampled token needs no KV)."""
        e = self.loop.engine
        return min(e.max_model_len, e.num_blocks * e.block_tokens + 1)

    def _too_long(self, what: str, tokens: str, param: str) -> APIError:
        return APIError(f"the {what} ({tokens} tokens) fills the model's context of {self.limit()} tokens and "
                        f"leaves no room for a reply: shorten the {what}", 400, param, "context_length_exceeded")

    def _check_bytes(self, texts: list[str], what: str, param: str) -> None:
        """Before tokenising: n bytes are at least n / (the longest token's bytes) tokens."""
        per_token = getattr(self.loop.tokenizer, "max_token_bytes", None)
        if not per_token:
            return
        n = sum(len(t.encode("utf-8", "replace")) for t in texts)
        at_least = -(-n // per_token)
        if at_least >= self.limit():
            raise self._too_long(what, f"at least {at_least}", param)

    # ---- templates
    def template_allowed(self, template: str) -> bool:
        """A request's `chat_template`: one of the checkpoint's named templates, or any source when trusted."""
        names = getattr(self.loop.tokenizer, "chat_templates", None) or {}
        return template in names or self.cfg.trust_request_template

    # ---- prompt ids (worker thread)
    def prompt_ids(self, req: ParsedRequest) -> Prompt:
        tok = self.loop.tokenizer
        if req.kind == "completion":
            if isinstance(req.prompt, str):
                self._check_bytes([req.prompt], "prompt", "prompt")
                ids = tok.encode(req.prompt)  # a raw prompt is the client's own text, special tokens included
            else:
                ids = list(req.prompt)
            if len(ids) >= self.limit():
                raise self._too_long("prompt", str(len(ids)), "prompt")
            return Prompt(ids, False)
        texts = [str(m.get("content") or "") for m in req.messages] + ([json.dumps(req.tools)] if req.tools else [])
        self._check_bytes(texts, "messages", "messages")
        tools = {"tools": req.tools} if req.tools else {}
        if tools and not has_chat_template(tok, req.template_kwargs):
            raise APIError("this model's tokenizer has no chat template to show tools to the model", 400, "tools",
                           "not_supported")
        try:
            with render_time_limit(self.cfg.template_timeout_s):
                ids, text = render_ids(tok, req.messages, add_generation_prompt=True,
                                       literal_content=not self.cfg.special_tokens_in_content,
                                       **req.template_kwargs, **tools)
        except TemplateTimeout as e:
            raise APIError(f"{e} for these messages", 400, "messages", "template_timeout") from None
        except Exception as e:  # the template rejected the conversation (raise_exception, bad types, sandbox)
            raise APIError(f"the chat template rejected the messages: {type(e).__name__}: {e}", 400, "messages") from None
        opened, grammar = "", None
        if req.forced_call is not None:  # tool_choice asks for a call: the prompt opens it, a grammar holds the rest
            xml = "<function=" in tok.template_source(req.template_kwargs.get("chat_template"), req.tools)
            opened = forced_opening(req.forced_call, xml, prompt_opens_thinking(text))
            ids, text = ids + tok.encode(opened), text + opened
            grammar = forced_call_grammar(req, xml)
        if len(ids) >= self.limit():
            raise self._too_long("messages", str(len(ids)), "messages")
        return Prompt(ids, prompt_opens_thinking(text), opened, grammar)

    # ---- sampling
    def sampling_params(self, req: ParsedRequest, prompt_len: int, in_reasoning: bool = False,
                        call_grammar: str | None = None):
        """in_reasoning: the prompt leaves the model thinking, so a structured reply's form starts after the
        thinking's end token (Structure.after). call_grammar: a forced call's (Prompt.call_grammar), which holds the
        reply from its first token (the prompt closed any thinking before the call's opening)."""
        from ..runtime import SamplingParams  # noqa: PLC0415
        from ..runtime.structured import Structure  # noqa: PLC0415

        s: dict[str, Any] = dict(req.sampling)
        if req.structure is not None:
            end = self.loop.tokenizer.token_to_id(CLOSE) if in_reasoning else None
            s["structured"] = Structure(*req.structure, after=end)
        elif call_grammar is not None:
            s["structured"] = Structure("lark", call_grammar)
        room = self.limit() - prompt_len
        s["max_tokens"] = min(self.cfg.defaults.max_tokens if s["max_tokens"] is None else s["max_tokens"], room)
        try:
            params = SamplingParams(**s)
            params.check_vocab(self.loop.engine.config.vocab_size)
        except ValueError as e:  # a range the declared fields do not cover (the defaults, the vocabulary)
            word = str(e).split(" ", 1)[0].rstrip(":")
            raise APIError(str(e), 400, word if word in {f.name for f in fields(SamplingParams)} else None) from None
        return params
