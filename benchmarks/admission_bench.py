"""Admission under a short KV pool: the same requests with many slots against one slot.

    python benchmarks/admission_bench.py                                     # Qwen3.5-9B shape, random 4-bit weights
    python benchmarks/admission_bench.py --shape demo --prompt-len 96 --gen-len 64 --block-tokens 16   # CPU run

--requests requests of --prompt-len random tokens each generate --gen-len tokens (EOS ignored) on a pool
of --pool-requests requests' worth of blocks (default 2.5: too short for every slot at once), once with
--slots slots and once with 1. A pool that short used to thrash: victims readmitted at once, recomputed,
preempted again. Printed per run: wall time, preemptions, prefill tokens (prompt tokens computed,
recompute included) and steps; then the time ratio (many slots / one slot; target <= 1.3) and how many
requests' outputs are identical (random bf16 weights have near ties that batching may flip; the CPU
test on float32 weights, tests/test_kv_manager.py, requires all of them).
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

from mtlqwen.runtime import Engine
from mtlqwen.runtime.block_pool import BlockPool

from bench_common import add_model_args, build_model, timed_generate, write_json


def run(model, prompts, slots: int, args, num_blocks: int) -> dict:
    eng = Engine(model, slots=slots, step_tokens=args.step_tokens, block_tokens=args.block_tokens,
                 num_blocks=num_blocks, prefix_interval=0)
    timed_generate(eng, prompts[:1], 4)  # warm-up: kernels built, first-call costs paid
    base = {k: eng.stats()[k] for k in ("preemptions", "prefill_tokens", "steps")}
    outs, wall, _ = timed_generate(eng, prompts, args.gen_len)
    s = eng.stats()
    return {"slots": slots, "wall_s": wall, **{k: s[k] - base[k] for k in base},
            "max_preemptions_per_request": max(o.num_preemptions for o in outs),
            "tokens": [o.token_ids for o in outs]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--slots", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--step-tokens", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--pool-requests", type=float, default=2.5, help="pool size in requests at their longest")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    model, name = build_model(args)
    per = BlockPool.blocks_for(args.prompt_len + args.gen_len - 1, args.block_tokens)
    num_blocks = max(per, int(args.pool_requests * per))
    prompts = mx.random.randint(0, model.config.vocab_size, (args.requests, args.prompt_len),
                                key=mx.random.key(args.seed)).tolist()
    print(f"model: {name} | device: {mx.default_device()} | {args.requests} requests of {args.prompt_len} + "
          f"{args.gen_len} tokens | pool {num_blocks} blocks of {args.block_tokens} ({per} per request) | "
          f"step_tokens {args.step_tokens}", flush=True)
    print(f"{'slots':>5} {'wall s':>8} {'preemptions':>12} {'max/request':>12} {'prefill tokens':>15} {'steps':>6}")
    results = []
    for slots in (args.slots, 1):
        t = time.perf_counter()
        r = run(model, prompts, slots, args, num_blocks)
        results.append(r)
        print(f"{slots:>5} {r['wall_s']:>8.2f} {r['preemptions']:>12} {r['max_preemptions_per_request']:>12} "
              f"{r['prefill_tokens']:>15} {r['steps']:>6}   ({time.perf_counter() - t:.1f} s with warm-up)", flush=True)
    many, one = results
    same = sum(a == b for a, b in zip(many["tokens"], one["tokens"]))
    print(f"time ratio {args.slots} slots / 1 slot: {many['wall_s'] / one['wall_s']:.2f} | "
          f"identical outputs: {same}/{args.requests} requests")
    for r in results:
        del r["tokens"]
    write_json(args.json, name, args, {"runs": results, "ratio": many["wall_s"] / one["wall_s"], "identical": same})
    return 0


if __name__ == "__main__":
    sys.exit(main())
