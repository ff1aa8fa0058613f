"""The tensor-core quantized GEMM (mtlqwen/kernels/qgemm.py) per matrix of a Qwen3.5-9B step, against MLX's
quantized_matmul, dequantize + GEMM and a bf16 GEMM on the same weights (MLX affine 4-bit g64, bf16 x).

Timing: a chain of L launches in one graph, each launch's input made to depend on the previous launch's
output (mx.depends: no extra kernel), so launches cannot overlap; the weights rotate over enough copies that
every launch reads them from DRAM, not L2. Median of R evaluations, divided by L. Effective bandwidth =
packed weight bytes / time (the figure the GEMM issue's goals use); `+sb` adds the scales and biases.

    python benchmarks/qgemm_bench.py [--rows 16 32 ...] [--sweep] [--wgmma] [--only-ours] [--json OUT]

--sweep also times a few block configurations per (matrix, rows) and reports the best one beside the table's.
--wgmma adds the warpgroup-MMA form (qmatmul/wgmma.py; --sweep then sweeps its configurations instead); --only-ours
leaves out MLX's paths and the dequantize + GEMM ones (the bf16 GEMM stays, as the bandwidth yardstick).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from mtlqwen.kernels.qmatmul import dequant, qgemm, wgmma
from mtlqwen.kernels.qmatmul import LinearParams

try:
    import torch  # noqa: F401  (CUPTI through torch's profiler: device time per kernel)

    from step_trace import busy_us, kernel_events
    DEVICE_TIME = True
except ImportError:
    DEVICE_TIME = False

# (name, N, K, kind): kind "swiglu" is gate + up of N rows each through one launch
MATRICES = [
    ("in_proj 12288x4096", 12288, 4096, "plain"),
    ("q|gate 8192x4096", 8192, 4096, "plain"),
    ("k (v) 1024x4096", 1024, 4096, "plain"),
    ("o/out 4096x4096", 4096, 4096, "plain"),
    ("gate+up 2x12288x4096", 12288, 4096, "swiglu"),
    ("down 4096x12288", 4096, 12288, "plain"),
    ("lm_head 248320x4096", 248320, 4096, "plain"),
]
ROWS = [16, 32, 64, 128, 256, 512, 1024]
L2_BYTES = 60e6


def quantized(rng, n: int, k: int, bits: int = 4, gs: int = 64) -> LinearParams:
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.02).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(wq, s, b)
    return LinearParams(weight=wq, scales=s, biases=b, bits=bits, group_size=gs)


def chain_time(fn, x, ws, links: int, reps: int) -> float:
    """Seconds per link of fn(x, w) over a dependent chain rotating through ws: device time from CUPTI
    (kernels only, the union of their intervals) where torch's profiler is there, else wall time, which
    for small matrices measures the host's per-op cost rather than the kernel."""
    def run():
        h = x
        outs = []
        for i in range(links):
            y = fn(h, ws[i % len(ws)])
            outs.append(y)
            h = mx.depends([h], y if isinstance(y, list) else [y])[0]  # the next launch waits for this one
        return outs

    mx.eval(run())  # warm-up: compiles, allocates
    mx.synchronize()
    if DEVICE_TIME:
        busy = []
        for _ in range(reps):
            ks = kernel_events(lambda: (mx.eval(run()), mx.synchronize()))
            busy.append(busy_us(ks) * 1e-6)
        return statistics.median(busy) / links
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / links


