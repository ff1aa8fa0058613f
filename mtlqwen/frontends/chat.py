"""`mtlqwen chat`: a multi-turn chat in the terminal.

Each turn's prompt is the previous turn's prompt + completion tokens, exactly as they ran, followed
by what the chat template writes after a reply (the turn end, the new user message and the
generation prompt). So the conversation's tokens only ever grow at the end, which is what a prefix
cache needs to reuse the earlier turns. Past replies therefore keep their thinking text, as in
mlx-lm's chat; /reset starts over.

Ctrl-C while a reply streams cancels that reply (the turn is dropped) and returns to the prompt;
Ctrl-C or Ctrl-D at the prompt exits.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import sys
import time

from .args import (
    add_draft_args, add_model_args, draft_kwargs, add_prefix_cache_bytes_arg, add_quiet_arg, add_sampling_args, add_warmup_arg, check_max_tokens,
    check_model_args, fit_reply, load_with_bar, parse_template_args, sampling_from_args,
)
from .prompting import continuation, has_chat_template, render
from .reasoning import CLOSE, OPEN, ReasoningSplitter, prompt_opens_thinking
from .terminal import Interrupt, PromptProgress, printable, progress_enabled, text_stream

PROMPT = ">> "
HELP = ("commands: /think and /no_think switch thinking for the next replies, /reset clears the "
        "conversation, /help shows this, /exit (or Ctrl-D) quits; Ctrl-C stops a reply; "
        "start a message with // to send one that begins with /")
COMMANDS = ("/exit", "/quit", "/help", "/reset", "/think", "/no_think")
COMMAND_LIKE = re.compile(r"/[A-Za-z_]+")  # a line whose first word looks like this is a command, not a message
DIM, RESET = "\x1b[2m", "\x1b[0m"
RESET_HINT = "/reset starts a new conversation"


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "chat", help="multi-turn chat in the terminal (streams replies, keeps the conversation)",
        description="Chat with a model in the terminal. The checkpoint's chat template is applied; "
                    "each turn extends the previous turn's tokens so a prefix cache can reuse them. " + HELP)
    add_model_args(c)
    add_draft_args(c)
    c.add_argument("--system-prompt", default=None, help="system message for the conversation")
    c.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help='chat template arguments, e.g. \'{"enable_thinking": false}\'')
    add_sampling_args(c, max_tokens=512)
    c.add_argument("--prefix-interval", type=int, default=None,
                   help="prefix-cache snapshot interval in tokens (default: the engine's, 512; 0 turns the cache off)")
    add_prefix_cache_bytes_arg(c)
    add_warmup_arg(c)
    c.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed after each reply")
    c.add_argument("--debug-token-log", default=None, metavar="PATH",
                   help="debugging aid: append each turn's prompt and completion token ids (JSON lines) to PATH")
    c.add_argument("--show-special-tokens", action="store_true",
                   help="print special tokens (<|im_end|>, ...) in replies; hidden by default")
    add_quiet_arg(c)
    c.set_defaults(func=cmd_chat)


class Conversation:
    """The token history of a chat and how the next turn's prompt extends it."""

    def __init__(self, tokenizer, system_prompt: str | None, template_kwargs: dict, eos_ids):
        self.tok = tokenizer
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.kwargs = dict(template_kwargs)
        self.eos_ids = set(eos_ids)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = []
        self.ids: list[int] = []  # every turn's prompt + completion, as the engine ran them
        self.end_text = ""  # text of the last reply's final token when it was an end-of-turn token

    def prompt_for(self, user_text: str) -> tuple[list[int], str]:
        """(token ids, prompt text of the new part) for a new user message."""
        new = [{"role": "user", "content": user_text}]
        if self.ids:
            tail = continuation(self.tok, self.system, new, **self.kwargs)
            if tail is not None:
                if self.end_text and tail.startswith(self.end_text):
                    tail = tail[len(self.end_text):]  # the reply already ended with the turn-end token
                return self.ids + list(self.tok.encode(tail)), tail
        # first turn, or a template that does not show replies verbatim: render everything
        text = render(self.tok, self.system + self.messages + new, add_generation_prompt=True, **self.kwargs)
        return list(self.tok.encode(text)), text

    def commit(self, user_text: str, prompt_ids: list[int], completion_ids: list[int], reply: str) -> None:
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
        self.ids = list(prompt_ids) + list(completion_ids)
        last = completion_ids[-1] if completion_ids else None
        self.end_text = self.tok.decode([last]) if last in self.eos_ids else ""


