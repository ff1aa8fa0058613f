"""Which kernels each drafter call of a speculative step launches, call by call (H200 diagnostics).

spec_trace.py counts a step's kernels together; this runs the engine as spec_trace does (9B target, the
z-lab drafter shape, forced acceptance), captures the step's drafter calls (the proposal and the context
write) with their arguments, and replays each alone, compiled and uncompiled, under CUPTI: kernels per call
by name, and their device time; for the compiled calls, their graph's primitives and one call's kernels in
launch order. Before that, each compiled call is traced afresh under a dispatch census:
per op, the calls that took the fallback, and the ops switched off. What it answers: where the step's large
bf16 copies come from (an in-place pool write that falls back is a scatter that copies the pool).

    source .device/env.sh && python benchmarks/drafter_kernels.py --seqs 1 8 --n-draft 7 --json $OUT/drafter-kernels.json
    python benchmarks/drafter_kernels.py --pretend-cuda --seqs 1 8   # the census alone, any machine (no engine)
    source .device/env.sh && python benchmarks/drafter_kernels.py --seqs 1 8 --pool-blocks 64 2048   # copies by pool size
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
from mtlqwen.kernels import dispatch
from mtlqwen.model.compiled_draft import CompiledDraft
from decode_profile import count_primitives
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


def kernel_order(run) -> list[str]:
    """One call's kernels in launch order, runs of one name folded ("name x3"): which op each copy sits beside."""
    names = [short(n) for _, _, n in sorted(kernel_events(run))]
    out: list[list] = []
    for n in names:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return [n if c == 1 else f"{n} x{c}" for n, c in out]


def dispatch_census(run) -> dict:
    """Per op, how many of its calls in run() took the fallback (the reference or composed ops), beside all its
    calls; and the ops switched off by then. A compiled call must be traced inside run() to be seen (a replay
    runs no Python). An in-place write that falls back becomes a functional scatter, which copies the whole
    pool when the pool cannot be donated: the lead for the bf16 copies."""
    calls, fell = collections.Counter(), collections.Counter()
    real_call = dispatch.Op.__call__
    wrapped = {}

    def counting(op, *a, **kw):
        calls[op.name] += 1
        if op.name not in wrapped:
            fb = op.fallback
            wrapped[op.name] = fb

            def fallback(*a2, _fb=fb, _name=op.name, **kw2):
                fell[_name] += 1
                return _fb(*a2, **kw2)

            op.fallback = fallback
        return real_call(op, *a, **kw)

    dispatch.Op.__call__ = counting
    try:
        run()
        mx.synchronize()
    finally:
        dispatch.Op.__call__ = real_call
        for name, fb in wrapped.items():
            dispatch.OPS[name].fallback = fb
    return {"ops": {n: {"calls": c, "fallbacks": fell[n]} for n, c in sorted(calls.items())},
            "switched_off": {n: op.failed for n, op in dispatch.OPS.items() if op.failed}}


def synthetic_calls(model, drafter, S: int, n_draft: int, num_blocks: int) -> dict:
    """The drafter's four calls (proposal and (n_draft + 1)-row context write, compiled and eager) over S
    synthetic sequences (600 tokens of context, blocks 8i..8i+7 each) and pools of num_blocks blocks, the last
    the compiled context write's scratch: {name: run()} with nothing evaluated."""
    from mtlqwen.kernels import SeqLayout  # noqa: PLC0415

    B, bt = n_draft + 1, 128
    dc = drafter.make_cache(model.make_cache(num_blocks=num_blocks, num_slots=S, block_tokens=bt))
    cd = CompiledDraft(drafter, scratch_block=num_blocks - 1)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(S)]
    lay = SeqLayout(list(range(S + 1)), [600] * S, tables, list(range(S)), bt)
    clay = SeqLayout([B * i for i in range(S + 1)], [600] * S, tables, list(range(S)), bt)
    taps = mx.zeros((B * S, drafter.fc.in_features), dtype=mx.bfloat16)
    anchors = mx.array([1] * S, dtype=mx.int32)
    return {"propose compiled": lambda: [cd.propose(anchors, lay, dc, n_draft), *dc.arrays()],
            "context compiled": lambda: (cd.write_context(taps, clay, dc), dc.arrays())[1],
            "propose eager": lambda: [drafter.propose(anchors, lay, dc, n_draft), *dc.arrays()],
            "context eager": lambda: (drafter.write_context(taps, clay, dc), dc.arrays())[1]}