def bench_matrix(rng, name, N, K, kind, rows, sweep, links, reps, wg=False, only_ours=False):
    copies = 2
    packed = N * K // 2 * (2 if kind == "swiglu" else 1)
    while copies * packed < 2 * L2_BYTES and copies < 16:
        copies *= 2
    if kind == "swiglu":
        ws = [(quantized(rng, N, K), quantized(rng, N, K)) for _ in range(copies)]
    else:
        ws = [(quantized(rng, N, K),) for _ in range(copies)]
    sb_bytes = sum(a.nbytes for a in (ws[0][0].scales, ws[0][0].biases)) * len(ws[0])
    bf = [tuple(p.dequantized() for p in w) for w in ws[: max(2, copies // 4)]]
    mx.eval(bf)

    def ours(x, w, cfg=None):
        return qgemm.qgemm(x, list(w), epi=1 if kind == "swiglu" else 0, cfg=cfg)

    def ours_wg(x, w, cfg=None):
        return wgmma.qgemm_wg(x, list(w), epi=1 if kind == "swiglu" else 0, cfg=cfg)

    def mlx_qmm(x, w):
        ys = [mx.quantized_matmul(x, p.weight, p.scales, p.biases, transpose=True, group_size=64, bits=4) for p in w]
        return ys[0] * mx.sigmoid(ys[0]) * ys[1] if kind == "swiglu" else ys

    def dequant_gemm(x, w):
        ys = [x @ p.dequantized().T for p in w]
        return ys[0] * mx.sigmoid(ys[0]) * ys[1] if kind == "swiglu" else ys

    def fast_dequant_gemm(x, w):
        ys = [x @ dequant.dequantize(p, x.dtype).T for p in w]
        return ys[0] * mx.sigmoid(ys[0]) * ys[1] if kind == "swiglu" else ys

    def bf16_gemm(x, w):
        ys = [x @ d.T for d in w]
        return ys[0] * mx.sigmoid(ys[0]) * ys[1] if kind == "swiglu" else ys

    out = []
    for M in rows:
        x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(mx.bfloat16)
        # correctness at this shape before timing: ours against MLX's own path
        ref = mlx_qmm(x, ws[0])
        ref = ref if isinstance(ref, list) else [ref]
        def err_of(got):
            return max(float(mx.max(mx.abs(g.astype(mx.float32) - r.astype(mx.float32))) /
                             (float(mx.max(mx.abs(r.astype(mx.float32)))) + 1e-9)) for g, r in zip(got, ref))

        err = err_of(ours(x, ws[0]))
        cfg = qgemm.config(M, N, K, 4, 1 if kind == "swiglu" else 0)
        rec = {"matrix": name, "M": M, "max_rel_err_vs_mlx": err, "cfg": list(cfg)}
        rec["ours_us"] = 1e6 * chain_time(ours, x, ws, links, reps)
        if wg:
            wcfg = wgmma.config(M, N, K, 1 if kind == "swiglu" else 0)
            rec["wgmma_cfg"], rec["wgmma_err_vs_mlx"] = list(wcfg), err_of(ours_wg(x, ws[0]))
            rec["wgmma_us"] = 1e6 * chain_time(ours_wg, x, ws, links, reps)
            rec["wgmma_TBps"] = packed / (rec["wgmma_us"] * 1e-6) / 1e12
            if sweep:
                best = (rec["wgmma_us"], list(wcfg))
                rec["wgmma_sweep"] = {}
                for c in wg_candidates(M, N, K, kind):
                    if list(c) != list(wcfg):
                        try:
                            us = 1e6 * chain_time(lambda a, b, c=c: ours_wg(a, b, cfg=c), x, ws, links, reps)
                        except RuntimeError as e:  # e.g. more registers than a block of this size may hold
                            rec["wgmma_sweep"][str(list(c))] = str(e)[:80]
                            continue
                        rec["wgmma_sweep"][str(list(c))] = round(us, 2)
                        best = min(best, (us, list(c)))
                rec["wgmma_best_us"], rec["wgmma_best_cfg"] = best
        if not only_ours:
            rec["mlx_qmm_us"] = 1e6 * chain_time(mlx_qmm, x, ws, links, reps)
            rec["dequant_gemm_us"] = 1e6 * chain_time(dequant_gemm, x, ws, max(4, links // 4), reps)
            rec["fast_dequant_gemm_us"] = 1e6 * chain_time(fast_dequant_gemm, x, ws, max(4, links // 2), reps)
        rec["bf16_gemm_us"] = 1e6 * chain_time(bf16_gemm, x, bf, links, reps)
        if sweep and not wg:  # with --wgmma, --sweep sweeps the warpgroup form only
            best = (rec["ours_us"], list(cfg))
            for c in candidates(M, N, K, kind):
                if list(c) == list(cfg):
                    continue
                us = 1e6 * chain_time(lambda a, b, c=c: ours(a, b, cfg=c), x, ws, links, reps)
                if us < best[0]:
                    best = (us, list(c))
            rec["best_us"], rec["best_cfg"] = best
        rec["ours_TBps"] = packed / (rec["ours_us"] * 1e-6) / 1e12
        rec["ours_TBps_with_sb"] = (packed + sb_bytes) / (rec["ours_us"] * 1e-6) / 1e12
        rec["ours_TFLOPs"] = 2 * M * N * K * (2 if kind == "swiglu" else 1) / (rec["ours_us"] * 1e-6) / 1e12
        rec["vs_bf16_gemm"] = rec["bf16_gemm_us"] / rec["ours_us"]
        out.append(rec)
        line = (f"{name:22s} M={M:5d} ours {rec['ours_us']:8.1f} us ({rec['ours_TBps']:.2f} TB/s, "
                f"{rec['ours_TFLOPs']:.0f} TFLOP/s)")
        if wg:
            line += (f" | wgmma {rec['wgmma_us']:8.1f} us ({rec['wgmma_TBps']:.2f} TB/s)"
                     f" err {rec['wgmma_err_vs_mlx']:.1e} cfg {rec['wgmma_cfg']}")
            if sweep:
                line += f" best {rec['wgmma_best_us']:.1f} {rec['wgmma_best_cfg']}"
        if not only_ours:
            line += (f" | mlx qmm {rec['mlx_qmm_us']:8.1f} | deq+gemm {rec['dequant_gemm_us']:8.1f} | fast deq+gemm "
                     f"{rec['fast_dequant_gemm_us']:8.1f}")
        line += (f" | bf16 {rec['bf16_gemm_us']:8.1f} | ours/bf16 {rec['vs_bf16_gemm']:.2f}x | err {err:.1e} cfg {cfg}"
                 + (f" | best {rec['best_us']:.1f} {rec['best_cfg']}" if "best_us" in rec else ""))
        print(line, flush=True)
    return out


def candidates(M: int, N: int, K: int, kind: str):
    """A handful of block configurations around the table's for the sweep."""
    base = qgemm.config(M, N, K, 4, 1 if kind == "swiglu" else 0)
    RT, TT, WN, WM, ST, split = base
    cands = {(RT, TT, WN, WM, ST, max(1, split // 2)), (RT, TT, WN, WM, ST, split * 2),
             (RT, TT, WN, WM, 2 if ST > 2 else 3, split)}
    if kind != "swiglu":
        cands.add((1 if RT == 2 else 2, TT, WN, WM, ST, split))
        cands.add((RT, TT, 2, WM, ST, split))
    if M >= 128:
        cands.add((RT, 8, WN, 1, 3, split))
    return sorted(c for c in cands if c[4] * qgemm.stage_bytes(4, *c[:4]) <= 227 * 1024)


def wg_candidates(M: int, N: int, K: int, kind: str):
    """The warpgroup form's configurations around its table's: warpgroups a block, pipeline depth, wgmma
    groups in flight, split-K, one row group."""
    RT, NB, ST, split, NBUF, WG = wgmma.config(M, N, K, 1 if kind == "swiglu" else 0)
    cands = {(RT, NB, st, sp, nbuf, wg) for st in (2, 3, 4) for nbuf in (2, 4) for wg in (1, 2)
             for sp in (max(1, split // 2), split, split * 2, split * 4)
             if K // 128 // sp >= 2 and (nbuf == 2 or wg == 1)}
    if kind != "swiglu":
        cands.add((1, NB, 2, split, NBUF, 2))
    return sorted(c for c in cands if c[2] * wgmma.stage_bytes(c[0] * c[5], c[1]) <= 227 * 1024)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--matrices", nargs="+", default=None, help="name prefixes (default: all)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--links", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--wall", action="store_true", help="wall time even where CUPTI is available")
    ap.add_argument("--wgmma", action="store_true", help="time the warpgroup-MMA form too")
    ap.add_argument("--only-ours", action="store_true", help="leave out MLX's and the dequantize paths")
    args = ap.parse_args(argv)
    global DEVICE_TIME
    DEVICE_TIME = DEVICE_TIME and not args.wall
    print(f"timing: {'device (CUPTI)' if DEVICE_TIME else 'wall'}", flush=True)
    rng = np.random.default_rng(0)
    results = []
    for name, N, K, kind in MATRICES:
        if args.matrices and not any(name.startswith(p) for p in args.matrices):
            continue
        results += bench_matrix(rng, name, N, K, kind, args.rows, args.sweep, args.links, args.reps,
                               wg=args.wgmma, only_ours=args.only_ours)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mlx": mx.__version__, "timing": "device" if DEVICE_TIME else "wall", "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
