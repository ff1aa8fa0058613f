"""`mtlqwen` / `python -m mtlqwen`: generate, convert, chat and serve.

Each subcommand lives in its own module; this file only builds the parser. Errors a user can fix
(a wrong path, a bad checkpoint, a bad flag value) are printed as one line, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MODEL_HELP = (
    "a local checkpoint directory or a Hugging Face repo id (official Qwen3.5/3.6 layout or an "
    "mlx-lm/mlx-community conversion, float or 4/8-bit)"
)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """The sampling flags shared by generate and chat (mlx-lm's names)."""
    p.add_argument("--max-tokens", "-m", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (reproducible per request)")


def add_model_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--model", required=required, default=None, help=MODEL_HELP)
    p.add_argument("--quantize", default=None, metavar="SPEC",
                   help="quantize a float checkpoint at load: 4bit, 8bit, or e.g. 4bit-g32 (groups 32/64/128)")


def parse_template_args(text: str | None) -> dict:
    """--chat-template-args: a JSON object of extra chat-template variables (e.g. enable_thinking)."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-args is not valid JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-args must be a JSON object")
    return kwargs


def sampling_from_args(args):
    from .runtime import SamplingParams  # noqa: PLC0415

    return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          max_tokens=args.max_tokens, seed=args.seed)


def load_model_and_tokenizer(args):
    """(model, tokenizer, note): the checkpoint's, or the built-in random demo model with a byte tokenizer."""
    if args.model is None:
        from .model.builtin import ByteTokenizer, random_model  # noqa: PLC0415

        note = ("No --model given: running the small built-in Qwen3.5 model with RANDOM weights "
                "(its text is meaningless; it shows the engine works). Pass --model for a real checkpoint.")
        return random_model(), ByteTokenizer(), note
    from . import load, load_tokenizer  # noqa: PLC0415

    model = load(args.model, quantize=args.quantize)
    return model, load_tokenizer(args.model), None


def _read_prompt(p: str) -> str:
    return sys.stdin.read() if p == "-" else p.replace("\\n", "\n").replace("\\t", "\t")


def cmd_generate(args) -> int:
    import mlx.core as mx  # noqa: PLC0415

    from .runtime import Engine  # noqa: PLC0415

    model, tok, note = load_model_and_tokenizer(args)
    if note:
        print(note, file=sys.stderr)
    prompt = _read_prompt(args.prompt)
    if args.model is not None and not args.ignore_chat_template and getattr(tok, "chat_template", None):
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        kwargs = parse_template_args(args.chat_template_args)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    else:
        ids = tok.encode(prompt)
    engine = Engine(model, tokenizer=tok, slots=1)
    sampling = sampling_from_args(args)
    t0 = time.perf_counter()
    out = None
    print("=" * 10)
    for delta in engine.stream([ids], sampling):
        print(delta.text, end="", flush=True)
        if delta.finished:
            out = delta.output
    print("\n" + "=" * 10)
    if out is None or out.finish_reason == "error":
        print(f"error: {out.error if out else 'no output'}", file=sys.stderr)
        return 1
    total = time.perf_counter() - t0
    n = len(out.token_ids)
    ttft = out.ttft or total
    gen_time = max(total - ttft, 1e-9)
    print(f"Prompt: {out.prompt_tokens} tokens, {out.prompt_tokens / max(ttft, 1e-9):.3f} tokens-per-sec")
    print(f"Generation: {n} tokens, {max(n - 1, 0) / gen_time:.3f} tokens-per-sec")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    return 0


def cmd_convert(args) -> int:
    from .model.convert import convert  # noqa: PLC0415

    out = convert(args.src, args.dst, quantize=args.quantize)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtlqwen",
        description="Fast, property-tested inference for the Qwen3.5 family on MLX (Metal, CUDA, CPU).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser("generate", help="generate a completion for one prompt and report tokens/s",
                       description="Generate a completion. With no --model, a small random-weight model runs.")
    add_model_args(g)
    g.add_argument("--prompt", "-p", default="Hello, Qwen!", help="the prompt; '-' reads standard input")
    g.add_argument("--system-prompt", default=None, help="system message for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as is, without the chat template")
    g.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help='extra chat template arguments, e.g. \'{"enable_thinking": false}\'')
    add_sampling_args(g, max_tokens=100)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="write an MLX-format (optionally quantized) checkpoint",
                       description="Convert a Hugging Face checkpoint to mlx-lm's layout, optionally quantized.")
    c.add_argument("src", help=MODEL_HELP)
    c.add_argument("dst", help="output directory (must not exist or be empty)")
    c.add_argument("--quantize", "-q", default=None, metavar="SPEC", help="4bit, 8bit, or e.g. 4bit-g32")
    c.set_defaults(func=cmd_convert)

    for module in ("chat", "server"):  # frontends register their own subcommands
        try:
            mod = __import__(f"mtlqwen.frontends.{module}", fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .model import CheckpointError, ConfigError  # noqa: PLC0415

    try:
        return args.func(args)
    except (FileNotFoundError, FileExistsError, CheckpointError, ConfigError, ValueError) as e:
        print(f"mtlqwen {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
