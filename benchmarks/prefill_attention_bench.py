"""Prefill attention over paged KV: the tensor-core prefill kernel (mtlqwen/kernels/attention/prefill.py)
against the current path (the decode kernel, attention/kernels.py), one attention layer at the Qwen3.5-9B
shape (16 query heads, 4 KV heads, head_dim 256, bf16 pools of 128-token blocks, the gate read in place
from the q|gate projection).

A causal prefill of --tokens (default 32k) in chunks of --chunk queries (1024 / 4096): chunk i has i*chunk
cached keys plus its own (the pools are filled up front, the block table shuffled, so the kernel reads the
same keys it would in a real prefill). Each chunk is timed as a chain of --links launches, each launch's q
made to depend on the previous launch's output (mx.depends: no extra kernel), so launches cannot overlap:
device time from CUPTI (qgemm_bench.chain_time: the union of the kernels' intervals) where torch's profiler
is there, else wall time with synchronisation. The prompt's attention time is the sum over its chunks;
TFLOP/s counts the causal work only (4 * hd * nH per (query, visible key) pair) against the H200's
790 TFLOP/s bf16 dense ceiling. --stride N times every N-th chunk (shorter runs; the sum is then an upper bound).

    python benchmarks/prefill_attention_bench.py --chunk 1024 4096 [--tokens 32768] [--json OUT]
    python benchmarks/prefill_attention_bench.py --chunk 4096 --nw 4 8 --no-decode   # warps a block
    python benchmarks/prefill_attention_bench.py --crossover   # queries per sequence where prefill wins

--crossover times both kernels for q = 4..256 queries per sequence (B sequences, 4k and 32k cached keys
each): the smallest q from which the prefill kernel is faster is what SELECT["prefill_attn_min_queries"]
should be.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qgemm_bench import DEVICE_TIME, chain_time  # noqa: E402
from mtlqwen.kernels.attention import kernels as decode  # noqa: E402
from mtlqwen.kernels.backend import gpu_backend  # noqa: E402
from mtlqwen.kernels.attention import prefill  # noqa: E402
from mtlqwen.kernels.seqs import SeqLayout  # noqa: E402
from mtlqwen.model.builtin import qwen35_9b_config  # noqa: E402

PEAK_TFLOPS = 790.0  # H200 bf16 dense tensor-core ceiling the issue measures against
BT = 128


def pools(rng, tokens: int, nkv: int, hd: int, dtype=mx.bfloat16):
    nb = -(-tokens // BT)
    kp = (0.5 * mx.random.normal((nb, BT, nkv, hd), key=mx.random.key(1))).astype(dtype)
    vp = mx.random.normal((nb, BT, nkv, hd), key=mx.random.key(2)).astype(dtype)
    mx.eval(kp, vp)
    return kp, vp, [int(b) for b in rng.permutation(nb)]


def layout_for(tables, past: list[int], qlens: list[int]) -> SeqLayout:
    qsl = [0] + np.cumsum(qlens).tolist()
    need = [-(-(p + t) // BT) for p, t in zip(past, qlens)]
    return SeqLayout(qsl, list(past), [tab[:n] for tab, n in zip(tables, need)], list(range(len(past))), BT)


def causal_flops(past: int, q: int, nh: int, hd: int) -> float:
    """QK^T + PV over the (query, key) pairs a causal chunk sees: sum over t of (past + t + 1) keys."""
    return 4.0 * hd * nh * (q * past + q * (q + 1) / 2)


def time_paths(q, gate, kp, vp, layout, scale, links, reps, paths):
    """{path: seconds per launch}; the q fed to each launch depends on the previous launch's output.
    Paths: "prefill" (warps from the selection table), "prefill_nwN" (N warps a block), "decode"."""
    fns = {
        "prefill": lambda h, _: prefill.prefill_attention_gpu(h, kp, vp, layout, scale, gate=gate),
        **{f"prefill_nw{n}": (lambda h, _, n=n: prefill.prefill_attention_gpu(
            h, kp, vp, layout, scale, gate=gate, nw=n)) for n in (4, 8)},
        "decode": lambda h, _: decode.paged_attention_gpu(h, kp, vp, layout, scale, gate=gate),
    }
    return {p: chain_time(fns[p], q, [None], links, reps) for p in paths}


def rel_err(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.max(mx.abs(a - b)).item() / max(mx.max(mx.abs(b)).item(), 1e-9))


def prompt(args, cfg, chunk: int) -> dict:
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rng = np.random.default_rng(0)
    kp, vp, table = pools(rng, args.tokens, nkv, hd)
    scale = hd ** -0.5
    nchunks = -(-args.tokens // chunk)
    rec = {"chunk": chunk, "tokens": args.tokens, "chunks": []}
    flops_total = sum(causal_flops(i * chunk, min(chunk, args.tokens - i * chunk), nh, hd) for i in range(nchunks))
    timed = list(range(nchunks - 1, -1, -args.stride))  # the last chunk always (the longest context)
    paths = ["prefill"] + [f"prefill_nw{n}" for n in args.nw] + ([] if args.no_decode else ["decode"])
    rec.update({f"{p}_s": 0.0 for p in paths})
    for i in timed:
        past, ql = i * chunk, min(chunk, args.tokens - i * chunk)
        lay = layout_for([table], [past], [ql])
        q = mx.random.normal((ql, nh, hd), key=mx.random.key(10 + i)).astype(mx.bfloat16)
        gate = mx.random.normal((ql, nh, 2 * hd), key=mx.random.key(20 + i)).astype(mx.bfloat16)
        mx.eval(q, gate)
        t = time_paths(q, gate, kp, vp, lay, scale, args.links, args.reps, paths)
        row = {"past": past, "q": ql, **{f"{p}_ms": 1e3 * s for p, s in t.items()}}
        fl = causal_flops(past, ql, nh, hd)
        row["prefill_TFLOPs"] = fl / t["prefill"] / 1e12
        if "decode" in t:
            row["decode_TFLOPs"] = fl / t["decode"] / 1e12
            if i == timed[0]:  # the two kernels agree on the longest chunk
                row["max_rel_err_vs_decode"] = rel_err(
                    prefill.prefill_attention_gpu(q, kp, vp, lay, scale, gate=gate),
                    decode.paged_attention_gpu(q, kp, vp, lay, scale, gate=gate))
        rec["chunks"].append(row)
        # --stride: a timed chunk stands for itself and the stride - 1 chunks below it (shorter contexts: the
        # sum is an upper bound on the prompt's time)
        for p, s in t.items():
            rec[f"{p}_s"] += s * min(args.stride, i + 1)
        print(f"chunk {chunk:5d} past {past:6d}: " + " | ".join(
            f"{p} {1e3 * s:8.3f} ms ({fl / s / 1e12:6.1f} TFLOP/s)" for p, s in t.items())
            + (f" | err {row['max_rel_err_vs_decode']:.1e}" if "max_rel_err_vs_decode" in row else ""), flush=True)
    rec["causal_TFLOP"] = flops_total / 1e12
    for p in paths:
        rec[f"{p}_TFLOPs"] = flops_total / rec[f"{p}_s"] / 1e12
    rec["prefill_of_peak"] = rec["prefill_TFLOPs"] / PEAK_TFLOPS
    layers = cfg.num_hidden_layers // 4  # one full-attention layer in four (3:1 GDN interleave)
    print(f"== {args.tokens} tokens in chunks of {chunk}: prefill kernel {rec['prefill_s'] * 1e3:.1f} ms a layer "
          f"({rec['prefill_TFLOPs']:.0f} TFLOP/s, {100 * rec['prefill_of_peak']:.0f}% of {PEAK_TFLOPS:.0f})"
          + (f"; current path (decode kernel) {rec['decode_s'] * 1e3:.1f} ms ({rec['decode_TFLOPs']:.0f} TFLOP/s, "
             f"{rec['decode_s'] / rec['prefill_s']:.1f}x slower)" if "decode" in paths else "")
          + f"; x {layers} attention layers: {rec['prefill_s'] * layers:.2f} s", flush=True)
    for n in args.nw:
        p = f"prefill_nw{n}"
        print(f"   prefill kernel at {n} warps a block: {rec[p + '_s'] * 1e3:.1f} ms a layer ({rec[p + '_TFLOPs']:.0f} TFLOP/s)",
              flush=True)
    return rec


def crossover(args, cfg) -> list[dict]:
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rng = np.random.default_rng(1)
    out = []
    for B, ctx in [(b, c) for b in args.batch for c in args.context]:
        kp, vp, table = pools(rng, B * (ctx + 512), nkv, hd)
        per = len(table) // B
        tables = [table[b * per:(b + 1) * per] for b in range(B)]
        for ql in (4, 8, 12, 16, 24, 32, 48, 64, 128, 256):
            lay = layout_for(tables, [ctx] * B, [ql] * B)
            q = mx.random.normal((B * ql, nh, hd), key=mx.random.key(ql)).astype(mx.bfloat16)
            gate = mx.random.normal((B * ql, nh, 2 * hd), key=mx.random.key(ql + 1)).astype(mx.bfloat16)
            t = time_paths(q, gate, kp, vp, lay, hd ** -0.5, args.links, args.reps, ["prefill", "decode"])
            row = {"B": B, "context": ctx, "q": ql, "prefill_us": 1e6 * t["prefill"], "decode_us": 1e6 * t["decode"]}
            out.append(row)
            print(f"B={B} ctx={ctx} q={ql:4d}: prefill {row['prefill_us']:9.1f} us | decode {row['decode_us']:9.1f} us"
                  f" | {'prefill' if t['prefill'] < t['decode'] else 'decode'} wins", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--stride", type=int, default=1,
                    help="time every N-th chunk from the last (N=1: all); the others count as the timed one above them")
    ap.add_argument("--links", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-decode", action="store_true", help="skip the current path (it is slow at 32k)")
    ap.add_argument("--nw", type=int, nargs="*", default=[], choices=[4, 8],
                    help="also time the prefill kernel at these warps a block (selection row prefill_attn_warps)")
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768],
                    help="cached keys a sequence (--crossover)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if gpu_backend() != "cuda":
        sys.exit("the prefill kernel is CUDA-only: run this on the CUDA back-end")
    cfg = qwen35_9b_config()
    print(f"timing: {'device (CUPTI)' if DEVICE_TIME else 'wall'}; 9B attention shape: {cfg.num_attention_heads} q heads,"
          f" {cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}", flush=True)
    res = {"mlx": mx.__version__, "timing": "device" if DEVICE_TIME else "wall", "peak_TFLOPs": PEAK_TFLOPS}
    if args.crossover:
        res["crossover"] = crossover(args, cfg)
    else:
        res["prompts"] = [prompt(args, cfg, c) for c in args.chunk]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
