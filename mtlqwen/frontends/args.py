"""Command-line arguments the front-ends share (generate, chat, serve): the model, quantization and
sampling flags, their validation before anything is loaded, loading the model they name, and the
context rule every front-end applies to a prompt and its reply budget.

Front-ends import this module, never mtlqwen/cli.py (which only assembles the parser).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

MODEL_HELP = (
    "a local checkpoint directory or a Hugging Face repo id (official Qwen3.5/3.6 layout or an "
    "mlx-lm/mlx-community conversion, float or 4/8-bit); omitted: the built-in demo model (the trained "
    "demo pair when the package ships it, else random weights); 'random': the random-weight model"
)


# The demo pair's 18.5M target loops on its greedy path ("return n+n+n+..."); sampled, it writes
# Python-like code, so the built-in demo samples unless --temp / --top-p say otherwise.
DEMO_TEMP, DEMO_TOP_P = 0.7, 0.95


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """The sampling flags shared by generate and chat (mlx-lm's names)."""
    p.add_argument("--max-tokens", "-m", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temp", type=float, default=None,
                   help=f"sampling temperature; 0 is greedy (default 0; {DEMO_TEMP} for the built-in demo model)")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling mass (default 1.0: off; {DEMO_TOP_P} for the built-in demo model)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (reproducible per request)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="lower the logits of tokens already in the reply by this, in [-2, 2] (default 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="lower them by this x their count in the reply, in [-2, 2] (default 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive (multiply negative) logits of tokens in the prompt or reply by this "
                        "(default 1: off); a penalised request does not draft")


def add_model_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--model", required=required, default=None, help=MODEL_HELP)
    p.add_argument("--quantize", default=None, metavar="SPEC",
                   help="quantize a float checkpoint at load: 4bit, 8bit, or e.g. 4bit-g32 (groups 32/64/128); "
                        "needs --model")
    p.add_argument("--tensor-parallel", action="store_true",
                   help="shard the model over the ranks of an mx.distributed launch, e.g. `mlx.launch "
                        "--backend ring -n 2 -- mtlqwen ... --tensor-parallel`; only rank 0 prints or serves")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """The drafter flags (mlx-lm's names accepted too): the checkpoint, drafts a step, its quantization."""
    p.add_argument("--draft", "--draft-model", default=None, metavar="PATH",
                   help="a DFlash drafter checkpoint (directory or repo id) for speculative decoding (default: none, "
                        "or the demo pair's with no --model)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="drafts per speculative step, at most (default: the drafter's block size - 1; the adaptive "
                        "policy sends fewer where they do not pay); needs a drafter")
    p.add_argument("--draft-bits", type=int, choices=[4, 8], default=None,
                   help="quantize the DFlash drafter's projections at load (8 or 4 bits, group 64); needs a drafter "
                        "(--draft, or the demo pair's)")


def draft_kwargs(args, demo_drafter=None) -> dict:
    """Engine keywords of the drafter flags: --draft (else the demo pair's drafter), n_draft, draft_bits."""
    kw = {"draft": args.draft or demo_drafter}
    if args.num_draft_tokens is not None:
        kw["n_draft"] = args.num_draft_tokens
    if args.draft_bits is not None:
        kw["draft_bits"] = args.draft_bits
    return kw


def start_tensor_parallel(args) -> None:
    """--tensor-parallel: join the launched group (args.group; None without the flag). Ranks other than 0
    print nothing on standard output and show no progress bars; their errors still reach standard error."""
    args.group = None
    if not getattr(args, "tensor_parallel", False):
        return
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from ..model.distributed import tensor_parallel_group  # noqa: PLC0415

    args.group = tensor_parallel_group()
    if args.group.rank() != 0:
        args.quiet = True
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the life of the process)


def add_warmup_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="before serving, run a small throwaway workload so that the GPU kernels the first "
                        "requests need are compiled (MLX compiles each at first use, seconds on CUDA); "
                        "auto (default): when the GPU kernels run; skipped under --tensor-parallel")


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """A byte count as a flag takes it: 1073741824, 512MB, 4GiB, 1.5G (decimal units, or binary with 'i')."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MB, 4GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def add_prefix_cache_bytes_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-cache-bytes", type=parse_bytes, default=None, metavar="SIZE",
                   help="memory the prefix cache's snapshots may hold, e.g. 4GiB (default 1GiB; at least one snapshot, "
                        "~49 MiB of GDN state for the 9B); least recently used entries are evicted beyond it")


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (they are also off when standard error is not a terminal)")


def check_model_args(args) -> None:
    """Flags that cannot apply are errors, found before the model loads."""
    if args.quantize is not None:
        if args.model is None or args.model == "random":
            raise ValueError("--quantize needs a checkpoint --model (the built-in models are not quantized at load)")
        from ..model.quantize import parse_quantize_arg  # noqa: PLC0415

        parse_quantize_arg(args.quantize)
    check_draft_args(args)


def check_draft_args(args) -> None:
    """--draft-bits and --num-draft-tokens apply to a drafter: --draft's, or the demo pair's when no --model is given."""
    has_drafter = getattr(args, "draft", None) or args.model is None
    for flag, dest in (("--draft-bits", "draft_bits"), ("--num-draft-tokens", "num_draft_tokens")):
        if getattr(args, dest, None) is not None and not has_drafter:
            raise ValueError(f"{flag} needs a drafter: --draft PATH, or the demo pair's (no --model)")
    n = getattr(args, "num_draft_tokens", None)
    if n is not None and n < 1:
        raise ValueError(f"--num-draft-tokens must be at least 1, got {n}")


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


def read_template_file(path: str) -> str:
    """--chat-template: a Jinja template file's source (ValueError naming the flag when it cannot be read)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template: cannot read {path}: {e}") from None
    if not text.strip():
        raise ValueError(f"--chat-template: {path} is empty")
    return text


