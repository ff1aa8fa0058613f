"""Where a compiled decode step's time goes on the device, kernel by kernel, as it really runs.

Nsight Compute (step_kernels.py) replays kernels one at a time with idle gaps between them, which lets
the clocks fall and inflates every latency-bound kernel. Here the compiled step (9B shape by default) runs as in
decode_profile.py (pipelined, MLX's CUDA graphs on) while PyTorch's profiler (CUPTI) records each
kernel's start and end. Per step it reports:

- `span`: first kernel start to last kernel end of the step; `busy`: the union of kernel intervals;
  `gaps` = span - busy (the device waiting between kernels of one step: launch latency, host);
- `idle_before`: the device idle between the previous step's last kernel and this step's first one
  (the host had not launched it yet: host-bound when it is large);
- per kernel name: launches per step and in-situ µs per launch, and the share of `busy`;
- `host_us`: the host's median µs a step calling the compiled step, in `mx.async_eval` (MLX encoding its
  kernels) and waiting for the previous step's token, timed in a loop without the profiler
  (`host_us_profiled`: the same under CUPTI, which adds to every launch); `graph_nodes`: the step's
  primitives by name.

    python benchmarks/step_trace.py --batch 1 --variants qmv_residual_norm=0 --json $OUT/trace.json

With `--prefill T` it then traces prefill chunks of T tokens at the defaults (one sequence, empty cache, eager
as the engine runs its prefill steps): kernels per chunk and the chunk's wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import tempfile
import time

import mlx.core as mx

from bench_common import DENSE_WEIGHTS, add_dense_weights_arg
from decode_profile import count_primitives, set_pools, step_fn
from host_build import warm_layout
from mtlqwen.kernels.selection import parse_rows, selected
from mtlqwen.model.builtin import SHAPES, random_model
from mtlqwen.model.config import QuantSpec
from mtlqwen.runtime.dense_weights import keep_dense_weights, resolve as resolve_dense


def kernel_events(run) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every CUDA kernel the process ran during run(), sorted by start."""
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    if not torch.cuda.is_available():  # a CPU smoke run: no kernels to record
        run()
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    ks = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
          if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(ks)


def short(name: str) -> str:
    name = re.sub(r"^custom_kernel_", "", name)
    name = re.sub(r"_[0-9a-f]{10}_.*", "", name)  # MLX's source hash and template suffix
    return re.sub(r"\(.*", "", name)[:48]


def steps_of(ks: list, end_marker: str) -> list[list]:
    """Split the kernels into steps: each step ends with the kernel whose name contains end_marker."""
    steps, cur = [], []
    for k in ks:
        cur.append(k)
        if end_marker in k[2]:
            steps.append(cur)
            cur = []
    return steps


def busy_us(step: list) -> float:
    total, hi = 0.0, None
    for s, e, _ in step:  # union of intervals (kernels of one graph may overlap)
        if hi is None or s > hi:
            total += e - s
            hi = e
        elif e > hi:
            total += e - hi
            hi = e
    return total


def summarize(ks: list, end_marker: str = "arg_reduce") -> dict:
    steps = steps_of(ks, end_marker)[1:]  # the first may have started before the profiler
    if not steps:
        return {"error": f"no kernels recorded ({len(ks)} events): is CUPTI available?"}
    spans = [st[-1][1] - st[0][0] for st in steps]
    busy = [busy_us(st) for st in steps]
    idle = [b[0][0] - a[-1][1] for a, b in zip(steps, steps[1:])]
    per = collections.defaultdict(list)
    for st in steps:
        for s, e, n in st:
            per[short(n)].append(e - s)
    n = len(steps)
    kernels = sorted(((name, len(d) / n, statistics.mean(d), sum(d) / n) for name, d in per.items()),
                     key=lambda t: -t[3])
    med = statistics.median
    return {
        "steps": n, "kernels_per_step": statistics.mean(len(st) for st in steps),
        "span_us": med(spans), "busy_us": med(busy), "gaps_us": med([a - b for a, b in zip(spans, busy)]),
        "idle_before_us": med(idle) if idle else None,
        "period_us": med([b[0][0] - a[0][0] for a, b in zip(steps, steps[1:])]) if len(steps) > 1 else None,
        "kernels": [{"name": k, "per_step": round(c, 2), "us_each": round(u, 2), "us_per_step": round(t, 1),
                     "share": round(t / med(busy), 3)} for k, c, u, t in kernels],
    }


