"""GDN / conv kernels vs their plain-MLX references on the Qwen3.5-9B GDN shape
(Hk=16, Hv=32, dk=dv=128, conv_dim=8192), bf16 activations, fp32 state.

`python benchmarks/kernels_gdn.py [--out results.json] [--only staged]` on a GPU back-end. Each case is checked against
the reference once, then timed two ways after warm-up: `chain` = N independent launches (each on other
state slots of a 64-slot pool, so the state comes from HBM, not L2), graph built first, then one
mx.eval timed, per launch (`host` = building that graph, per launch); `eval` = build one launch + mx.eval,
median of many (adds the synchronisation cost). GB/s counts the state read + write and the activations
(q, k, v in, o out) over the chained time, against ~4.3 TB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mtlqwen.kernels.conv import causal_conv1d_ref  # noqa: E402
from mtlqwen.kernels.conv.kernels import run_conv  # noqa: E402
from mtlqwen.kernels.gdn import (gated_delta_candidates_ref, gated_delta_packed_candidates_normed_ref,  # noqa: E402
                                 gated_delta_packed_normed_ref, gated_delta_ref)
from mtlqwen.kernels.gdn.kernels import run_gdn  # noqa: E402
from mtlqwen.kernels.gdn.normed import run_gdn_normed  # noqa: E402
from mtlqwen.kernels.selection import SELECT, selected  # noqa: E402
from mtlqwen.kernels.seqs import SeqLayout  # noqa: E402

HK, HV, DK, DV, CONV, SLOTS = 16, 32, 128, 128, 8192, 64
PEAK = 4.3e12
STATE = HV * DV * DK * 4  # bytes of one sequence's state (2 MiB)
rng = np.random.default_rng(0)


def rand(*shape, dtype=mx.bfloat16, scale=1.0):
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def layouts(lens: list[int], n: int) -> list[SeqLayout]:
    """n layouts of the same packed shape, each on other pool slots (round robin over SLOTS)."""
    B = len(lens)
    qsl = [0] + [int(x) for x in np.cumsum(lens)]
    return [SeqLayout(qsl, [0] * B, [[0]] * B, [(j * B + i) % SLOTS for i in range(B)]) for j in range(n)]


def gdn_inputs(T: int):
    return dict(q=rand(T, HK, DK), k=rand(T, HK, DK), v=rand(T, HV, DV), a=rand(T, HV), b=rand(T, HV),
                A_log=mx.array(np.log(rng.uniform(1, 16, HV)).astype(np.float32)),
                dt_bias=rand(HV, dtype=mx.float32, scale=0.5))


def time_eval(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


HOST: dict[str, float] = {}


def time_chain(fns, reps: int = 5) -> float:
    """Median over reps of (one mx.eval of the graph of all fns) / len(fns). Building the graph (Python and
    MLX's op construction) is timed apart, into HOST['last'], since it overlaps device work in a real step."""
    mx.eval([f() for f in fns])
    ts, hs = [], []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [f() for f in fns]
        t1 = time.perf_counter()
        mx.eval(outs)
        ts.append((time.perf_counter() - t1) / len(fns))
        hs.append((t1 - t) / len(fns))
    HOST["last"] = statistics.median(hs)
    return statistics.median(ts)


def rel(a, b) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


ROWS: list[dict] = []


def report(case: str, impl: str, t_chain: float | None, t_eval: float, nbytes: float, err: float | None = None):
    host = HOST.pop("last", None) if t_chain is not None else None
    row = dict(case=case, impl=impl, chain_us=None if t_chain is None else t_chain * 1e6, eval_us=t_eval * 1e6,
               host_us=None if host is None else host * 1e6, gbs=None if t_chain is None else nbytes / t_chain / 1e9,
               err=err)
    row["pct_peak"] = None if t_chain is None else 100 * nbytes / t_chain / PEAK
    ROWS.append(row)
    c = "-" if t_chain is None else f"{t_chain * 1e6:9.1f}"
    g = "-" if t_chain is None else f"{row['gbs']:7.0f} ({row['pct_peak']:4.1f}%)"
    e = "" if err is None else f"  err {err:.1e}"
    h = "" if host is None else f"  host {host * 1e6:5.1f} us"
    print(f"{case:22s} {impl:24s} chain {c} us  eval {t_eval * 1e6:9.1f} us  {g}{h}{e}", flush=True)


def bench_gdn(case: str, lens: list[int], n_chain: int, ref_iters: int, variants: list[dict], cand=False):
    T, B = sum(lens), len(lens)
    x = gdn_inputs(T)
    pool = rand(SLOTS, HV, DV, DK, dtype=mx.float32, scale=0.1)
    mx.eval(pool, *x.values())
    lays = layouts(lens, n_chain)
    act = T * (2 * HK * DK + 2 * HV * DV) * 2  # q, k, v in + o out, bf16
    nbytes = 2 * B * STATE + act + (T * STATE if cand else 0)
    ref_fn = gated_delta_candidates_ref if cand else gated_delta_ref
    ref = ref_fn(**x, state_pool=pool, layout=lays[0])
    mx.eval(ref)
    for kw in variants:
        kw = dict(kw)
        stage = kw.pop("stage", 0)  # SELECT["gdn_recurrent_stage"] (staged.py) for the recurrence
        with selected({"gdn_recurrent_stage": stage}):
            out = run_gdn(**x, state_pool=pool, layout=lays[0], candidates=cand, **kw)
            if out is None:
                continue
            err = max(rel(o, r) for o, r in zip(out, ref))
            tc = time_chain([lambda L=L: run_gdn(**x, state_pool=pool, layout=L, candidates=cand, **kw) for L in lays])
            te = time_eval(lambda: run_gdn(**x, state_pool=pool, layout=lays[0], candidates=cand, **kw), 30)
        name = ("chunk" if kw.get("chunk") else "recurrent") + f" tpr={kw.get('tpr') or 'auto'}"
        name += f" stage={stage}" if stage else ""
        report(case, name + (" +cand" if cand else ""), tc, te, nbytes, err)
    te = time_eval(lambda: ref_fn(**x, state_pool=pool, layout=lays[0]), ref_iters, warmup=1)
    report(case, "reference", None, te, nbytes)


def bench_normed(case: str, lens: list[int], n_chain: int, stages: list[int], cand=False):
    """The recurrence with its gated norm fused (gdn/normed.py) on the packed conv output, as the model runs
    it, for each SELECT["gdn_normed_stage"] in stages (0: the unstaged body)."""
    T, B = sum(lens), len(lens)
    y, z = rand(T, 2 * HK * DK + HV * DV), rand(T, HV * DV)
    w = mx.array((1 + 0.2 * rng.standard_normal(DV)).astype(np.float32))
    x = {n: a for n, a in gdn_inputs(T).items() if n in ("a", "b", "A_log", "dt_bias")}
    pool = rand(SLOTS, HV, DV, DK, dtype=mx.float32, scale=0.1)
    mx.eval(pool, y, z, w, *x.values())
    lays = layouts(lens, n_chain)
    heads = (HK, DK, HV, DV)
    nbytes = 2 * B * STATE + T * (2 * HK * DK + 3 * HV * DV) * 2 + (T * STATE if cand else 0)
    ref_fn = gated_delta_packed_candidates_normed_ref if cand else gated_delta_packed_normed_ref
    ref = ref_fn(y, z, w, 1e-6, **x, state_pool=pool, layout=lays[0], heads=heads)
    mx.eval(ref)
    for tb in stages:  # segments past gdn_chunk_min_t too: where the staged body might beat the chunk scan
        with selected({"gdn_normed_stage": tb, "gdn_chunk_min_t": max(SELECT["gdn_chunk_min_t"], max(lens))}):
            def call(L=lays[0]):
                return run_gdn_normed(y, z, w, 1e-6, **x, state_pool=pool, layout=L, heads=heads, candidates=cand)

            out = call()
            err = max(rel(o, r) for o, r in zip(out, ref))
            tc = time_chain([lambda L=L: call(L) for L in lays])
            te = time_eval(call, 30)
        report(case, f"normed stage={tb}" + (" +cand" if cand else ""), tc, te, nbytes, err)


def bench_conv(case: str, lens: list[int], n_chain: int, ref_iters: int):
    T, B = sum(lens), len(lens)
    xx, w = rand(T, CONV), rand(CONV, 4, scale=0.5)
    pool = rand(SLOTS, 3, CONV)
    lays = layouts(lens, n_chain)
    ref = causal_conv1d_ref(xx, w, pool, lays[0])
    out = run_conv(xx, w, pool, lays[0])
    err = max(rel(o, r) for o, r in zip(out, ref))
    nbytes = 2 * T * CONV * 2 + 2 * B * 3 * CONV * 2
    tc = time_chain([lambda L=L: run_conv(xx, w, pool, L) for L in lays])
    report(case, "conv kernel", tc, time_eval(lambda: run_conv(xx, w, pool, lays[0]), 30), nbytes, err)
    report(case, "conv reference", None, time_eval(lambda: causal_conv1d_ref(xx, w, pool, lays[0]), ref_iters, 1),
           nbytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer cases (short TPR sweep, no crossover, no 4 x 1024)")
    ap.add_argument("--only", choices=["staged"],
                    help="only the staged recurrences' cases (gdn_normed_stage, gdn_recurrent_stage) beside the unstaged")
    args = ap.parse_args()
    print(f"MLX {mx.__version__}, device {mx.default_device()}", flush=True)
    bench_normed("warm hit 8 x 64", [64] * 8, 8, [0, 4, 8, 16])
    bench_normed("prefill 1 x 64", [64], 16, [0, 8, 16])
    bench_normed("verify 1 x 8", [8], 32, [0, 8], cand=True)
    bench_normed("verify 8 x 8", [8] * 8, 16, [0, 8], cand=True)
    bench_normed("prefill 4 x 256", [256] * 4, 4, [0, 8, 16])
    if args.only == "staged":
        staged = [dict(chunk=False, stage=tb) for tb in (0, 8, 16, 32)]
        bench_gdn("prefill 4 x 256", [256] * 4, 4, 1, [dict(chunk=True, tpr=4)] + staged)
        bench_gdn("prefill T=4096", [4096], 2, 1, [dict(chunk=True, tpr=4)] + staged)
        bench_gdn("verify B=8 x16", [16] * 8, 4, 2, [dict(chunk=False, stage=tb) for tb in (0, 8, 16)], cand=True)
        bench_gdn("verify B=1 x8", [8], 16, 2, [dict(chunk=False, stage=tb) for tb in (0, 8)], cand=True)
        return write_rows(args.out)
    rec = [dict(chunk=False, tpr=t) for t in ((8, 16) if args.quick else (8, 16, 32))]
    chunks = [dict(chunk=True, tpr=4), dict(chunk=True, tpr=8)]
    bench_gdn("decode B=1", [1], 64, 10, rec)
    bench_gdn("decode B=8", [1] * 8, 16, 10, rec)
    bench_gdn("verify B=8 x16", [16] * 8, 8, 3, [dict(chunk=False)] + chunks)
    bench_gdn("verify B=8 x16", [16] * 8, 4, 2, [dict(chunk=False)], cand=True)
    if not args.quick:
        for T in (32, 64):
            bench_gdn(f"crossover B=1 T={T}", [T], 8, 2, [dict(chunk=False)] + chunks)
    bench_gdn("prefill T=4096", [4096], 2, 2, chunks + [dict(chunk=False)])
    if not args.quick:
        bench_gdn("prefill 4 x 1024", [1024] * 4, 2, 1, chunks)
    bench_conv("conv decode B=1", [1], 64, 10)
    bench_conv("conv decode B=8", [1] * 8, 16, 10)
    bench_conv("conv prefill T=4096", [4096], 4, 3)
    write_rows(args.out)


def write_rows(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(dict(mlx=mx.__version__, rows=ROWS), indent=1))


if __name__ == "__main__":
    main()