def pool_copies(shape: str, seqs: list[int], n_draft: int, pool_blocks: list[int], calls: int = 5) -> list[dict]:
    """Copy kernels a call launches, by pool size (GPU): whether a call's copies grow with the drafter's pools."""
    model = spec_bench.build_target(shape, 4)
    drafter = spec_bench.random_drafter(shape, model)
    out = []
    for S in seqs:
        for nb in pool_blocks:
            for name, run in synthetic_calls(model, drafter, S, n_draft, nb).items():
                for _ in range(3):
                    mx.eval(run())
                per = collections.defaultdict(list)
                for s, e, k in kernel_events(lambda: [mx.eval(run()) for _ in range(calls)]):
                    per[short(k)].append(e - s)
                copies = {k: {"per_call": len(d) / calls, "us_per_call": round(sum(d) / calls, 1)}
                          for k, d in per.items() if "copy" in k}
                out.append({"seqs": S, "pool_blocks": nb, "call": name, "copies": copies})
                print(f"## {S} seqs, pools of {nb} blocks, {name}: copies {copies or 'none'}", flush=True)
            mx.clear_cache()
    return out


def pretend_census(shape: str, seqs: list[int], n_draft: int) -> None:
    """The census of the compiled proposal and an (n_draft + 1)-row context write a sequence under the CUDA
    dispatch on any machine (host_build.pretend_cuda: stand-in kernels, nothing evaluated), on synthetic
    layouts (600 tokens of context, 8 blocks a sequence): which paths the dispatch picks at each size."""
    import host_build  # noqa: PLC0415

    model = spec_bench.build_target(shape, 4)
    drafter = spec_bench.random_drafter(shape, model)
    host_build.pretend_cuda()
    for S in seqs:
        calls = synthetic_calls(model, drafter, S, n_draft, 8 * S + 2)
        for name in ("propose compiled", "context compiled"):
            c = dispatch_census(calls[name])
            fb = {n: f"{v['fallbacks']}/{v['calls']}" for n, v in c["ops"].items() if v["fallbacks"]}
            print(f"## {S} seqs, {name} traced (CUDA dispatch pretended): fallbacks {fb or 'none'}; "
                  f"switched off {c['switched_off'] or 'none'}", flush=True)


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
    ap.add_argument("--pool-blocks", type=int, nargs="+", default=None,
                    help="only the copy kernels of each call on synthetic layouts, by drafter pool size (pool_copies)")
    ap.add_argument("--pretend-cuda", action="store_true",
                    help="only the dispatch census, under the CUDA dispatch on this machine (pretend_census)")
    args = ap.parse_args(argv)
    if args.pretend_cuda:
        pretend_census(args.shape, args.seqs, args.n_draft)
        return 0
    if args.pool_blocks:
        rows = pool_copies(args.shape, args.seqs, args.n_draft, args.pool_blocks)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": sys.argv, "mlx": mx.__version__, "pool_copies": rows}, f, indent=1)
        return 0
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
            # a fresh trace of each compiled call under the census (the engine's traces replay without Python)
            fresh = CompiledDraft(sp.drafter, scratch_block=cd.scratch_block)
            census = {}
            if "propose" in got:
                census["propose compiled"] = dispatch_census(
                    lambda: mx.eval(fresh.propose(got["propose"][0], got["propose"][1], dc, got["propose"][2]),
                                    dc.arrays()))
            if "context" in got:
                census["context compiled"] = dispatch_census(
                    lambda: (fresh.write_context(*got["context"][:2], dc, got["context"][2]), mx.eval(dc.arrays())))
            # the compiled calls' graphs and launch order (where an unexplained copy sits)
            where = {}
            if "propose" in got:
                a, lay, n = got["propose"]
                where["propose compiled"] = {"graph": count_primitives([cd.propose(a, lay, dc, n), *dc.arrays()]),
                                             "order": kernel_order(lambda: mx.eval(cd.propose(a, lay, dc, n),
                                                                                   dc.arrays()))}
            if "context" in got:
                t, lay, r = got["context"]
                cd.write_context(t, lay, dc, r)
                where["context compiled"] = {"graph": count_primitives(dc.arrays()),
                                             "order": kernel_order(lambda: (cd.write_context(t, lay, dc, r),
                                                                            mx.eval(dc.arrays())))}
            mx.eval(dc.arrays())
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
        for name, c in census.items():
            fb = {n: f"{v['fallbacks']}/{v['calls']}" for n, v in c["ops"].items() if v["fallbacks"]}
            print(f"## {S} seqs, {name} traced: fallbacks {fb or 'none'}; switched off {c['switched_off'] or 'none'}")
        for name, w in where.items():
            print(f"## {S} seqs, {name}: graph {w['graph']}")
            print("   launch order: " + " | ".join(w["order"]))
        for name, r in rows.items():
            ks = r["kernels"]
            print(f"## {S} seqs, {name}: {r['wall_ms']:.2f} ms a call, {sum(v['per_call'] for v in ks.values()):.0f} "
                  f"kernels, {sum(v['us_per_call'] for v in ks.values()):.0f} us of kernels", flush=True)
            for k, v in list(ks.items())[:12]:
                print(f"   {k:50s} {v['per_call']:6.1f} {v['us_per_call']:8.1f} us")
        out.append({"seqs": S, "n_draft": args.n_draft, "calls": rows, "dispatch": census, "where": where})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "mlx": mx.__version__, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
