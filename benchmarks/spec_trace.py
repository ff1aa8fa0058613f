"""Where a speculative engine step's time goes: the host's phases and the device's kernels.

spec_bench.py measures a step's wall time; this says what bounds it. For each (sequences S, n_draft,
pipeline) an Engine runs S decoding requests to steady state (spec_bench.warm_engine: the random 9B-shaped
drafter, --accept K forcing min(K, n_draft) accepted drafts), then --steps engine steps are run twice:

  host     wall ms per step inside each of the step's calls, exclusive of the calls nested in them: the
           drafter's proposal, the target forward (compiled: the trace's replay, which builds no kernels
           yet), the verifier, the candidate commit, the drafter-context write, mx.async_eval (MLX
           encoding and launching the kernels), the read-back (the host waiting for the device), the
           replay commit; "other" is the rest of Engine.step (scheduling, packing, bookkeeping);
  device   under CUPTI, per step: the kernels' busy time (the union of their intervals), their count,
           and the kernels that take the most time.

busy close to the wall time: the device bounds the step; busy far below it and "read-back" small: the
host does. n_draft 0 without a drafter is the plain engine (pipelined decode), the baseline; --idle adds n_draft 0
with the drafter loaded (nobody drafting), what the drafter costs a step in which the policy drafts for no one.

    source .device/env.sh && python benchmarks/spec_trace.py --seqs 1 8 --n-draft 0 7 15 --accept 6 --pipeline off on
    python benchmarks/spec_trace.py --shape demo --prompt-len 32 --seqs 1 --n-draft 0 3 --steps 3   # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import copy
import itertools
import json
import statistics
import sys
import time

import mlx.core as mx

import spec_bench
from mtlqwen.kernels.selection import parse_rows, selected
from mtlqwen.runtime import speculative
from bench_common import host_profile
from decode_profile import count_primitives
from step_trace import busy_us, kernel_events, short


class Phases:
    """Host seconds inside wrapped calls, each exclusive of the wrapped calls nested in it."""

    def __init__(self):
        self.total: dict[str, float] = collections.defaultdict(float)
        self._stack: list[float] = []

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                inner = self._stack.pop()
                self.total[name] += dt - inner
                if self._stack:
                    self._stack[-1] += dt
        return timed


def instrument(eng, phases: Phases) -> list:
    """Wrap the engine's step phases (instance attributes and the two module functions the step calls);
    returns the undo list for restore()."""
    undo = []

    def patch(obj, attr, name):
        if obj is None or not hasattr(obj, attr):
            return
        had = attr in vars(obj)  # an attribute of the object itself (modules' functions too), not its class's
        old = getattr(obj, attr)
        undo.append((obj, attr, old, had))
        setattr(obj, attr, phases.wrap(name, old))

    sp = eng.spec
    if sp is not None:
        patch(sp, "propose", "draft")
        patch(sp, "propose_on_device", "draft")
        patch(sp, "write_context", "drafter context")
        patch(sp, "read", "read-back")
        patch(sp, "commit", "commit (host)")
        if sp.compiled is not None:
            patch(sp.compiled, "commit", "candidate commit")
        patch(sp.model, "forward_verifying", "target forward")
        patch(sp.model, "forward_with_taps", "target forward")
        patch(sp.model, "commit_candidates", "replay / candidate commit (eager)")
        patch(speculative, "verify", "verifier")
    for compiled in {id(c): c for c in (eng.compiled, sp and sp.compiled) if c is not None}.values():
        patch(compiled, "_run", "target forward")  # every compiled target step goes through it
    patch(eng, "_commit", "read-back")
    patch(mx, "async_eval", "async_eval")
    return undo


def restore(undo: list) -> None:
    for obj, attr, old, had in reversed(undo):
        if had:
            setattr(obj, attr, old)
        else:
            delattr(obj, attr)


def run_steps(eng, steps: int) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t0) / steps


def graph_of_step(eng) -> dict:
    """Primitives by name of one engine step's graphs: every lazy array the step hands to mx.async_eval,
    counted before it is evaluated (arrays of an earlier evaluation are leaves by then)."""
    counts: collections.Counter = collections.Counter()
    real = mx.async_eval

    def counting(*arrays):
        flat = [a for a in arrays if isinstance(a, mx.array)]
        if flat:
            counts.update(count_primitives(flat))
        return real(*arrays)

    mx.async_eval = counting
    try:
        eng.step()
    finally:
        mx.async_eval = real
    mx.synchronize()
    return {"total": sum(counts.values()), **dict(counts.most_common())}


def trace_row(model, drafter, S: int, n: int, pipeline: bool, args, commit: str = "auto", idle: bool = False) -> dict:
    """One row; idle: n = 0 with the drafter loaded (nobody drafting: the target's taps and the drafter's context
    writes still run every step), against the plain engine's n = 0 without it."""
    a = copy.copy(args)
    a.steps = 4 * args.steps + 2  # room for the timed runs, the profile and the graph count
    with spec_bench.forced_acceptance(args.accept if n else None):
        eng = spec_bench.warm_engine(model, drafter if n or idle else None, S, n, a, None if commit == "auto" else commit,
                                     True, pipeline)
        cd = eng.spec.compiled_draft if eng.spec is not None else None
        traces0 = cd.traces if cd is not None else 0
        wall = run_steps(eng, args.steps)  # uninstrumented: the step as served
        retraced = (cd.traces if cd is not None else 0) - traces0  # drafter traces built by steady-state steps
        phases = Phases()
        undo = instrument(eng, phases)
        step = phases.wrap("step", eng.step)
        try:
            mx.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            mx.synchronize()
            wall_inst = 1e3 * (time.perf_counter() - t0) / args.steps
        finally:
            restore(undo)
        host = {k: round(1e3 * v / args.steps, 3) for k, v in sorted(phases.total.items(), key=lambda kv: -kv[1])}
        host["other"] = host.pop("step", 0.0)
        ks = kernel_events(lambda: run_steps(eng, args.steps))
        graph = graph_of_step(eng)
        prof = host_profile(lambda: run_steps(eng, args.steps), args.profile) if args.profile else None
        spec_bench.cancel_all(eng)
    per = collections.defaultdict(list)
    for s, e, name in ks:
        per[short(name)].append(e - s)
    top = sorted(((k, len(d) / args.steps, sum(d) / args.steps) for k, d in per.items()), key=lambda t: -t[2])
    row = {"seqs": S, "n_draft": f"{n} (drafter loaded)" if idle else n, "pipeline": "on" if pipeline else "off", "commit": commit, "step_ms": round(wall, 3),
           "step_ms_instrumented": round(wall_inst, 3), "host_ms": host, "graph_nodes": graph,
           "drafter_traces_built": retraced}
    if prof:
        row["host_profile"] = [dict(p, self_ms=round(p["self_ms"] / args.steps, 3), cum_ms=round(p["cum_ms"] / args.steps, 3))
                               for p in prof]  # per step
    if ks:
        row.update(busy_ms=round(busy_us(ks) / 1e3 / args.steps, 3), kernels_per_step=round(len(ks) / args.steps, 1),
                   top=[{"name": k, "per_step": round(c, 1), "ms_per_step": round(t / 1e3, 3)} for k, c, t in (top[: args.top] if args.top else top)])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["9b", "demo"], default="9b")
    ap.add_argument("--bits", type=int, default=4, help="target quantization bits (0 = bf16)")
    ap.add_argument("--draft-bits", type=int, default=0, help="drafter quantization bits (0 = bf16, as published)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1])
    ap.add_argument("--n-draft", type=int, nargs="+", default=[0, 7, 15], help="0: the plain engine (no drafter)")
    ap.add_argument("--idle", action="store_true",
                    help="also trace each --seqs with the drafter loaded and nobody drafting (what a drafter costs a "
                         "step where the policy drafts for no one: the target's taps and the drafter's context writes)")
    ap.add_argument("--pipeline", nargs="+", choices=["off", "on"], default=["off"])
    ap.add_argument("--commit", nargs="+", choices=["auto", "candidates", "replay"], default=["auto"],
                    help="Engine(verify_commit=...); auto: the engine's choice per step")
    ap.add_argument("--accept", type=int, default=6, help="force min(K, n_draft) accepted drafts per verification")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=0, help="kernel rows kept per row (0: all)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also run --steps steps under cProfile and keep the N Python functions with the most self time")
    ap.add_argument("--variants", nargs="*", default=[], metavar="ROW=V[,ROW=V]",
                    help="selection rows each row is also traced under, back to back with the defaults")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variants = {"defaults": {}, **{v: parse_rows(v, source="--variants") for v in args.variants}}  # typos fail now
    model = spec_bench.build_target(args.shape, args.bits)
    drafter = spec_bench.random_drafter(args.shape, model, args.draft_bits)
    print(f"device {mx.default_device()}, target {args.shape}, context {args.prompt_len}, accept {args.accept}", flush=True)
    rows = []

    def emit(r: dict, tag: str) -> None:
        r["variant"] = tag
        rows.append(r)
        print(json.dumps(r), flush=True)
        if args.json:  # after every row: a run cut short keeps what it traced
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "device": str(mx.default_device()), "rows": rows}, f, indent=1)

    for S in args.seqs:
        for n in args.n_draft:
            # a forced mode equal to the engine's own choice at this n_draft repeats the "auto" row
            modes = [c for c in args.commit if not ("auto" in args.commit and c == speculative.commit_mode_for(n, S))]
            for (pl, cm), (tag, sel) in itertools.product(
                    [(p, c) for p in args.pipeline for c in modes] if n else [("off", "auto")], variants.items()):
                with selected(sel):
                    emit(trace_row(model, drafter, S, n, pl == "on", args, cm), tag)
        if args.idle:
            for tag, sel in variants.items():
                with selected(sel):
                    emit(trace_row(model, drafter, S, 0, False, args, idle=True), tag)
    print("\n| seqs | n_draft | pipeline | commit | variant | step ms | device busy ms | kernels | graph nodes | host ms by phase (instrumented) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        h = ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms"].items() if v >= 0.05)
        print(f"| {r['seqs']} | {r['n_draft']} | {r['pipeline']} | {r['commit']} | {r['variant']} | {r['step_ms']:.2f} "
              f"| {r.get('busy_ms', float('nan')):.2f} | {r.get('kernels_per_step', 0):.0f} | {r['graph_nodes']['total']} | {h} |")
    for r in rows:
        if r.get("top"):
            print(f"\n{r['seqs']} seqs, n_draft {r['n_draft']}, pipeline {r['pipeline']}, {r['variant']}: "
                  + "; ".join(f"{t['name']} {t['per_step']:g}x {t['ms_per_step']:.2f} ms" for t in r["top"][:12]))
        for p in r.get("host_profile", [])[:15]:
            print(f"  host {p['self_ms']:7.3f} ms self {p['cum_ms']:7.3f} cum {p['calls']:6d} calls  {p['fn']}")
        print(f"  drafter traces built in the timed steps: {r['drafter_traces_built']}")
        g = r["graph_nodes"]
        print(f"  graph: {g['total']} nodes; " + ", ".join(f"{k} {v}" for k, v in list(g.items())[1:16]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
