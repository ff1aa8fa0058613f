"""`mtlqwen serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn) over one shared engine.

This module only builds the subcommand and wires the pieces: engine_loop.py (the engine thread),
server_app.py (routes), openai_schema.py (request/response shapes), metrics.py (Prometheus). The
web stack is imported when the command runs, so `mtlqwen --help` works without it.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from pathlib import Path

from .args import add_model_args, add_sampling_args, load_model_and_tokenizer, parse_template_args

DEFAULT_PORT = 8080


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server (chat/completions, streaming, /metrics)",
        description="Serve a model over HTTP in the OpenAI format. Concurrent requests are batched by "
                    "one engine. With no --model, the small built-in random-weight model is served.")
    add_model_args(s)
    s.add_argument("--draft", default=None, metavar="PATH", help="a DFlash drafter checkpoint for speculative decoding")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    s.add_argument("--served-model-name", default=None, help="the model id reported by /v1/models (default: --model)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (or set MTLQWEN_API_KEY)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for a slot; beyond it the server answers 429 (default 64)")
    s.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
    s.add_argument("--step-tokens", type=int, default=128, help="tokens per engine step, shared by all slots (default 128)")
    s.add_argument("--block-tokens", type=int, default=128, help="tokens per KV block (default 128)")
    s.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: sized to the device)")
    s.add_argument("--max-model-len", type=int, default=None, help="context limit per request (default: the model's)")
    s.add_argument("--prefix-interval", type=int, default=None,
                   help="prefix-cache snapshot interval in tokens (default: the engine's, 512; 0 turns the cache off)")
    s.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help='default chat template arguments, e.g. \'{"enable_thinking": false}\' '
                        "(a request's chat_template_kwargs override them)")
    add_sampling_args(s, max_tokens=512)  # defaults for requests that leave a field out
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server and access log verbosity (default info)")
    s.add_argument("--debug-load-delay", type=float, default=0.0, metavar="SECONDS",
                   help="debugging aid: wait this long before loading the model (shows /health 'loading')")
    s.set_defaults(func=cmd_serve)


def _engine_kwargs(args) -> dict:
    """Engine arguments; optional features are passed only when this build's Engine takes them."""
    from ..runtime import Engine  # noqa: PLC0415

    accepted = inspect.signature(Engine.__init__).parameters
    if args.draft is not None and "draft" not in accepted:
        raise ValueError("speculative decoding not available in this build (--draft)")
    if args.prefix_interval is not None and "prefix_interval" not in accepted:
        raise ValueError("prefix caching not available in this build (--prefix-interval)")
    kw = dict(slots=args.slots, step_tokens=args.step_tokens, block_tokens=args.block_tokens)
    for name in ("num_blocks", "max_model_len", "prefix_interval", "draft"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    return kw


def _check_model_arg(model: str | None) -> None:
    """Fail before listening on a path that cannot be a checkpoint (repo ids are fetched while loading)."""
    if model is None:
        return
    p = Path(model).expanduser()
    if not p.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise FileNotFoundError(f"no checkpoint directory at {model} (and it is not a Hugging Face repo id)")


def cmd_serve(args) -> int:
    try:
        import uvicorn  # noqa: PLC0415
    except ImportError:
        print("mtlqwen serve: error: the server needs starlette and uvicorn (pip install starlette uvicorn)",
              file=sys.stderr)
        return 1
    from . import openai_schema as oa  # noqa: PLC0415
    from .engine_loop import EngineLoop  # noqa: PLC0415
    from .metrics import Metrics  # noqa: PLC0415
    from .server_app import ServerConfig, build_app  # noqa: PLC0415

    engine_kw = _engine_kwargs(args)
    _check_model_arg(args.model)
    for name in ("max_queue", "slots", "port"):
        if getattr(args, name) < (1 if name != "max_queue" else 0):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    template_defaults = parse_template_args(args.chat_template_args)
    defaults = oa.Defaults(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                           max_tokens=args.max_tokens, seed=args.seed)
    from ..runtime import SamplingParams  # noqa: PLC0415

    SamplingParams(temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k,
                   min_p=defaults.min_p, max_tokens=defaults.max_tokens, seed=defaults.seed)  # flags fail early
    api_key = args.api_key or os.environ.get("MTLQWEN_API_KEY") or None
    name = args.served_model_name or args.model or "mtlqwen-builtin-random"

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    log = logging.getLogger("mtlqwen.serve")

    def build():
        from ..runtime import Engine  # noqa: PLC0415

        model, tok, note = load_model_and_tokenizer(args)
        if note:
            log.warning(note)
        return Engine(model, tokenizer=tok, **engine_kw), tok

    metrics = Metrics(name)
    loop = EngineLoop(build, metrics, load_delay=args.debug_load_delay)
    cfg = ServerConfig(model_name=name, slots=args.slots, max_queue=args.max_queue, api_key=api_key,
                       defaults=defaults, template_defaults=template_defaults)
    app = build_app(loop, cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5, lifespan="on"))
    loop.on_load_error = lambda msg: setattr(server, "should_exit", True)  # noqa: ARG005
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    server.run()
    if loop.state == "failed":
        print(f"mtlqwen serve: error: {loop.error}", file=sys.stderr)
        return 1
    return 0
