"""Tensor parallel against one device: greedy tokens, decode and prefill tok/s, memory per device.

One process on one device (the reference), or every rank of a launched group (--group), runs the same
workload on random weights of --shape and writes one JSON (rank 0; memory is gathered from every rank):
  greedy   --prompts prompts, --greedy-len tokens each, and at every generated position the model's
           top-2 logits (teacher-forced, model.logits): where two runs part, --compare says whether the
           first differing token was a near-tie (top-2 gap under --tie of the top logit)
  decode   aggregate decode tok/s at each --levels concurrency (runtime_bench.run_level; median of --repeats)
  prefill  one --prefill-token prompt, 1 token generated: prompt tokens / time to first token
  memory   per rank: weight and cache-pool bytes, active memory after the build, the build's peak, and the
           peak over the runs after it
--only generate: load and generate --greedy-len tokens for two prompts, no timings (a shape too large for
one device). All of it on nvidia-h200-x2: benchmarks/tp_two_gpu.sh.

    CUDA_VISIBLE_DEVICES=0 python benchmarks/tp_bench.py --json one.json
    mlx.launch --backend nccl --hosts 127.0.0.1 -n 2 --env NCCL_NVLS_ENABLE=0 -- \\
        python benchmarks/tp_bench.py --group --json two.json
    python benchmarks/tp_bench.py --compare one.json two.json
    # the plumbing on a CPU (ring back-end, the demo shape):
    python benchmarks/tp_bench.py --shape demo --bits 0 --levels 1,2 --prefill 64 --gen-len 8 --json one.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from mtlqwen.model import QuantSpec, builtin
from mtlqwen.model.distributed import tensor_parallel_group
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.block_pool import BlockPool

from runtime_bench import median_level, run_level

GREEDY_PROMPT_MAX = 320  # the greedy prompts' lengths: 48 up to this


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(48, GREEDY_PROMPT_MAX))).tolist() for _ in range(n)]


def greedy(model, engine: Engine, n_prompts: int, gen_len: int) -> list[dict]:
    """Each prompt's greedy tokens, and per generated position the teacher-forced top-2 (tokens, logits)."""
    prompts = _prompts(n_prompts, model.full_config.vocab_size, seed=7)  # full_config: the whole model's
    outs = engine.generate(prompts, SamplingParams(max_tokens=gen_len, ignore_eos=True))
    rows = []
    for p, o in zip(prompts, outs):
        lg = model.logits(p + o.token_ids[:-1])[len(p) - 1:].astype(mx.float32)  # [gen, vocab]
        top = mx.argsort(-lg, axis=-1)[:, :2]
        vals = mx.take_along_axis(lg, top, axis=-1)
        rows.append({"prompt_len": len(p), "tokens": o.token_ids, "top2": top.tolist(), "top2_logits": vals.tolist()})
    return rows


def _memory(model, engine, group, build: tuple[float, float]) -> list[dict]:
    mine = mx.array([sum(v.nbytes for v in model.weights.values()), sum(a.nbytes for a in engine.cache.arrays()),
                     *build, mx.get_peak_memory()], dtype=mx.float32) / 1e9
    rows = mine[None] if group is None else mx.distributed.all_gather(mine[None], group=group)
    keys = ("weights_gb", "cache_gb", "active_after_build_gb", "build_peak_gb", "peak_gb")
    return [dict(zip(keys, (round(float(v), 3) for v in r))) for r in rows.tolist()]


def run(args) -> dict:
    group = tensor_parallel_group(args.backend) if args.group else None  # a clear error when not launched
    config = builtin.SHAPES[args.shape]()
    t = time.perf_counter()
    model = builtin.random_model(config=config, seed=0, quantize=QuantSpec(args.bits, args.group_size) if args.bits
                                 else None, group=group)
    build_s = time.perf_counter() - t
    build = (mx.get_active_memory(), mx.get_peak_memory())  # the peak: a whole tensor drawn before its cut
    levels = [int(c) for c in args.levels.split(",")] if args.only != "generate" else [2]
    per_seq = max(args.prompt_len + args.gen_len, GREEDY_PROMPT_MAX + args.greedy_len)
    prefill = args.prefill + 1 if args.only != "generate" else 0
    # a pool for the widest level, or the one long prefill, whichever needs more (not the device-sized default)
    blocks = max(max(levels) * BlockPool.blocks_for(per_seq, 128), BlockPool.blocks_for(prefill, 128))
    engine = Engine(model, slots=max(levels), block_tokens=128, num_blocks=blocks, seed=0)
    report = {"shape": args.shape, "bits": args.bits, "ranks": 1 if group is None else group.size(),
              "device": str(mx.default_device()), "build_s": round(build_s, 1)}
    mx.reset_peak_memory()
    t = time.perf_counter()
    report["greedy"] = greedy(model, engine, 2 if args.only == "generate" else args.prompts, args.greedy_len)
    report["greedy_s"] = round(time.perf_counter() - t, 1)
    if args.only != "generate":
        run_level(engine, max(levels), min(args.prompt_len, 256), min(args.gen_len, 8), seed=999)  # warm-up
        report["decode"] = {str(c): median_level(engine, c, args.prompt_len, args.gen_len, args.repeats, 100 * c)
                            for c in levels}
        pre = median_level(engine, 1, args.prefill, 1, args.repeats, 10_000)
        report["prefill"] = {"tokens": args.prefill, "ttft_ms": pre["ttft_max_ms"],
                             "tok_s": args.prefill / (pre["ttft_max_ms"] / 1e3)}
    report["memory"] = _memory(model, engine, group, build)
    return report if group is None or group.rank() == 0 else {}


