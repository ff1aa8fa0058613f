"""The serve app's state and its refusals: the server's configuration, the state every route reaches through
`request.app.state.server`, and the one place a refusal becomes an error response (counted by status, in the
shape of the route's API).
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from . import api_responses as oa
from .api_requests import Defaults, ParsedRequest, parse_chat, parse_completion
from .engine_loop import EngineLoop
from .messages_api import error_body as messages_error
from .messages_api import parse_messages
from .prompt_limits import PromptBuilder
from .responses_api import parse_responses
from .request_body import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from .response_store import DEFAULT_STORED, ResponseStore

RETRY_AFTER_S = 1  # what a 429 asks the client to wait: a slot frees as soon as any request ends


def is_pattern(name: str) -> bool:
    """A served model name with shell wildcards (*, ?, [...]) matches request names instead of being one."""
    return any(c in name for c in "*?[")


@dataclass
class ServerConfig:
    served_names: tuple[str, ...]  # the first is the name responses carry; requests may use any
    slots: int
    max_queue: int = 64
    api_key: str | None = None
    defaults: Defaults = field(default_factory=Defaults)
    template_defaults: dict = field(default_factory=dict)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    template_timeout_s: float = 5.0
    trust_request_template: bool = False  # may a request send its own chat template source
    special_tokens_in_content: bool = False  # do special-token strings in messages act as control tokens
    stored_responses: int = DEFAULT_STORED  # Responses API responses kept for previous_response_id (0: none)
    prefix_cache_dir: str | None = None  # where POST /save_prefix_cache writes (serve --prefix-cache-dir)
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.served_names:
            raise ValueError("at least one served model name is needed")
        if is_pattern(self.served_names[0]):
            raise ValueError(f"the first served model name is the one responses carry, so it cannot be a pattern: "
                             f"{self.served_names[0]!r}")

    @property
    def listed_names(self) -> tuple[str, ...]:
        """The names /v1/models lists: the plain ones (a pattern names no model a client could pick)."""
        return tuple(n for n in self.served_names if not is_pattern(n))

    def serves(self, name: str) -> bool:
        """A plain served name, or one a pattern matches (shell-style, case-sensitive: 'claude-*')."""
        return name in self.served_names or any(is_pattern(p) and fnmatch.fnmatchcase(name, p) for p in self.served_names)

    @property
    def model_name(self) -> str:
        return self.served_names[0]


@dataclass
class ServerState:
    loop: EngineLoop
    cfg: ServerConfig

    def __post_init__(self):
        self.metrics = self.loop.metrics
        self.prompts = PromptBuilder(self.loop, self.cfg)
        self.responses = ResponseStore(self.cfg.stored_responses)

    def ready(self) -> None:
        if self.loop.state == "loading":
            raise oa.APIError("the model is still loading; retry when GET /health answers ok", 503,
                              code="model_loading", type_="server_error", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.loop.state != "ok":
            raise oa.APIError(f"the engine is not running: {self.loop.error}", 503, type_="server_error")

    def check_model(self, name: str | None) -> None:
        if name is not None and not self.cfg.serves(name):
            raise oa.APIError(f"the model '{name:.100}' does not exist; this server serves: "
                              f"{', '.join(self.cfg.served_names)}", 404, "model", "model_not_found")

    def parse(self, raw: bytes, kind: str) -> ParsedRequest:
        """kind: "chat", "completion", "responses" (OpenAI; a Responses request is a chat request once parsed,
        continuing a stored response's conversation) or "messages" / "count_tokens" (Anthropic; likewise)."""
        if kind == "chat":
            return parse_chat(raw, self.cfg.defaults, self.cfg.template_defaults, self.prompts.template_allowed)
        if kind in ("messages", "count_tokens"):
            return parse_messages(raw, self.cfg.defaults, self.cfg.template_defaults, kind == "count_tokens")
        if kind == "responses":
            parsed, source = parse_responses(raw, self.cfg.defaults, self.cfg.template_defaults,
                                             self.responses.conversation)
            parsed.source = source
            return parsed
        return parse_completion(raw, self.cfg.defaults)

    def check_capacity(self, n: int = 1) -> None:
        """n: the engine requests about to be added (a request's choices)."""
        if self.loop.live + n > self.cfg.slots + self.cfg.max_queue:  # bounded queue: refuse rather than grow
            raise oa.APIError(f"the server is at capacity ({self.cfg.slots} running, {self.cfg.max_queue} waiting); "
                              "retry later", 429, code="queue_full", type_="rate_limit_error",
                              headers={"Retry-After": str(RETRY_AFTER_S)})


def state(request: Request) -> ServerState:
    return request.app.state.server


def error_response(e: oa.APIError, kind: str = "chat") -> JSONResponse:
    """An error in the shape of the route's API: Anthropic's for /v1/messages, OpenAI's elsewhere."""
    body = messages_error(e) if kind in ("messages", "count_tokens") else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


async def refusals(st: ServerState, coro, kind: str = "chat") -> Response:
    """The route's response, or its refusal as an error response (counted by status)."""
    try:
        return await coro
    except oa.APIError as e:
        st.metrics.on_rejected(e.status)
        return error_response(e, kind)
    except ClientDisconnect:  # the client left while sending its body: nobody reads an answer
        return Response(status_code=499)