def trace_variant(model, B: int, past: int, steps: int, rows: dict) -> dict:
    with selected(rows):
        nb = past // 128 + 1
        cache = model.make_cache(B * nb + 1, B, 128)
        ids = mx.zeros((B,), dtype=mx.int32)
        # the step's graph as the host walks it every step (primitives by name, uncompiled: the trace's tape)
        nodes = count_primitives(mx.stack([step_fn(model, cache, B, past)(ids, *cache.arrays())[0]]))
        f = mx.compile(step_fn(model, cache, B, past))

        host = {"call": [], "encode": [], "wait": []}  # host µs per step: f(), async_eval, the readback

        def loop(n):
            nonlocal ids
            prev = None
            for _ in range(n):
                t0 = time.perf_counter()
                o = f(ids, *cache.arrays())
                set_pools(cache, o[1:])
                t1 = time.perf_counter()
                mx.async_eval(o[0], *cache.arrays())  # MLX encodes the step's kernels on this thread
                t2 = time.perf_counter()
                if prev is not None:
                    prev.tolist()
                for k, v in zip(host, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
                    host[k].append(1e6 * v)
                ids = prev = o[0]
            prev.tolist()

        def host_medians() -> dict:
            m = {k: round(statistics.median(v), 1) for k, v in host.items()}
            for v in host.values():
                v.clear()
            return m

        loop(10)  # trace, compile the kernels, warm up
        host_medians()
        loop(steps)  # the host's times without the profiler (CUPTI adds to every launch)
        plain = host_medians()
        out = summarize(kernel_events(lambda: loop(steps)))
        out["host_us_profiled"], out["host_us"] = host_medians(), plain
        out["graph_nodes"] = {"total": sum(nodes.values()), **nodes}
        del cache, f
        mx.clear_cache()
        return out


def trace_prefill(model, T: int, steps: int, rows: dict, seqs: int = 1, context: int = 0) -> dict:
    """One prefill chunk of T tokens, split evenly over `seqs` sequences that each have `context` tokens
    cached already (the pools as allocated: the kernels' time does not depend on the values; a warm prefix
    hit's step is 8 x 64 over 2048), as the engine runs a prefill step: eager, logits of each sequence's last
    row. Kernels per chunk, and the chunk's wall time without the profiler."""
    with selected(rows):
        per = T // seqs
        nb = -(-(context + per) // 128)
        cache = model.make_cache(seqs * nb + 1, seqs, 128)
        lay = warm_layout(seqs, per, context, 128)
        qsl = lay.query_start_loc
        ids = mx.random.randint(0, model.config.vocab_size, (T,)).astype(mx.int32)
        last = mx.array([q - 1 for q in qsl[1:]])

        def run(n):
            for _ in range(n):
                out = mx.argmax(model.forward(ids, lay, cache, logits_rows=last), axis=-1)
                out.tolist()

        run(2)  # first-use compiles
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            run(1)
            walls.append(1e6 * (time.perf_counter() - t0))
        out = summarize(kernel_events(lambda: run(steps + 1)))
        out["wall_us"] = round(statistics.median(walls), 1)
        out["tokens_per_s"] = round(T / (statistics.median(walls) * 1e-6), 1)
        del cache
        mx.clear_cache()
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument("--variants", nargs="*", default=[], metavar="ROW=V[,ROW=V]")
    ap.add_argument("--top", type=int, default=16, help="kernel rows printed per variant")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b", help="demo: a CPU smoke run")
    ap.add_argument("--prefill", type=int, default=0, metavar="T",
                    help="after the decode variants, trace prefill chunks of T tokens (one sequence, empty cache) "
                         "under each variant")
    ap.add_argument("--prefill-only", action="store_true", help="with --prefill: leave out the decode steps")
    ap.add_argument("--prefill-seqs", type=int, default=1, help="the prefill chunk split over this many sequences")
    ap.add_argument("--prefill-context", type=int, default=0, help="tokens each of them has cached already")
    add_dense_weights_arg(ap)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.prefill and (a.prefill_seqs < 1 or a.prefill % a.prefill_seqs or a.prefill_context < 0):
        ap.error(f"--prefill {a.prefill} must split evenly over --prefill-seqs {a.prefill_seqs} (>= 1), "
                 f"and --prefill-context must be >= 0")
    variants = {"defaults": {}, **{spec: parse_rows(spec, source="--variants") for spec in a.variants}}  # typos fail now
    model = random_model(SHAPES[a.shape](), quantize=QuantSpec(4, 64), dtype=mx.bfloat16)
    res = {"mlx": mx.__version__, "shape": a.shape, "batch": a.batch, "past": a.past, "variants": {}}
    for spec, rows in variants.items():
        if a.prefill_only:
            break
        r = res["variants"][spec] = trace_variant(model, a.batch, a.past, a.steps, rows)
        if "error" in r:
            print(spec, r["error"])
            continue
        print(f"\n## {spec}: period {r['period_us']:.0f} µs, span {r['span_us']:.0f}, busy {r['busy_us']:.0f}, "
              f"gaps {r['gaps_us']:.0f}, idle before {r['idle_before_us']:.0f}, {r['kernels_per_step']:.0f} kernels; "
              f"host µs: {r['host_us']} (under the profiler: {r['host_us_profiled']})")
        g = r["graph_nodes"]
        print(f"graph: {g['total']} nodes; " + ", ".join(f"{k} {v}" for k, v in list(g.items())[1:13]))
        print("| kernel | per step | µs each | µs per step | share of busy |\n|---|---|---|---|---|")
        for k in r["kernels"][: a.top]:
            print(f"| {k['name']} | {k['per_step']:g} | {k['us_each']:.1f} | {k['us_per_step']:.0f} | {100 * k['share']:.1f}% |")
    prefill_runs = [(f"{spec}{f' dense={d}' if len(a.dense_weights) > 1 else ''}", rows, d)
                    for d in a.dense_weights for spec, rows in variants.items()] if a.prefill else []
    for spec, rows, dense in prefill_runs:
        keep_dense_weights(model, resolve_dense(model, DENSE_WEIGHTS[dense]))  # what an engine would keep
        r = res.setdefault("prefill_trace", {})[spec] = trace_prefill(model, a.prefill, 5, rows, a.prefill_seqs, a.prefill_context)
        print(f"\n## prefill of {a.prefill} tokens ({a.prefill_seqs} x {a.prefill // a.prefill_seqs} over "
              f"{a.prefill_context} cached), {spec}: wall {r['wall_us']:.0f} µs ({r['tokens_per_s']:.0f} tok/s)"
              + (f", kernels busy {r['busy_us']:.0f} µs, span {r['span_us']:.0f}, {r['kernels_per_step']:.0f} kernels"
                 if "error" not in r else f"; {r['error']}"))
        print("| kernel | per chunk | µs each | µs per chunk | share of busy |\n|---|---|---|---|---|")
        for k in r.get("kernels", [])[: a.top]:
            print(f"| {k['name']} | {k['per_step']:g} | {k['us_each']:.1f} | {k['us_per_step']:.0f} | {100 * k['share']:.1f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