def near_tie(row: dict, pos: int, other_token: int, tie: float) -> bool:
    """Whether `other_token` was this run's runner-up at `pos`, within `tie` of the top logit."""
    (_, b), (la, lb) = row["top2"][pos], row["top2_logits"][pos]
    return b == other_token and (la - lb) <= tie * max(abs(la), 1e-6)


def compare(one: dict, two: dict, tie: float) -> tuple[str, bool]:
    """A table of `two` (tensor parallel) beside `one` (one device), and whether greedy tokens agree."""
    lines = [f"{one['shape']} {one['bits'] or 16}-bit: {one['ranks']} device(s) against {two['ranks']} ranks", "",
             f"| | {one['ranks']} device | {two['ranks']} ranks | ratio |", "|---|---|---|---|"]
    for c in sorted(set(one.get("decode", {})) & set(two.get("decode", {})), key=int):
        a, b = one["decode"][c]["decode_tok_s"], two["decode"][c]["decode_tok_s"]
        lines.append(f"| decode tok/s, {c} concurrent | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    if "prefill" in one and "prefill" in two:
        a, b = one["prefill"]["tok_s"], two["prefill"]["tok_s"]
        lines.append(f"| prefill tok/s, {one['prefill']['tokens']} tokens | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    for k in ("weights_gb", "cache_gb", "build_peak_gb", "peak_gb"):
        per = "/".join(f"{m[k]:.2f}" for m in two["memory"])
        lines.append(f"| {k[:-3]} GB per device | {one['memory'][0][k]:.2f} | {per} | |")
    ok = True
    lines.append("")
    for i, (r1, r2) in enumerate(zip(one["greedy"], two["greedy"])):
        t1, t2 = r1["tokens"], r2["tokens"]
        d = next((j for j, (x, y) in enumerate(zip(t1, t2)) if x != y), None)
        if d is None:
            lines.append(f"greedy prompt {i} ({r1['prompt_len']} tokens): {len(t1)} tokens equal")
            continue
        tied = near_tie(r1, d, t2[d], tie) or near_tie(r2, d, t1[d], tie)
        ok &= tied
        lines.append(f"greedy prompt {i}: part at token {d} of {len(t1)} ({t1[d]} against {t2[d]}): "
                     + ("a near-tie" if tied else "NOT a near-tie"))
    return "\n".join(lines), ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(builtin.SHAPES), default="9b")
    ap.add_argument("--bits", type=int, default=4, help="quantize the random weights (0: bf16)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--group", action="store_true", help="join the launched group (mlx.launch) and shard over it")
    ap.add_argument("--backend", default="any", help="mx.distributed back-end for --group (nccl, ring, any)")
    ap.add_argument("--only", choices=["all", "generate"], default="all")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--greedy-len", type=int, default=32)
    ap.add_argument("--levels", default="1,8,32", help="decode concurrencies")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="rank 0 writes the report here")
    ap.add_argument("--compare", nargs=2, metavar=("ONE", "TWO"), help="print two reports side by side and exit")
    ap.add_argument("--tie", type=float, default=0.02,
                    help="near-tie: a top-2 gap of at most this fraction of the top logit")
    args = ap.parse_args(argv)
    if args.compare:
        one, two = (json.loads(open(p).read()) for p in args.compare)
        table, ok = compare(one, two, args.tie)
        print(table)
        return 0 if ok else 1
    report = run(args)
    if report:
        print(json.dumps({k: v for k, v in report.items() if k != "greedy"}, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
