"""`mtlqwen` / `python -m mtlqwen`: generate, cache-prompt, benchmark, convert, chat, serve and run-batch.

This file only builds the parser and runs the chosen subcommand: generate, chat and serve live in
mtlqwen/frontends/ (their shared flags in frontends/args.py). Errors a user can fix (a wrong path, a
bad checkpoint, a flag that cannot apply) are printed as one line, `mtlqwen COMMAND: error: ...`,
not a traceback.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .frontends.args import MODEL_HELP, add_quiet_arg



def cmd_convert(args) -> int:
    from .frontends.terminal import Stages, progress_enabled  # noqa: PLC0415
    from .model.convert import convert  # noqa: PLC0415

    stages = Stages(progress_enabled(args.quiet))
    try:
        out = convert(args.src, args.dst, quantize=args.quantize, progress=stages)
    finally:
        stages.close()
    print(f"wrote {out}")
    return 0


def _version() -> str:
    import mlx.core as mx  # noqa: PLC0415

    return f"mtlqwen {__version__} (mlx {mx.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtlqwen",
        description="Fast, property-tested inference for the Qwen3.5 family on MLX (Metal, CUDA, CPU).",
    )
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="run `mtlqwen COMMAND --help` for its flags")
    from .frontends import benchmark, cache_prompt, chat, generate, run_batch, server  # noqa: PLC0415  each registers itself

    generate.register(sub)
    cache_prompt.register(sub)
    benchmark.register(sub)

    c = sub.add_parser("convert", help="write an MLX-format (optionally quantized) checkpoint",
                       description="Convert a Hugging Face checkpoint to mlx-lm's layout, optionally quantized.")
    c.add_argument("src", help=MODEL_HELP)
    c.add_argument("dst", help="output directory (must not exist or be empty)")
    c.add_argument("--quantize", "-q", default=None, metavar="SPEC", help="4bit, 8bit, or e.g. 4bit-g32")
    add_quiet_arg(c)
    c.set_defaults(func=cmd_convert)

    chat.register(sub)
    server.register(sub)
    run_batch.register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .model import CheckpointError, ConfigError  # noqa: PLC0415

    try:
        from .frontends.args import start_tensor_parallel  # noqa: PLC0415

        start_tensor_parallel(args)
        return args.func(args)
    except (OSError, CheckpointError, ConfigError, ValueError) as e:  # OSError: missing paths, unwritable logs
        print(f"mtlqwen {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
