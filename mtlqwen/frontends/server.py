"""`mtlqwen serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn) over one shared engine.

This module only builds the subcommand and wires the pieces: engine_loop.py (the engine thread),
server_app.py (routes), api_requests.py / api_responses.py (the OpenAI shapes), prompt_limits.py
(prompts within the limits), sse.py (streaming), metrics.py (Prometheus). The web stack is imported
when the command runs, so `mtlqwen --help` works without it. The port is bound before the model
loads, so a port in use is one clear error and nothing is loaded.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from .args import (
    add_draft_args, add_model_args, add_prefix_cache_bytes_arg, add_sampling_args, add_warmup_arg, check_draft_args,
    load_model_and_tokenizer, parse_template_args, penalty_args, read_template_file, sampling_defaults,
    sampling_from_args,
)
from .request_body import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES

DEFAULT_PORT = 8080
BUILTIN_NAME = "mtlqwen-builtin-random"


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server (chat/completions, streaming, /metrics)",
        description="Serve a model over HTTP in the OpenAI format. Concurrent requests are batched by "
                    "one engine. With no --model, the small built-in random-weight model is served.")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (or set MTLQWEN_API_KEY); "
                        "also enables the operator endpoints POST /reset_prefix_cache and /save_prefix_cache")
    add_app_args(s)
    s.add_argument("--debug-load-delay", type=float, default=0.0, metavar="SECONDS",
                   help="debugging aid: wait this long before loading the model (shows /health 'loading')")
    s.set_defaults(func=cmd_serve)


def add_app_args(s) -> None:
    """The flags of the app and its engine (serve's, less where it listens; run-batch's too)."""
    add_model_args(s)
    add_draft_args(s)
    s.add_argument("--prompt-cache-file", nargs="+", default=None, metavar="FILE",
                   help="prompt caches written by `mtlqwen cache-prompt` (same model, dtype and drafter), loaded into the "
                        "prefix cache at start: requests whose prompts begin with one prefill only the rest (entries "
                        "are then evicted like any other when the cache is full)")
    s.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="keep the prefix cache across restarts: its entries that no other extends (the ends of "
                        "conversations) are written to DIR when the server stops and loaded when it starts (files of "
                        "another model are skipped, logged)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may use and /v1/models lists; the first is the one responses "
                        "carry (default: the checkpoint's name, and 'default'). Any other name gets a 404. A name with "
                        "shell wildcards is a pattern, not listed: e.g. 'claude-*' for Anthropic clients' own names")
    s.add_argument("--max-stored-responses", type=int, default=None, metavar="N",
                   help="Responses API responses kept in memory for previous_response_id and GET /v1/responses/{id} "
                        "(default 1024, least recently used dropped; 0 keeps none)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for a slot; beyond it the server answers 429 (default 64)")
    s.add_argument("--slots", "--max-num-seqs", type=int, default=8,
                   help="sequences decoded together (default 8; vLLM's name is accepted too)")
    s.add_argument("--dense-weights", choices=["auto", "on", "off"], default="auto",
                   help="keep a dequantized (16-bit) copy of each quantized projection for prefill-sized steps, which "
                        "otherwise dequantize the weights every step: faster prefill for 4x the projections' 4-bit "
                        "memory (auto, the default: on with the CUDA kernels where the copies fit in a third of the "
                        "memory the weights leave)")
    s.add_argument("--step-tokens", "--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step, shared by all slots (default 128; with a drafter at least "
                        "slots x (n_draft + 1), so every slot can verify its drafts; vLLM's name is accepted too)")
    s.add_argument("--prefill-step-tokens", type=int, default=None,
                   help="tokens a step may take when no request is decoding (default 1024, never below "
                        "--step-tokens): long prompts prefill in bigger steps when nobody waits on a token")
    s.add_argument("--block-tokens", type=int, default=128, help="tokens per KV block (default 128)")
    s.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: sized to the device)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context limit per request, prompt and reply together (default and maximum: the model's)")
    s.add_argument("--prefix-interval", type=int, default=None,
                   help="prefix-cache snapshot interval in tokens (default: the engine's, 512; 0 turns the cache off)")
    add_prefix_cache_bytes_arg(s)
    add_warmup_arg(s)
    s.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help='default chat template arguments, e.g. \'{"enable_thinking": false}\' '
                        "(a request's chat_template_kwargs override them)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use instead of the checkpoint's (e.g. one that teaches tool "
                        "calls); a request may still choose one of the checkpoint's named templates")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests send their own chat template source in chat_template_kwargs.chat_template "
                        "(a template is code: for trusted clients only; by default only the checkpoint's named "
                        "templates may be chosen)")
    s.add_argument("--chat-template-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="longest a chat template may take to render one request's prompt (default 5)")
    s.add_argument("--special-tokens-in-content", action="store_true",
                   help="let special-token strings written in messages (e.g. '<|im_start|>') act as control tokens; "
                        "by default what a message says is tokenized as text")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help=f"largest request body; a larger one gets 413 (default {DEFAULT_MAX_BODY_BYTES})")
    s.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help=f"time a client has to send its whole request body; then 408 "
                        f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    add_sampling_args(s, max_tokens=512)  # defaults for requests that leave a field out
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server and access log verbosity (default info)")


def _engine_kwargs(args) -> dict:
    """Engine arguments from the flags (those left unset keep the engine's defaults)."""
    kw = dict(slots=args.slots, step_tokens=args.step_tokens, block_tokens=args.block_tokens,
              prefill_step_tokens=args.prefill_step_tokens)
    for name in ("num_blocks", "max_model_len", "prefix_interval", "prefix_cache_bytes", "draft", "draft_bits"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "num_draft_tokens", None) is not None:
        kw["n_draft"] = args.num_draft_tokens
    dense = getattr(args, "dense_weights", "auto")
    if dense != "auto":
        kw["dense_weights"] = dense == "on"
    return kw


def _check_model_arg(model: str | None) -> None:
    """Fail before listening on a path that cannot be a checkpoint (repo ids are fetched while loading)."""
    from ..demo import is_builtin  # noqa: PLC0415

    if is_builtin(model):  # the demo pair, or 'random'
        return
    p = Path(model).expanduser()
    if not p.exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise FileNotFoundError(f"no checkpoint directory at {model} (and it is not a Hugging Face repo id)")


def served_names(args) -> tuple[str, ...]:
    """--served-model-name, else the checkpoint's name (a local directory's name, a repo id as given) and 'default'."""
    if args.served_model_name:
        names = tuple(dict.fromkeys(args.served_model_name))
        if any(not n.strip() for n in names):
            raise ValueError("--served-model-name: names must not be empty")
        from .server_state import is_pattern  # noqa: PLC0415

        if is_pattern(names[0]):
            raise ValueError(f"--served-model-name: the first name is the one responses carry, so it cannot be a "
                             f"pattern: {names[0]!r}")
        return names
    if args.model is None:
        return (BUILTIN_NAME, "default")
    p = Path(args.model).expanduser()
    name = p.resolve().name if p.exists() else args.model
    return tuple(dict.fromkeys((name, "default")))


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (before the model loads); ValueError naming the address if it cannot."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; one in use is not
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _check_args(args) -> None:
    if getattr(args, "max_stored_responses", None) is not None and args.max_stored_responses < 0:
        raise ValueError(f"--max-stored-responses must be >= 0, got {args.max_stored_responses}")
    for name in ("max_queue", "slots", "port", "max_body_bytes"):
        if hasattr(args, name) and getattr(args, name) < (1 if name != "max_queue" else 0):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("body_timeout", "chat_template_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(args, name)}")
    folder = getattr(args, "prefix_cache_dir", None)
    if folder is not None:
        if args.tensor_parallel or args.prefix_interval == 0:
            raise ValueError("--prefix-cache-dir needs the prefix cache (--prefix-interval > 0) and no --tensor-parallel")
        if os.path.exists(folder) and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise ValueError(f"--prefix-cache-dir: {folder} is not a writable directory")
    if args.prompt_cache_file:
        if args.tensor_parallel:
            raise ValueError("--prompt-cache-file cannot be used with --tensor-parallel")
        if args.prefix_interval == 0:
            raise ValueError("--prompt-cache-file needs the prefix cache (--prefix-interval > 0)")
        from ..runtime import prompt_file  # noqa: PLC0415

        for f in args.prompt_cache_file:  # before the port is bound: a missing or foreign file fails alone
            prompt_file.read(f)
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be at least 2 (a prompt token and a reply token), got {args.max_model_len}")


def _check_context(model, max_model_len: int | None) -> None:
    ctx = model.config.max_position_embeddings
    if max_model_len is not None and max_model_len > ctx:
        raise ValueError(f"--max-model-len {max_model_len} is larger than the model's context of {ctx} tokens: "
                         f"use {ctx} or less (or leave it out)")


def _follow_rank0(args, engine_kw: dict, group) -> int:
    """A rank other than 0 of `serve --tensor-parallel`: the same engine, stepped as rank 0 says."""
    from ..runtime import Engine  # noqa: PLC0415
    from ..runtime.replicated import follow  # noqa: PLC0415

    model, tok, _, drafter = load_model_and_tokenizer(args)
    if drafter is not None and not engine_kw.get("draft"):  # as rank 0's build(), so the engines agree
        engine_kw["draft"] = drafter
    _check_context(model, args.max_model_len)
    follow(Engine(model, tokenizer=tok, **engine_kw), group)
    return 0


def app_config(args, api_key: str | None):
    """(ServerConfig, engine keywords) of the app flags, every check that needs no model done."""
    from .api_requests import Defaults  # noqa: PLC0415
    from .server_app import ServerConfig  # noqa: PLC0415

    engine_kw = _engine_kwargs(args)
    _check_model_arg(args.model)
    check_draft_args(args)
    _check_args(args)
    template_defaults = parse_template_args(args.chat_template_args)
    if args.chat_template is not None:
        template_defaults["chat_template"] = read_template_file(args.chat_template)
    temp, top_p = sampling_defaults(args)
    defaults = Defaults(temperature=temp, top_p=top_p, top_k=args.top_k, min_p=args.min_p,
                        max_tokens=args.max_tokens, seed=args.seed, **penalty_args(args))
    sampling_from_args(args)  # flags out of range fail early, naming the flag
    cfg = ServerConfig(served_names=served_names(args), slots=args.slots, max_queue=args.max_queue, api_key=api_key,
                       defaults=defaults, template_defaults=template_defaults, max_body_bytes=args.max_body_bytes,
                       body_timeout_s=args.body_timeout, template_timeout_s=args.chat_template_timeout,
                       trust_request_template=args.trust_request_chat_template,
                       special_tokens_in_content=args.special_tokens_in_content,
                       prefix_cache_dir=getattr(args, "prefix_cache_dir", None),
                       **({} if args.max_stored_responses is None else {"stored_responses": args.max_stored_responses}))
    return cfg, engine_kw


def build_served_app(args, cfg, engine_kw: dict, log, group=None, load_delay: float = 0.0):
    """(the app, its EngineLoop): the engine is built by the loop's thread when the app starts (its lifespan)."""
    from .engine_loop import EngineLoop  # noqa: PLC0415
    from .metrics import Metrics  # noqa: PLC0415
    from .server_app import build_app  # noqa: PLC0415

    def build():
        from ..runtime import Engine  # noqa: PLC0415
        from ..runtime.replicated import replicate  # noqa: PLC0415
        from ..runtime.warmup import should_warm_up, warm_up  # noqa: PLC0415

        model, tok, note, drafter = load_model_and_tokenizer(args)
        if drafter is not None and not engine_kw.get("draft"):
            engine_kw["draft"] = drafter
        if note:
            log.warning(note)
        _check_context(model, args.max_model_len)
        if should_warm_up(args.warmup, group):  # before the serving engine: its pool and the warm-up's never coexist
            warm_up(model, engine_kw, tok, log=log.info)
        engine = Engine(model, tokenizer=tok, **engine_kw)
        if folder is not None and os.path.isdir(folder):
            made, skipped = engine.load_prefix_cache(folder)
            log.info("prefix cache: %d entries loaded from %s", made, folder)
            for why in skipped:
                log.warning("prefix cache: skipped %s", why)
        for f in args.prompt_cache_file or ():
            saved, new = engine.load_prompt_cache(f)
            log.info("prompt cache %s: %d tokens%s", saved.path, len(saved.tokens),
                     "" if new else " (cached already, or larger than the prefix cache's budget: not kept)")
        return replicate(engine, group), tok

    folder = cfg.prefix_cache_dir
    loop = EngineLoop(build, Metrics(cfg.served_names[0]), load_delay=load_delay)
    if folder is not None:
        def save(engine):
            log.info("prefix cache: %d entries written to %s", len(engine.save_prefix_cache(folder)), folder)

        loop.on_stop = save
    return build_app(loop, cfg), loop


def cmd_serve(args) -> int:
    try:
        import uvicorn  # noqa: PLC0415
    except ImportError:
        print("mtlqwen serve: error: the server needs starlette and uvicorn (pip install starlette uvicorn)",
              file=sys.stderr)
        return 1
    api_key = args.api_key or os.environ.get("MTLQWEN_API_KEY") or None
    cfg, engine_kw = app_config(args, api_key)
    names = cfg.served_names
    group = getattr(args, "group", None)
    if group is not None and group.rank() != 0:  # --tensor-parallel: only rank 0 binds and serves
        return _follow_rank0(args, engine_kw, group)
    sock = bind(args.host, args.port)  # before anything is loaded: a port in use fails here, alone

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    log = logging.getLogger("mtlqwen.serve")
    app, loop = build_served_app(args, cfg, engine_kw, log, group, args.debug_load_delay)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="on"))
    loop.on_load_error = lambda msg: setattr(server, "should_exit", True)  # noqa: ARG005
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    log.info("listening on http://%s:%d (model names: %s)", args.host, args.port, ", ".join(names))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if loop.state == "failed":
        print(f"mtlqwen serve: error: {loop.error}", file=sys.stderr)
        return 1
    return 0