class _Printer:
    """Streams reply tokens as text (special tokens hidden but for the thinking tags, unless asked
    for); thinking is dimmed on a terminal."""

    def __init__(self, out, in_reasoning: bool, stream):
        self.out, self.tty = out, out.isatty()
        self.split = ReasoningSplitter(in_reasoning)
        self.stream = stream
        self.dim = False

    def write(self, token_ids: list[int], final: bool = False) -> None:
        text = "".join(self.stream.add(t) for t in token_ids) + (self.stream.finish() if final else "")
        r, c = self.split.feed(text)
        if final:
            r2, c2 = self.split.finish()
            r, c = r + r2, c + c2
        if r:
            self._emit(r, True)
        if c:
            self._emit(c, False)
        if final and self.dim and self.tty:
            self.out.write(RESET)
        self.out.flush()

    def _emit(self, s: str, reasoning: bool) -> None:
        if self.tty and reasoning != self.dim:
            self.out.write(DIM if reasoning else RESET)
        self.dim = reasoning
        self.out.write(printable(s))


def _generate(engine, ids, sampling, printer: _Printer, bars: bool):
    """Run one reply; returns (Output or None when cancelled by Ctrl-C)."""
    prompt_bar = PromptProgress(engine, len(ids), bars)
    with Interrupt() as intr:
        rid = engine.submit(ids, sampling)
        while True:
            if intr.hit:
                engine.cancel(rid)
                while engine.has_work():  # let the in-flight step land; its tokens are dropped
                    engine.step()
                prompt_bar.close()
                printer.write([], final=True)
                return None
            for d in engine.step():
                if d.request_id != rid:
                    continue
                prompt_bar.close()
                printer.write(d.token_ids, final=d.finished)
                if d.finished:
                    return d.output
            prompt_bar.update()


def _engine_kwargs(args) -> dict:
    if args.prefix_interval is not None and args.prefix_interval < 0:
        raise ValueError(f"--prefix-interval must be >= 0 (0 turns the prefix cache off), got {args.prefix_interval}")
    kw = {"slots": 1} if args.prefix_interval is None else {"slots": 1, "prefix_interval": args.prefix_interval}
    if getattr(args, "prefix_cache_bytes", None) is not None:
        kw["prefix_cache_bytes"] = args.prefix_cache_bytes
    return kw


def _command(text: str, convo: Conversation, thinking_switch: bool) -> bool | None:
    """Run a /command line: True to quit, False when handled, None when the line is a message."""
    word = text.split(maxsplit=1)[0]
    if not COMMAND_LIKE.fullmatch(word):
        return None
    if word not in COMMANDS or word != text:
        print(f"(unknown command {text!r:.40}; /help lists them)" if word not in COMMANDS
              else f"({word} takes no arguments; /help lists the commands)")
        return False
    if text in ("/exit", "/quit"):
        return True
    if text == "/help":
        print(HELP)
    elif text == "/reset":
        convo.reset()
        print("(conversation cleared)")
    elif not thinking_switch:
        print("(this model's template has no thinking switch)")
    else:
        convo.kwargs["enable_thinking"] = text == "/think"
        print(f"(thinking {'on' if text == '/think' else 'off'})")
    return False