SAMPLING_FLAGS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                  "max_tokens": "--max-tokens", "seed": "--seed", "presence_penalty": "--presence-penalty",
                  "frequency_penalty": "--frequency-penalty", "repetition_penalty": "--repetition-penalty"}


def penalty_args(args) -> dict:
    return {k: getattr(args, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")}


def sampling_defaults(args) -> tuple[float, float]:
    """(temperature, top_p) from the flags, a flag left out taking the default of the model run: the
    built-in demo's (no --model) or greedy."""
    demo = getattr(args, "model", None) is None
    temp = args.temp if args.temp is not None else (DEMO_TEMP if demo else 0.0)
    top_p = args.top_p if args.top_p is not None else (DEMO_TOP_P if demo else 1.0)
    return temp, top_p


def sampling_from_args(args):
    """SamplingParams from the flags; a value out of range fails here, before the model loads, and
    the error names the flag as well as the field."""
    from ..runtime import SamplingParams  # noqa: PLC0415

    temp, top_p = sampling_defaults(args)
    try:
        return SamplingParams(temperature=temp, top_p=top_p, top_k=args.top_k, min_p=args.min_p,
                              max_tokens=args.max_tokens, seed=args.seed, **penalty_args(args))
    except ValueError as e:
        flag = SAMPLING_FLAGS.get(str(e).split(maxsplit=1)[0])
        raise ValueError(f"{flag}: {e}" if flag else str(e)) from None


def load_model_and_tokenizer(args, progress=None):
    """(model, tokenizer, note, drafter): the checkpoint's (drafter None: --draft names one), or a built-in
    model (mtlqwen.demo): with no --model the trained demo pair and its drafter when the package ships
    it, else the random-weight model; `--model random` the random-weight model with a byte tokenizer.
    progress: called as progress(done_bytes, total_bytes) while the checkpoint's tensors load.
    With --tensor-parallel (args.group, start_tensor_parallel), this rank's shard of the model."""
    from ..demo import is_builtin, load_builtin  # noqa: PLC0415

    group = getattr(args, "group", None)
    if is_builtin(args.model):
        b = load_builtin(args.model)
        model, drafter = b.model, b.drafter
        if group is not None:  # the same weights on every rank: each keeps its shard (the drafter reads it)
            from ..model.loading import shard_model  # noqa: PLC0415

            model = shard_model(model.config, model.weights, group)
            if drafter is not None:
                drafter.target = model
        return model, b.tokenizer, b.note, drafter
    from .. import load, load_tokenizer  # noqa: PLC0415

    model = load(args.model, quantize=args.quantize, progress=progress, group=group)
    return model, load_tokenizer(args.model), None, None


def load_with_bar(args, bars: bool):
    """load_model_and_tokenizer with the loading bar (bytes) on stderr when `bars`."""
    from .terminal import Bar  # noqa: PLC0415

    bar = Bar("loading", enabled=bars)
    try:
        return load_model_and_tokenizer(args, progress=bar.update)
    finally:
        bar.close()


def check_max_tokens(max_tokens: int, context: int) -> None:
    """A reply budget that no prompt leaves room for is refused at start-up."""
    if max_tokens >= context:
        raise ValueError(f"--max-tokens {max_tokens} does not fit the model's context of {context} tokens "
                         f"(the prompt and the reply share it): use --max-tokens {context - 1} or less")


def fit_reply(prompt_tokens: int, max_tokens: int, context: int, hint: str) -> tuple[int, str | None]:
    """The context rule of the CLI front-ends: (max_tokens to ask for, a note when it was trimmed).
    A prompt that fills the context is refused with `hint` (what the user can do about it); a reply
    budget that overflows it is trimmed to the room left, and the note says so."""
    room = context - prompt_tokens
    if room < 1:
        raise ValueError(f"the prompt ({prompt_tokens} tokens) fills the model's context of {context} tokens: {hint}")
    if max_tokens <= room:
        return max_tokens, None
    return room, (f"reply limited to {room} tokens: the prompt ({prompt_tokens} tokens) and the reply share "
                  f"the model's context of {context} tokens")
