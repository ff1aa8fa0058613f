"""Prefix-cache benchmark: requests sharing a long system prompt, with the cache off and on.

    python benchmarks/prefix_cache_bench.py                     # Qwen3.5-9B shape, random weights, 4-bit g64
    python benchmarks/prefix_cache_bench.py --shape demo --system-len 96 --question-len 8 \\
        --interval 32 --block-tokens 16 --gen-len 4 --repeats 1  # quick CPU smoke run

--requests requests (8) of --system-len shared tokens (2048) + --question-len distinct tokens (64) are
submitted at once and run to completion (EOS ignored: each generates exactly --gen-len tokens). Modes:
  off    prefix_interval=0
  cold   the cache on but empty: every request computes the system prompt (they arrive together, so none
         can hit); shows what boundary-cut chunks and snapshot captures cost
  warm   the cache on, after one earlier request with the same system prompt (another question) put
         the system prompt's snapshots in: each request restores the longest one and computes the rest
Before the modes, one short generate compiles the kernels. Reported per mode (median over --repeats):
TTFT mean and max over the requests, total wall time, prompt tokens served from the cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

import mtlqwen
from mtlqwen.model import QuantSpec
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.block_pool import BlockPool


def build_model(args):
    if args.model:
        return mtlqwen.load(args.model), args.model
    from mtlqwen.model import builtin  # noqa: PLC0415

    config = builtin.qwen35_9b_config() if args.shape == "9b" else builtin.demo_config()
    quant = QuantSpec(args.bits, args.group_size) if args.bits else None
    model = builtin.random_model(config=config, seed=0, quantize=quant)
    return model, f"random {args.shape} ({f'{args.bits}-bit g{args.group_size}' if quant else 'bf16'})"


def tokens(rng, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, size=n)]


def run(engine: Engine, prompts: list[list[int]], gen_len: int) -> dict:
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    ttft = [o.ttft for o in outs]
    return {"ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_max_ms": 1e3 * max(ttft), "wall_s": wall,
            "hit_tokens": sum(o.cached_tokens for o in outs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or repo id; default: random weights of --shape")
    ap.add_argument("--shape", choices=["9b", "demo"], default="9b")
    ap.add_argument("--bits", type=int, default=4, help="quantize random weights (0: bf16)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--interval", type=int, default=512, help="prefix_interval when the cache is on")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-tokens", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--modes", default="off,cold,warm")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    t = time.perf_counter()
    model, name = build_model(args)
    print(f"model: {name} (built/loaded in {time.perf_counter() - t:.1f} s) | device: {mx.default_device()}", flush=True)
    vocab, n = model.config.vocab_size, args.requests
    rng = np.random.default_rng(0)
    system = tokens(rng, args.system_len, vocab)
    prompt_len = args.system_len + args.question_len
    # room for every request, plus the entries' references to the system prompt's blocks
    blocks = (n + 2) * BlockPool.blocks_for(prompt_len + args.gen_len, args.block_tokens)
    print(f"{n} requests x ({args.system_len} shared + {args.question_len} own) tokens, generate {args.gen_len}; "
          f"interval {args.interval}, step_tokens {args.step_tokens}, block_tokens {args.block_tokens}, pool {blocks} blocks, "
          f"{args.repeats} repeats (median)", flush=True)

    results = {}
    header = f"{'mode':>5} {'TTFT mean ms':>13} {'TTFT max ms':>12} {'total s':>9} {'hit tokens':>11} {'prompt tok':>11}"
    for mode in args.modes.split(","):
        interval = 0 if mode == "off" else args.interval
        engine = Engine(model, slots=n, step_tokens=max(args.step_tokens, n), block_tokens=args.block_tokens,
                        num_blocks=blocks, prefix_interval=interval)
        warm = tokens(np.random.default_rng(999), min(prompt_len, 2 * args.step_tokens), vocab)
        engine.generate([warm] * n, SamplingParams(max_tokens=2, ignore_eos=True))  # compile the kernels
        runs = []
        for r in range(args.repeats):
            engine.clear_prefix_cache()
            qrng = np.random.default_rng(1 + r)
            if mode == "warm":  # an earlier request with the same system prompt
                engine.generate([system + tokens(qrng, args.question_len, vocab)], SamplingParams(max_tokens=1))
            prompts = [system + tokens(qrng, args.question_len, vocab) for _ in range(n)]
            runs.append(run(engine, prompts, args.gen_len))
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        med["stats"] = {k: v for k, v in engine.stats().items() if k.startswith("prefix_") or k == "preemptions"}
        results[mode] = med
        if len(results) == 1:
            print(header)
        print(f"{mode:>5} {med['ttft_mean_ms']:>13.1f} {med['ttft_max_ms']:>12.1f} {med['wall_s']:>9.2f} "
              f"{med['hit_tokens']:>11.0f} {n * prompt_len:>11}", flush=True)
        del engine
    for mode, med in results.items():
        print(f"{mode} engine stats: {med['stats']}")
    if "off" in results and "warm" in results:
        off, on = results["off"], results["warm"]
        print(f"warm vs off: TTFT mean {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x, "
              f"total {off['wall_s'] / on['wall_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
