"""`mtlqwen cache-prompt`: prefill a prompt once and save its computed state (mlx-lm's `cache_prompt`), for
`mtlqwen generate --prompt-cache-file` and `mtlqwen serve --prompt-cache-file` (runtime/prompt_file.py).

With a chat template the prompt is the start of one user message, left open: what `generate` puts after it
(--prompt) continues that message, with the same system prompt and template settings, which the file records.
What is cached is every token that stays the same whatever follows: the template's opening and the prompt, up to
its last token when that token could merge with a continuation. With no --prompt, the system prompt and the user
turn's opening are cached: the prefix every chat request with that system message shares.
"""

from __future__ import annotations

import sys
import time

from .args import (
    add_draft_args, add_model_args, add_quiet_arg, check_model_args, draft_kwargs, load_with_bar, parse_template_args,
)
from .generate import CACHED_FLAGS, prompt_token_ids, read_prompt, template_flags
from .prompting import SENTINEL_USER, has_chat_template
from .terminal import PromptProgress, progress_enabled


def register(subparsers) -> None:
    c = subparsers.add_parser(
        "cache-prompt", help="prefill a prompt once and save its state for generate / serve --prompt-cache-file",
        description="Prefill a prompt and save the model's state after it to a file (safetensors). `mtlqwen generate "
                    "--prompt-cache-file FILE --prompt TEXT` then continues that prompt with TEXT, prefilling only "
                    "TEXT; `mtlqwen serve --prompt-cache-file FILE` starts with it in its prefix cache. The file "
                    "fits only the same model weights, dtype and drafter.")
    add_model_args(c)
    add_draft_args(c)  # the drafter the file's users will run: its context rows are saved too
    c.add_argument("--prompt", "-p", default="", help="the prompt to cache; '-' reads standard input (default: none, "
                                                       "only the system prompt and the user turn's opening)")
    c.add_argument("--system-prompt", default=None, help="system message for the chat template")
    c.add_argument("--ignore-chat-template", action="store_true", help="cache the prompt as is, without the chat template")
    c.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help='extra chat template arguments, e.g. \'{"enable_thinking": false}\'')
    c.add_argument("--prompt-cache-file", required=True, metavar="FILE",
                   help="where to write the cache (.safetensors is appended if missing)")
    add_quiet_arg(c)
    c.set_defaults(func=cmd_cache_prompt)


def cached_ids(args, tok, prompt: str, template_kwargs: dict) -> list[int]:
    """The prompt's tokens that no continuation changes: as a whole prompt with the template, cut where a rendering
    with more text after the prompt differs (the user turn's closing and the generation prompt, and a last token
    that would merge with what follows)."""
    whole = prompt_token_ids(args, tok, prompt, template_kwargs)
    if args.ignore_chat_template or not has_chat_template(tok):
        return whole
    longer = prompt_token_ids(args, tok, prompt + SENTINEL_USER, template_kwargs)
    n = 0
    while n < min(len(whole), len(longer)) and whole[n] == longer[n]:
        n += 1
    return whole[:n]


def cmd_cache_prompt(args) -> int:
    from ..runtime import Engine  # noqa: PLC0415

    if args.tensor_parallel:
        raise ValueError("cache-prompt does not run under --tensor-parallel: each rank holds a shard of the state")
    check_model_args(args)
    if args.ignore_chat_template and template_flags(args):
        raise ValueError(f"{template_flags(args)[0]} does not apply with --ignore-chat-template")
    template_kwargs = parse_template_args(args.chat_template_args)
    prompt = read_prompt(args.prompt) if args.prompt else ""
    bars = progress_enabled(args.quiet)
    model, tok, note, drafter = load_with_bar(args, bars)
    ids = cached_ids(args, tok, prompt, template_kwargs)
    if not ids:
        raise ValueError("nothing to cache: the prompt is empty and there is no chat template opening")
    engine = Engine(model, tokenizer=tok, slots=1, **draft_kwargs(args, drafter))
    if len(ids) >= engine.max_model_len:
        raise ValueError(f"the prompt ({len(ids)} tokens) fills the model's context of {engine.max_model_len} tokens")
    if note:
        print(note, file=sys.stderr)
    from ..runtime import SamplingParams  # noqa: PLC0415

    # the prefill, with the prompt bar; save_prompt_cache then finds the prompt's entry in the prefix cache
    rid = engine.submit(ids, SamplingParams(max_tokens=1, temperature=0.0))
    bar = PromptProgress(engine, len(ids), bars)
    t0, out = time.perf_counter(), None
    while out is None:
        out = next((d.output for d in engine.step() if d.request_id == rid and d.finished), None)
        bar.update()
    bar.close()
    if out.finish_reason == "error":
        raise RuntimeError(f"the prompt's prefill failed: {out.error}")
    seconds = time.perf_counter() - t0
    request = {"prompt": prompt, "model": args.model, **{dest: getattr(args, dest) for _, dest, _ in CACHED_FLAGS}}
    saved = engine.save_prompt_cache(args.prompt_cache_file, ids, request)
    print(f"Prompt: {len(ids)} tokens, {len(ids) / max(seconds, 1e-9):.3f} tokens-per-sec")
    print(f"Saved {saved.path} ({saved.nbytes / 1e6:.1f} MB)")
    return 0