def cmd_chat(args) -> int:
    from ..runtime import Engine  # noqa: PLC0415
    from ..runtime.replicated import replicate  # noqa: PLC0415
    from ..runtime.warmup import should_warm_up, warm_up  # noqa: PLC0415

    check_model_args(args)
    kwargs = parse_template_args(args.chat_template_args)
    sampling = sampling_from_args(args)
    engine_kw = _engine_kwargs(args)
    bars = progress_enabled(args.quiet)
    model, tok, note, drafter = load_with_bar(args, bars)
    engine_kw.update(draft_kwargs(args, drafter))  # --draft, else the demo pair's drafter
    if should_warm_up(args.warmup, getattr(args, "group", None)):  # before the engine: one pool at a time
        warm_up(model, engine_kw, tok, log=None if args.quiet else (lambda m: print(f"({m})", file=sys.stderr)))
    # --tensor-parallel: ranks other than 0 follow rank 0's engine and exit here
    engine = replicate(Engine(model, tokenizer=tok, **engine_kw), getattr(args, "group", None))
    context = engine.max_model_len
    check_max_tokens(sampling.max_tokens, context)
    sampling.check_vocab(engine.config.vocab_size)  # e.g. --top-k: refused now, not at every turn
    eos = set(getattr(engine, "eos", ())) | set(getattr(tok, "eos_token_ids", ()) or ())
    convo = Conversation(tok, args.system_prompt, kwargs, eos)
    thinking_switch = bool(getattr(tok, "has_thinking", False))
    log = open(args.debug_token_log, "a", encoding="utf-8") if args.debug_token_log else None
    if note:  # printed once nothing can fail any more: an error is the only line
        print(note, file=sys.stderr)
    if not has_chat_template(tok):
        print("(no chat template in this tokenizer: using plain ChatML)", file=sys.stderr)
    try:
        import readline  # noqa: F401,PLC0415  line editing and history for input()
    except ImportError:
        pass
    print(HELP)
    # Ctrl-C at the prompt quits: a process started in the background by a non-interactive shell inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler (input() would ignore Ctrl-C)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    turn = 0
    try:
        while True:
            try:
                line = input(PROMPT)
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("//"):  # a message that begins with "/"
                line = line.lstrip()[1:]
            else:
                quit_now = _command(text, convo, thinking_switch)
                if quit_now is not None:
                    if quit_now:
                        return 0
                    continue
            ids, new_text = convo.prompt_for(line)
            try:
                max_tokens, trimmed = fit_reply(len(ids), sampling.max_tokens, context, RESET_HINT)
            except ValueError as e:  # the conversation outgrew the context: the turn is not run
                print(f"({e})")
                continue
            if trimmed:
                print(f"({trimmed}; {RESET_HINT})")
            stream = text_stream(tok, args.show_special_tokens, keep=(OPEN, CLOSE))
            printer = _Printer(sys.stdout, prompt_opens_thinking(new_text), stream)
            t0 = time.perf_counter()
            try:
                out = _generate(engine, ids, dataclasses.replace(sampling, max_tokens=max_tokens), printer, bars)
            except ValueError as e:  # a request the engine refuses (e.g. the KV pool is too small for it)
                print(f"\n(error: {e})")
                continue
            print()
            if out is None:
                print("(reply cancelled)")
                continue
            if out.finish_reason == "error":
                print(f"(error: {out.error})")
                continue
            turn += 1
            convo.commit(line, ids, out.token_ids, out.text)
            cached = getattr(out, "cached_tokens", 0) or 0
            if args.verbose:
                dt = max(time.perf_counter() - t0, 1e-9)
                print(f"[prompt {out.prompt_tokens} tokens ({cached} cached), reply {len(out.token_ids)} tokens, "
                      f"{len(out.token_ids) / dt:.1f} tokens/s]")
            if log is not None:
                log.write(json.dumps({"turn": turn, "prompt_ids": ids, "completion_ids": out.token_ids,
                                      "finish_reason": out.finish_reason, "cached_tokens": cached,
                                      "stats": engine.stats()}) + "\n")
                log.flush()
    finally:
        if log is not None:
            log.close()
