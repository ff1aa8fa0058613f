"""Which kernels each drafter call of a speculative step launches, call by call (H200 diagnostics).

spec_trace.py counts a step's kernels together; this runs the engine as spec_trace does (9B target, the
z-lab drafter shape, forced acceptance), captures the step's drafter calls (the proposal and the context
write) with their arguments, and replays each alone, compiled and uncompiled, under CUPTI: kernels per call
by name, and their device time. What it answers: where the step's large bf16 copies come from.

    source .device/env.sh && python benchmarks/drafter_kernels.py --seqs 1 8 --n-draft 7 --json $OUT/drafter-kernels.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import mlx.core as mx

import spec_bench
from step_trace import kernel_events, short


def capture(eng):
    """The arguments of the next step's drafter calls: {"propose": (anchors, layout, n), "context": (taps, layout)}."""
    sp, got = eng.spec, {}
    real_p, real_c = sp.compiled_draft.propose, sp.compiled_draft.write_context

    def propose(anchors, layout, cache, n):
        got.setdefault("propose", (anchors, layout, n))
        return real_p(anchors, layout, cache, n)

    def context(taps, layout, cache, rows=None):
        got.setdefault("context", (taps, layout, rows))
        return real_c(taps, layout, cache, rows)

    sp.compiled_draft.propose, sp.compiled_draft.write_context = propose, context
    try:
        eng.step()
        mx.synchronize()
    finally:
        del sp.compiled_draft.propose, sp.compiled_draft.write_context
    return got


def per_call(run, calls: int) -> dict:
    """Kernels by name per call under CUPTI, and the call's median wall ms (synchronised, no profiler)."""
    walls = []
    for _ in range(calls):
        mx.synchronize()
        t0 = time.perf_counter()
        run()
        mx.synchronize()
        walls.append(1e3 * (time.perf_counter() - t0))
    ks = kernel_events(lambda: [run() for _ in range(calls)])
    per = collections.defaultdict(list)
    for s, e, name in ks:
        per[short(name)].append(e - s)
    kernels = {k: {"per_call": round(len(d) / calls, 2), "us_per_call": round(sum(d) / calls, 1)}
               for k, d in sorted(per.items(), key=lambda kv: -sum(kv[1]))}
    return {"wall_ms": round(statistics.median(walls), 3), "kernels": kernels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--n-draft", type=int, default=7)
    ap.add_argument("--accept", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--shape", choices=["9b", "demo"], default="9b", help="demo: a CPU smoke run (no kernels recorded)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = spec_bench.build_target(args.shape, 4)
    drafter = spec_bench.random_drafter(args.shape, model)
    out = []
    for S in args.seqs:
        with spec_bench.forced_acceptance(args.accept):
            eng = spec_bench.warm_engine(model, drafter, S, args.n_draft, args, None, True)
            got = capture(eng)
            sp = eng.spec
            cd, dc = sp.compiled_draft, sp.dcache
            rows = {}
            if "propose" in got:
                a, lay, n = got["propose"]
                rows["propose compiled"] = per_call(lambda: mx.eval(cd.propose(a, lay, dc, n), dc.arrays()), args.calls)
                rows["propose eager"] = per_call(lambda: mx.eval(sp.drafter.propose(a, lay, dc, n), dc.arrays()), args.calls)
            if "context" in got:
                t, lay, r = got["context"]
                tr = t if r is None else t[mx.array(r, dtype=mx.int32)]
                rows["context compiled"] = per_call(lambda: (cd.write_context(t, lay, dc, r), mx.eval(dc.arrays())), args.calls)
                rows["context eager"] = per_call(lambda: (sp.drafter.write_context(tr, lay, dc), mx.eval(dc.arrays())), args.calls)
            spec_bench.cancel_all(eng)
        for name, r in rows.items():
            ks = r["kernels"]
            print(f"## {S} seqs, {name}: {r['wall_ms']:.2f} ms a call, {sum(v['per_call'] for v in ks.values()):.0f} "
                  f"kernels, {sum(v['us_per_call'] for v in ks.values()):.0f} us of kernels", flush=True)
            for k, v in list(ks.items())[:12]:
                print(f"   {k:50s} {v['per_call']:6.1f} {v['us_per_call']:8.1f} us")
        out.append({"seqs": S, "n_draft": args.n_draft, "calls": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "mlx": mx.__version__, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
