"""Quantized matmul and paged decode attention on the GPU back-end, against MLX's built-ins.

    python benchmarks/kernels_qmatmul_attn.py [--quick] [--json OUT.json]

Qwen3.5-9B shapes at MLX affine 4-bit g64. Each timing evaluates a chain of calls in one graph, rotating
over enough distinct weight sets (or KV pools) that the working set is several times the 60 MB L2, and
reports the median over repeats of the per-call time (host cost included: what the model sees).
"stacked" rows time one launch over 48 stacked 4096-row matrices: the kernel's steady-state rate
without launch gaps. GB/s counts weight bytes including scales and biases (KV bytes for attention).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx  # noqa: E402

from mtlqwen.kernels.attention import kernels as pa  # noqa: E402
from mtlqwen.kernels.qmatmul import gemv as qm  # noqa: E402
from mtlqwen.kernels.qmatmul import LinearParams, linear  # noqa: E402
from mtlqwen.kernels.seqs import SeqLayout  # noqa: E402

SHAPES = [("qkv 8192x4096", 8192, 4096), ("z/o 4096x4096", 4096, 4096), ("gate/up 12288x4096", 12288, 4096),
          ("down 4096x12288", 4096, 12288), ("lm_head 248320x4096", 248320, 4096)]
MS = [1, 2, 4, 8, 16, 128, 2048]
WORKING_SET = 640e6  # bytes of distinct weights per timed chain: ~10x the H200's L2


def timed(make_outputs, reps: int) -> float:
    """Median seconds per call: make_outputs() returns (list of arrays, number of calls)."""
    for _ in range(2):
        mx.eval(make_outputs()[0])
    ts = []
    for _ in range(reps):
        outs, n = make_outputs()
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def quantized(rng, n, k, dt=mx.bfloat16, bits=4, gs=64) -> LinearParams:
    """Random packed words and random scales/biases made on the device (quantizing 1e9 floats is slow)."""
    wq = mx.random.randint(0, 2**31 - 1, (n, k * bits // 32)).astype(mx.uint32)
    s = (mx.random.normal((n, k // gs)) * 0.01).astype(dt)
    b = (mx.random.normal((n, k // gs)) * 0.01).astype(dt)
    mx.eval(wq, s, b)
    return LinearParams(weight=wq, scales=s, biases=b, bits=bits, group_size=gs)


def nbytes(p: LinearParams) -> int:
    return p.weight.nbytes + p.scales.nbytes + p.biases.nbytes


def bench_qmm(rng, quick: bool, rows: list) -> None:
    for name, n, k in SHAPES[:3] if quick else SHAPES:
        p0 = quantized(rng, n, k)
        nw = max(1, min(48, math.ceil(WORKING_SET / nbytes(p0))))
        ps = [p0] + [quantized(rng, n, k) for _ in range(nw - 1)]
        for m in MS[:4] if quick else MS:
            if name.startswith("lm_head") and m > 128:
                continue
            xs = [mx.random.normal((m, k)).astype(mx.bfloat16) for _ in range(4)]
            mx.eval(xs)
            calls = max(nw, 8) if m <= 128 else nw
            reps = 7 if m <= 128 else 3

            def chain(f):
                return lambda: ([f(xs[i % 4], ps[i % nw]) for i in range(calls)], calls)

            cands = {"mlx_qmm": lambda x, p: mx.quantized_matmul(x, p.weight, p.scales, p.biases, transpose=True,
                                                                  group_size=p.group_size, bits=p.bits)}
            if m <= 8:
                cands["ours_qmv"] = lambda x, p: qm.qmv(x, [p], mma=False)[0]
                cands["ours_mma"] = lambda x, p: qm.qmv(x, [p], mma=True)[0]
            elif m <= 16:
                cands["qmv_per8"] = lambda x, p: mx.concatenate([qm.qmv(x[i:i + 8], [p])[0] for i in range(0, m, 8)])
            if m >= 16:
                cands["dequant_gemm"] = lambda x, p: x @ p.dequantized().T
            cands["dispatch"] = linear
            for cname, f in cands.items():
                t = timed(chain(f), reps)
                rows.append(dict(kind="qmm", shape=name, M=m, cand=cname, us=t * 1e6, gbs=nbytes(p0) / t / 1e9,
                                 tflops=2 * m * n * k / t / 1e12))
                print(f"{name:22s} M={m:5d} {cname:13s} {t * 1e6:9.1f} us {nbytes(p0) / t / 1e9:7.0f} GB/s "
                      f"{2 * m * n * k / t / 1e12:6.1f} TF/s", flush=True)
        del ps


def bench_stacked(rng, quick: bool, rows: list) -> None:
    """One launch over 48 stacked 4096x4096 (and 16 stacked 12288x4096) matrices: steady-state GB/s."""
    for name, n, k in [("stacked 48x4096 x4096", 48 * 4096, 4096), ("stacked 4x12288 x12288", 4 * 12288, 12288)]:
        p = quantized(rng, n, k)
        for m in (1, 8) if quick else (1, 2, 4, 8):
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            for cname, f in {"ours_qmv": lambda: qm.qmv(x, [p], mma=False)[0],
                             "ours_mma": lambda: qm.qmv(x, [p], mma=True)[0],
                             "mlx_qmm": lambda: mx.quantized_matmul(x, p.weight, p.scales, p.biases,
                                                                    group_size=64, bits=4)}.items():
                t = timed(lambda: ([f() for _ in range(4)], 4), 7)
                rows.append(dict(kind="stacked", shape=name, M=m, cand=cname, us=t * 1e6, gbs=nbytes(p) / t / 1e9))
                print(f"{name:22s} M={m:5d} {cname:13s} {t * 1e6:9.1f} us {nbytes(p) / t / 1e9:7.0f} GB/s", flush=True)


def bench_sweep(rng, rows: list) -> None:
    """(R, U) blocking and the prefetch variant (PF) of the qmv kernel per shape class (feeds
    selection.QMV_BLOCKING and SELECT["qmv_prefetch"])."""
    m1 = [(4, 4, 0), (4, 4, 1), (4, 2, 0), (4, 2, 1), (2, 4, 1), (4, 1, 1), (8, 2, 1), (2, 2, 1)]
    m24 = [(4, 2, 0), (4, 2, 1), (4, 1, 1)]
    for name, n, k in [("z/o 4096x4096", 4096, 4096), ("qkv 8192x4096", 8192, 4096),
                       ("gate/up 12288x4096", 12288, 4096), ("down 4096x12288", 4096, 12288),
                       ("lm_head 248320x4096", 248320, 4096)]:
        p0 = quantized(rng, n, k)
        nw = max(1, min(48, math.ceil(WORKING_SET / nbytes(p0))))
        ps = [p0] + [quantized(rng, n, k) for _ in range(nw - 1)]
        for m, cfgs in ((1, m1), (2, m24)):
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            for cfg in cfgs:
                t = timed(lambda: ([qm.qmv(x, [ps[i % nw]], cfg=cfg)[0] for i in range(max(nw, 8))], max(nw, 8)), 5)
                label = f"R{cfg[0]}U{cfg[1]}PF{cfg[2]}"
                rows.append(dict(kind="sweep", shape=name, M=m, cand=label, us=t * 1e6, gbs=nbytes(p0) / t / 1e9))
                print(f"sweep {name:20s} M={m} {label} {t * 1e6:8.1f} us {nbytes(p0) / t / 1e9:6.0f} GB/s", flush=True)
        del ps


MMA_SWEEP = [(1, 4, 0), (1, 4, 1), (1, 2, 0), (2, 2, 0), (2, 2, 1), (2, 4, 0), (2, 1, 0), (4, 1, 0), (4, 2, 0),
             (4, 2, 1)]  # (RT, UG, CG); (1, 4, 0) is the blocking before the row tiles


def bench_mma_sweep(rng, rows: list, ms: list[int], cfgs: list[tuple[int, int, int]]) -> None:
    """The tensor-core qmv's blocking (RT, UG, CG; gemv.mma_config) at decode rows, on the 9B step's
    projections as the model calls them (the GDN layer's four in one launch, gate + up under SwiGLU), against
    the FMA qmv (its table's blocking) and MLX's quantized GEMM on the same weights."""
    gdn = [(8192, 4096), (4096, 4096), (32, 4096), (32, 4096)]
    cases = [("gdn in_proj x4", gdn, 0), ("gate+up swiglu", [(12288, 4096)] * 2, 1), ("down 4096x12288", [(4096, 12288)], 0),
             ("o 4096x4096", [(4096, 4096)], 0), ("lm_head 248320x4096", [(248320, 4096)], 0)]
    for name, dims, epi in cases:
        one = [quantized(rng, n, k) for n, k in dims]
        size = sum(nbytes(p) for p in one)
        nw = max(1, min(48, math.ceil(WORKING_SET / size)))
        sets = [one] + [[quantized(rng, n, k) for n, k in dims] for _ in range(nw - 1)]
        k = dims[0][1]
        for m in ms:
            xs = [mx.random.normal((m, k)).astype(mx.bfloat16) for _ in range(4)]
            mx.eval(xs)
            calls = max(nw, 8)
            cands = {f"RT{c[0]}UG{c[1]}CG{c[2]}": (lambda x, ps, c=c: qm.qmv(x, ps, epi=epi, cfg=c, mma=True))
                     for c in cfgs}
            cands["fma"] = lambda x, ps: qm.qmv(x, ps, epi=epi, mma=False)
            cands["mlx_qmm"] = lambda x, ps: [mx.quantized_matmul(x, p.weight, p.scales, p.biases, transpose=True,
                                                                  group_size=p.group_size, bits=p.bits) for p in ps]
            for cname, f in cands.items():
                t = timed(lambda: ([y for i in range(calls) for y in f(xs[i % 4], sets[i % nw])], calls), 5)
                rows.append(dict(kind="mma_sweep", shape=name, M=m, cand=cname, us=t * 1e6, gbs=size / t / 1e9))
                print(f"mma {name:20s} M={m} {cname:10s} {t * 1e6:8.1f} us {size / t / 1e9:6.0f} GB/s", flush=True)
        del sets


def bench_residual_sweep(rng, rows: list, ms: list[int]) -> None:
    """The residual projections (o, down) with the residual add + next RMSNorm, at decode rows: each GEMV
    with its epilogue (residual.py) against each GEMV followed by the add_rms_norm kernel. Every call of a
    chain has its own weights, so no two launches share an epilogue's arrival counter."""
    from mtlqwen.kernels.norms.kernels import add_rms_norm_kernel  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul import residual  # noqa: PLC0415

    for name, (n, k) in (("o 4096x4096", (4096, 4096)), ("down 4096x12288", (4096, 12288))):
        p0 = quantized(rng, n, k)
        nw = max(8, min(48, math.ceil(WORKING_SET / nbytes(p0))))
        ps = [p0] + [quantized(rng, n, k) for _ in range(nw - 1)]
        w = (1 + 0.1 * mx.random.normal((n,))).astype(mx.bfloat16)
        for m in ms:
            xs = [mx.random.normal((m, k)).astype(mx.bfloat16) for _ in range(4)]
            hs = [mx.random.normal((m, n)).astype(mx.bfloat16) for _ in range(4)]
            mx.eval(xs, hs, w)
            cands = {
                "fma+epilogue": lambda x, p, h: residual.qmv_add_rms(x, p, h, w, 1e-6),
                "mma+epilogue": lambda x, p, h: residual.qmv_mma_add_rms(x, p, h, w, 1e-6),
                "fma, add_rms_norm": lambda x, p, h: add_rms_norm_kernel(h, qm.qmv(x, [p], mma=False)[0], w, 1e-6),
                "mma, add_rms_norm": lambda x, p, h: add_rms_norm_kernel(h, qm.qmv(x, [p], mma=True)[0], w, 1e-6),
            }
            for cname, f in cands.items():
                t = timed(lambda: ([y for i in range(nw) for y in f(xs[i % 4], ps[i], hs[i % 4])], nw), 5)
                rows.append(dict(kind="residual_sweep", shape=name, M=m, cand=cname, us=t * 1e6))
                print(f"residual {name:16s} M={m} {cname:18s} {t * 1e6:8.1f} us", flush=True)
        del ps


def bench_fused(rng, rows: list) -> None:
    """GDN input projections (qkv 8192, z 4096, a 32, b 32) and the MLP gate/up at M=1: fused vs separate."""
    k = 4096
    sets = [[quantized(rng, n, k) for n in (8192, 4096, 32, 32)] for _ in range(24)]
    mlp = [(quantized(rng, 12288, k), quantized(rng, 12288, k)) for _ in range(12)]
    for m in (1, 8):
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        variants = {
            "gdn_in sep": lambda i: [qm.qmv(x, [p])[0] for p in sets[i % 24]],
            "gdn_in multi": lambda i: qm.qmv(x, sets[i % 24]),
            "mlp sep": lambda i: [(lambda g, u: g * mx.sigmoid(g) * u)(qm.qmv(x, [mlp[i % 12][0]])[0],
                                                                         qm.qmv(x, [mlp[i % 12][1]])[0])],
            "mlp swiglu": lambda i: qm.qmv(x, list(mlp[i % 12]), epi=1),
            "mlp swiglu fma": lambda i: qm.qmv(x, list(mlp[i % 12]), epi=1, mma=False),
        }
        for cname, f in variants.items():
            t = timed(lambda: ([y for i in range(24) for y in f(i)], 24), 7)
            by = sum(nbytes(p) for p in (sets[0] if cname.startswith("gdn") else mlp[0]))
            rows.append(dict(kind="fused", shape=cname, M=m, cand=cname, us=t * 1e6, gbs=by / t / 1e9))
            print(f"{cname:22s} M={m:5d} {t * 1e6:9.1f} us {by / t / 1e9:7.0f} GB/s", flush=True)


def bench_attention(rng, quick: bool, rows: list) -> None:
    nH, nKV, hd, bt = 16, 4, 256, 128
    for ctx in (4096, 32768) if quick else (512, 4096, 32768):
        for nseq in (1, 8):
            nblk = math.ceil((ctx + 1) / bt)
            kv_bytes = nseq * (ctx + 1) * nKV * hd * 2 * 2
            npool = max(1, min(16, math.ceil(WORKING_SET / kv_bytes)))
            pools = []
            for _ in range(npool):
                kp = mx.random.normal((nseq * nblk, bt, nKV, hd)).astype(mx.bfloat16)
                vp = mx.random.normal((nseq * nblk, bt, nKV, hd)).astype(mx.bfloat16)
                pools.append((kp, vp))
            mx.eval(pools)
            ids = rng.permutation(nseq * nblk).tolist()
            layout = SeqLayout(query_start_loc=list(range(nseq + 1)), kv_valid=[ctx] * nseq,
                               block_tables=[ids[i * nblk:(i + 1) * nblk] for i in range(nseq)],
                               state_rows=list(range(nseq)), block_tokens=bt)
            q = mx.random.normal((nseq, nH, hd)).astype(mx.bfloat16)
            dense = [mx.random.normal((nseq, nKV, ctx + 1, hd)).astype(mx.bfloat16) for _ in range(2)]
            qd = q.reshape(nseq, nH, 1, hd)
            variants = {
                "ours_paged": lambda i: pa.paged_attention_gpu(q, *pools[i % npool], layout, hd**-0.5),
                "ours_1pass": lambda i: pa.paged_attention_gpu(q, *pools[i % npool], layout, hd**-0.5, splits=1),
                "mlx_sdpa_dense": lambda i: mx.fast.scaled_dot_product_attention(qd, dense[0], dense[1], scale=hd**-0.5),
            }
            calls = max(npool, 8)
            ns = pa.plan(layout, nKV, nH // nKV)[0]
            for cname, f in variants.items():
                t = timed(lambda: ([f(i) for i in range(calls)], calls), 7)
                rows.append(dict(kind="attn", shape=f"ctx {ctx} x{nseq}", M=nseq, cand=cname, us=t * 1e6,
                                 gbs=kv_bytes / t / 1e9, splits=ns))
                print(f"attn ctx={ctx:6d} seqs={nseq} {cname:15s} {t * 1e6:9.1f} us {kv_bytes / t / 1e9:7.0f} GB/s"
                      f" (splits {ns})", flush=True)
            del pools, dense


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--only", default="qmm,stacked,fused,attn", help="parts: qmm, stacked, fused, attn, sweep, mma-sweep, residual-sweep")
    ap.add_argument("--ms", type=int, nargs="+", default=[8, 5], help="rows of the mma-sweep and residual-sweep parts")
    ap.add_argument("--cfgs", nargs="+", default=None,
                    help="the mma-sweep's blockings as RT,UG,CG (default: the MMA_SWEEP list)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows: list = []
    head = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), mlx=mx.__version__,
                device=str(mx.default_device()), argv=sys.argv)
    print(head, flush=True)
    only = a.only.split(",")
    # a device call's time limit (SIGTERM from `timeout`) still leaves the rows measured so far in the JSON
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        if "attn" in only:
            bench_attention(rng, a.quick, rows)
        if "stacked" in only:
            bench_stacked(rng, a.quick, rows)
        if "sweep" in only:
            bench_sweep(rng, rows)
        if "fused" in only:
            bench_fused(rng, rows)
        if "mma-sweep" in only:
            bench_mma_sweep(rng, rows, a.ms, [tuple(int(v) for v in c.split(',')) for c in a.cfgs] if a.cfgs else MMA_SWEEP)
        if "residual-sweep" in only:
            bench_residual_sweep(rng, rows, a.ms)
        if "qmm" in only:
            bench_qmm(rng, a.quick, rows)
    finally:
        if a.json:
            Path(a.json).write_text(json.dumps(dict(head=head, rows=rows), indent=1))


if __name__ == "__main__":
    main()
