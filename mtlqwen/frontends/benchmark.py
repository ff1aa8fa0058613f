"""`mtlqwen benchmark`: prompt and generation throughput on random prompts, mlx-lm's `mlx_lm.benchmark` (and
llama-bench's pp / tg) for this engine: B requests of P random tokens each, submitted together, each generating G
tokens (EOS ignored, greedy), over N trials after one untimed warm-up trial (the GPU kernels compile at first use).

Per trial: prompt_tps = the B x P prompt tokens over the time until every request has its first token;
generation_tps = the tokens generated after each request's first over the time from then to the last finish;
peak_memory = MLX's peak over the trial. Each trial draws new prompts, so no trial restores another's prefix.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from .args import add_draft_args, add_model_args, add_quiet_arg, check_model_args, draft_kwargs, load_with_bar
from .terminal import progress_enabled


def register(subparsers) -> None:
    b = subparsers.add_parser(
        "benchmark", help="prompt and generation tokens/s on random prompts (mlx_lm.benchmark's report)",
        description="Time prompt processing and generation on random prompts: --batch-size requests of "
                    "--prompt-tokens tokens submitted together, each generating --generation-tokens tokens (EOS "
                    "ignored, greedy), over --num-trials trials after one untimed warm-up trial.")
    add_model_args(b)
    add_draft_args(b)
    for flag, short, default, what in (("--prompt-tokens", "-p", 512, "tokens per prompt"),
                                       ("--generation-tokens", "-g", 128, "tokens generated per request"),
                                       ("--batch-size", "-b", 1, "requests run together"),
                                       ("--num-trials", "-n", 5, "timed trials, averaged")):
        b.add_argument(flag, short, type=int, default=default, help=f"{what} (default {default})")
    add_quiet_arg(b)
    b.set_defaults(func=cmd_benchmark)


def _check(args) -> None:
    for flag, v in (("--prompt-tokens", args.prompt_tokens), ("--generation-tokens", args.generation_tokens),
                    ("--batch-size", args.batch_size), ("--num-trials", args.num_trials)):
        if v < 1:
            raise ValueError(f"{flag} must be at least 1, got {v}")


def trial(engine, prompts: list[list[int]], gen: int) -> dict:
    """One timed run of the prompts to completion: prompt_tps, generation_tps (tokens/s), peak_memory (GB), and
    generation_tokens (the tokens generation_tps counts)."""
    import mlx.core as mx  # noqa: PLC0415

    from ..runtime import SamplingParams  # noqa: PLC0415

    mx.synchronize()
    mx.reset_peak_memory()
    sp = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = {engine.submit(p, sp) for p in prompts}
    started: set = set()
    first_at = None
    generated = 0
    finished = 0
    while finished < len(ids):
        for d in engine.step():
            if d.request_id not in ids:
                continue
            if d.token_ids and d.request_id not in started:
                started.add(d.request_id)
                generated -= 1  # a request's first token belongs to its prompt's time
                if len(started) == len(ids):
                    first_at = time.perf_counter()
            generated += len(d.token_ids)
            if d.finished:
                finished += 1
                if d.output.finish_reason == "error":
                    raise RuntimeError(f"a benchmark request failed: {d.output.error}")
    done = time.perf_counter()
    first_at = first_at or done
    return {"prompt_tps": sum(map(len, prompts)) / max(first_at - t0, 1e-9),
            "generation_tps": generated / max(done - first_at, 1e-9) if generated else 0.0,
            "peak_memory": mx.get_peak_memory() / 1e9, "generation_tokens": generated}


def _line(r: dict) -> str:
    return (f"prompt_tps={r['prompt_tps']:.3f}, generation_tps={r['generation_tps']:.3f}, "
            f"peak_memory={r['peak_memory']:.3f}")


def cmd_benchmark(args) -> int:
    from ..runtime import Engine  # noqa: PLC0415

    if args.tensor_parallel:
        raise ValueError("benchmark does not run under --tensor-parallel")
    _check(args)
    check_model_args(args)
    model, tok, note, drafter = load_with_bar(args, progress_enabled(args.quiet))
    B, P, G = args.batch_size, args.prompt_tokens, args.generation_tokens
    engine = Engine(model, tokenizer=tok, slots=B, **draft_kwargs(args, drafter))
    if P + G > engine.max_model_len:
        raise ValueError(f"--prompt-tokens {P} and --generation-tokens {G} do not fit the model's context of "
                         f"{engine.max_model_len} tokens")
    if note:
        print(note, file=sys.stderr)
    rng = random.Random(0)
    vocab = model.config.vocab_size

    def prompts():
        return [[rng.randrange(vocab) for _ in range(P)] for _ in range(B)]

    print(f"Running warmup: {B} x {P} prompt tokens, {G} generated each")
    trial(engine, prompts(), G)
    rows = []
    for i in range(args.num_trials):
        rows.append(trial(engine, prompts(), G))
        print(f"Trial {i + 1}: {_line(rows[-1])}", flush=True)
    print(f"Averages: {_line({k: statistics.mean(r[k] for r in rows) for k in rows[0]})}")
    return 0
