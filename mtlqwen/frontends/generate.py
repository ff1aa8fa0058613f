"""`mtlqwen generate`: one prompt, its completion streamed to the terminal, then mlx-lm's summary
(prompt and generation tokens/s, peak memory).

Every check that can fail runs before the `==========` banner, so an error is one line in the
`mtlqwen generate: error: ...` format. The completion is printed without special tokens (unless
--show-special-tokens) and with control characters made visible. Ctrl-C stops it at the next
engine step, prints the summary of what was done, and exits with 130.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from .args import (
    add_draft_args, add_model_args, draft_kwargs, add_quiet_arg, add_sampling_args, check_max_tokens, check_model_args, fit_reply,
    load_with_bar, parse_template_args, sampling_from_args,
)
from .prompting import has_chat_template
from .terminal import Interrupt, PromptProgress, printable, progress_enabled, text_stream

BANNER = "=" * 10
INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT


def register(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate a completion for one prompt and report tokens/s",
                              description="Generate a completion. With no --model, the built-in demo model runs (a small Qwen3.5 "
                              "trained on the Python standard library, with its DFlash drafter).")
    add_model_args(g)
    add_draft_args(g)
    g.add_argument("--prompt", "-p", default="Hello, Qwen!", help="the prompt; '-' reads standard input")
    g.add_argument("--system-prompt", default=None, help="system message for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as is, without the chat template")
    g.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help='extra chat template arguments, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--prompt-cache-file", default=None, metavar="FILE",
                   help="a prompt cache written by `mtlqwen cache-prompt`: its prompt goes before --prompt, in the same "
                        "user message, with its system prompt and chat-template settings, and its computed state is "
                        "loaded so that only --prompt's tokens are prefilled; --model defaults to the file's")
    add_sampling_args(g, max_tokens=100)
    g.add_argument("--show-special-tokens", action="store_true",
                   help="print special tokens (<|im_end|>, ...) in the completion; hidden by default")
    add_quiet_arg(g)
    g.set_defaults(func=cmd_generate)


def read_prompt(p: str) -> str:
    return sys.stdin.read() if p == "-" else p.replace("\\n", "\n").replace("\\t", "\t")


def template_flags(args) -> list[str]:
    return [f for f, v in (("--system-prompt", args.system_prompt), ("--chat-template-args", args.chat_template_args))
            if v is not None]


def prompt_token_ids(args, tok, prompt: str, template_kwargs: dict) -> list[int]:
    if args.ignore_chat_template or not has_chat_template(tok):
        if template_flags(args):
            raise ValueError(f"{template_flags(args)[0]} does not apply: this tokenizer has no chat template")
        return list(tok.encode(prompt))
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs))


# (flag, args name, default) of what a prompt cache file records of its making (cache_prompt.py writes them) and
# `generate --prompt-cache-file` takes as its defaults
CACHED_FLAGS = (("--system-prompt", "system_prompt", None), ("--chat-template-args", "chat_template_args", None),
                ("--ignore-chat-template", "ignore_chat_template", False), ("--draft", "draft", None),
                ("--draft-bits", "draft_bits", None), ("--quantize", "quantize", None))


def from_prompt_cache(args):
    """--prompt-cache-file: the file's header, its request's settings taken as the flags' (a flag given with another
    value is an error: the cached tokens were rendered with the file's), and --model the file's when not given."""
    from ..runtime import prompt_file  # noqa: PLC0415

    if getattr(args, "tensor_parallel", False):
        raise ValueError("--prompt-cache-file cannot be used with --tensor-parallel")
    saved = prompt_file.read(args.prompt_cache_file)
    req = saved.request
    if args.model is None:
        args.model = req.get("model")  # None: the built-in demo model, as when it was written
    for flag, dest, default in CACHED_FLAGS:
        mine, theirs = getattr(args, dest), req.get(dest, default)
        same = parse_template_args(mine) == parse_template_args(theirs) if dest == "chat_template_args" else mine == theirs
        if mine != default and not same:
            raise ValueError(f"{flag} differs from the prompt cache's ({theirs!r}), which its tokens and state were "
                             "made with; leave the flag out to use the file's")
        setattr(args, dest, theirs)
    return saved


def cmd_generate(args) -> int:
    import mlx.core as mx  # noqa: PLC0415

    from ..runtime import Engine  # noqa: PLC0415
    from ..runtime.replicated import replicate  # noqa: PLC0415

    saved = from_prompt_cache(args) if args.prompt_cache_file else None
    check_model_args(args)
    if args.ignore_chat_template and template_flags(args):
        raise ValueError(f"{template_flags(args)[0]} does not apply with --ignore-chat-template")
    template_kwargs = parse_template_args(args.chat_template_args)
    sampling = sampling_from_args(args)
    group = getattr(args, "group", None)
    if group is not None and args.prompt == "-":
        raise ValueError("--prompt - cannot be used with --tensor-parallel: mlx.launch never passes the end of "
                         "standard input on to the ranks; give the prompt as --prompt TEXT")
    prompt = read_prompt(args.prompt)
    if saved is not None:
        prompt = saved.request.get("prompt", "") + prompt
    bars = progress_enabled(args.quiet)
    model, tok, note, drafter = load_with_bar(args, bars)
    ids = prompt_token_ids(args, tok, prompt, template_kwargs)
    # --tensor-parallel: ranks other than 0 follow rank 0's engine and exit here
    engine = replicate(Engine(model, tokenizer=tok, slots=1, **draft_kwargs(args, drafter)), group)
    check_max_tokens(sampling.max_tokens, engine.max_model_len)
    cached = 0
    if saved is not None:
        engine.load_prompt_cache(saved.path)
        if ids[: len(saved.tokens)] == saved.tokens:
            cached = len(saved.tokens)
        else:  # a token merged across the end of the cached prompt
            print(f"mtlqwen generate: note: {saved.path} is not a token prefix of this prompt; it is prefilled in full",
                  file=sys.stderr)
    max_tokens, trimmed = fit_reply(len(ids), sampling.max_tokens, engine.max_model_len,
                                    "shorten the prompt")
    if trimmed:
        print(f"mtlqwen generate: note: {trimmed}", file=sys.stderr)
    rid = engine.submit(ids, dataclasses.replace(sampling, max_tokens=max_tokens))
    if note:  # printed once nothing can fail any more: an error is the only line
        print(note, file=sys.stderr)

    stream = text_stream(tok, args.show_special_tokens)
    prompt_bar = PromptProgress(engine, len(ids) - cached, bars)
    prefill0 = engine.counters["prefill_tokens"]
    t0 = time.perf_counter()
    out, cancelled = None, False
    print(BANNER, flush=True)
    with Interrupt() as intr:
        while out is None:
            if intr.hit and not cancelled:
                cancelled = engine.cancel(rid)  # the next step reports it; tokens in flight are dropped
            for d in engine.step():
                if d.request_id != rid:
                    continue
                if d.token_ids:
                    prompt_bar.close()
                text = "".join(stream.add(t) for t in d.token_ids)
                if d.finished:
                    text += stream.finish()
                    out = d.output
                sys.stdout.write(printable(text))
                sys.stdout.flush()
            prompt_bar.update()
    prompt_bar.close()
    print("\n" + BANNER)
    if out.finish_reason == "error":
        print(f"mtlqwen generate: error: {out.error}", file=sys.stderr)
        return 1
    total = time.perf_counter() - t0
    n = len(out.token_ids)
    if out.ttft is not None:  # the tokens prefilled; those restored from the prompt cache apart
        run = out.prompt_tokens - out.cached_tokens
        reused = f" ({out.cached_tokens} more from the prompt cache)" if out.cached_tokens else ""
        print(f"Prompt: {run} tokens, {run / max(out.ttft, 1e-9):.3f} tokens-per-sec{reused}")
    else:  # interrupted before the first token: the chunks launched so far
        done = min(engine.counters["prefill_tokens"] - prefill0, out.prompt_tokens)
        print(f"Prompt: {done} of {out.prompt_tokens} tokens, {done / max(total, 1e-9):.3f} tokens-per-sec")
    gen_time = max(total - (out.ttft or total), 1e-9)
    print(f"Generation: {n} tokens, {max(n - 1, 0) / gen_time:.3f} tokens-per-sec")
    if engine.spec is not None:  # the acceptance length: tokens per speculative step, bonus included
        st = engine.stats()
        print(f"Speculative: {st.get('mean_acceptance_length', 0.0):.2f} tokens per step")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    if out.finish_reason == "cancelled":
        print("mtlqwen generate: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
    return 0
