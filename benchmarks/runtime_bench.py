"""Runtime benchmark: aggregate decode tok/s and time to first token at 1, 4 and 8 concurrent requests.

    python benchmarks/runtime_bench.py                          # Qwen3.5-9B shape, random weights, 4-bit g64
    python benchmarks/runtime_bench.py --model PATH             # a real checkpoint
    python benchmarks/runtime_bench.py --shape demo --prompt-len 64 --gen-len 16   # quick CPU smoke run

Each concurrency level submits that many requests of random prompt tokens at once (EOS ignored, so
every request generates exactly --gen-len tokens) and runs them to completion, --repeats times after a
warm-up that compiles the kernels. Reported per level (medians over repeats):
  decode tok/s   sum over requests of (generated - 1) / (last finish - first first-token): the
                 aggregate rate once requests are decoding (prefill of later requests overlaps it)
  output tok/s   generated tokens / wall time, prefill included
  TTFT           submission -> first token read back, mean and max over the requests
  prefill tok/s  prompt tokens / time until the last request's first token
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from mtlqwen.runtime import Engine
from mtlqwen.runtime.block_pool import BlockPool

from bench_common import add_model_args, build_model, timed_generate, ttft_ms, write_json


def run_level(engine: Engine, concurrency: int, prompt_len: int, gen_len: int, seed: int) -> dict:
    vocab = engine.config.vocab_size
    key = mx.random.key(seed)
    prompts = mx.random.randint(0, vocab, (concurrency, prompt_len), key=key).tolist()
    outs, wall, first = timed_generate(engine, prompts, gen_len)
    finish = [o.total_time for o in outs]  # all submitted at t0 (to within microseconds)
    decode_span = max(finish) - min(first)
    gen = sum(len(o.token_ids) for o in outs)
    return {
        "decode_tok_s": sum(len(o.token_ids) - 1 for o in outs) / decode_span if decode_span > 0 else float("nan"),
        "output_tok_s": gen / wall,
        **ttft_ms(first),
        "prefill_tok_s": concurrency * prompt_len / max(first),
        "wall_s": wall,
    }


def median_level(engine: Engine, concurrency: int, prompt_len: int, gen_len: int, repeats: int,
                 seed: int = 0, discard: int = 0) -> dict:
    """run_level `repeats` times (seeds seed, seed + 1, ...: fresh prompts, no prefix hits between them), each
    figure's median, after `discard` untimed runs of the level (other seeds): a level's first run pays the
    first-use compiles of its shapes, which the warm-up's smaller prompts do not reach."""
    for d in range(discard):
        run_level(engine, concurrency, prompt_len, gen_len, seed=seed + 500 + d)
    runs = [run_level(engine, concurrency, prompt_len, gen_len, seed=seed + r) for r in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--discard", type=int, default=1, metavar="N",
                    help="untimed runs of each level before its repeats (first-use compiles out of the medians)")
    ap.add_argument("--step-tokens", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--pad-buckets", choices=["on", "off"], default="off")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",")]
    t = time.perf_counter()
    model, name = build_model(args)
    load_s = time.perf_counter() - t
    slots = max(levels)
    # a pool just big enough for every level, instead of the device-sized default
    blocks = slots * BlockPool.blocks_for(args.prompt_len + args.gen_len, args.block_tokens)
    pad = args.pad_buckets == "on"
    engine = Engine(model, slots=slots, step_tokens=max(args.step_tokens, slots), block_tokens=args.block_tokens,
                    num_blocks=blocks, pad_buckets=pad)
    print(f"model: {name} (built/loaded in {load_s:.1f} s) | device: {mx.default_device()} | "
          f"slots {slots}, step_tokens {engine.step_tokens}, block_tokens {args.block_tokens}, "
          f"pool {blocks} blocks, pad_buckets {engine.pad_buckets}", flush=True)
    print(f"prompt {args.prompt_len} tokens, generate {args.gen_len} tokens, {args.repeats} repeats (median) after {args.discard} untimed", flush=True)

    t = time.perf_counter()
    run_level(engine, slots, min(args.prompt_len, 2 * args.step_tokens), min(args.gen_len, 8), seed=999)
    print(f"warm-up: {time.perf_counter() - t:.1f} s", flush=True)

    results = []
    header = f"{'conc':>4} {'decode tok/s':>13} {'output tok/s':>13} {'TTFT mean ms':>13} {'TTFT max ms':>12} {'prefill tok/s':>14}"
    print(header)
    for c in levels:
        mx.reset_peak_memory()
        med = median_level(engine, c, args.prompt_len, args.gen_len, args.repeats, discard=args.discard)
        med.update(concurrency=c, peak_memory_gb=mx.get_peak_memory() / 1e9)
        results.append(med)
        print(f"{c:>4} {med['decode_tok_s']:>13.1f} {med['output_tok_s']:>13.1f} {med['ttft_mean_ms']:>13.1f} "
              f"{med['ttft_max_ms']:>12.1f} {med['prefill_tok_s']:>14.1f}", flush=True)
    print(f"peak memory: {max(r['peak_memory_gb'] for r in results):.2f} GB | engine stats: "
          f"{ {k: engine.stats()[k] for k in ('steps', 'preemptions', 'padding_tokens')} }")
    write_json(args.json, name, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
