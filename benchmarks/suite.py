"""Several benchmark scripts in one process, on one set of random weights.

A device call is short (10 minutes) and every fresh process pays the same start-up: building the random
Qwen3.5-9B weights and compiling each kernel instantiation on first use (~30 s). This driver pays it
once and then runs the named parts in order, each under its own time limit, so a slow part loses only
its own numbers. Each part is the script's own `main(argv)`; its JSON goes to --out.

    source .device/env.sh && python benchmarks/suite.py --out $OUT --parts check:60 e2e:240 runtime:90

(`benchmarks/device_run.sh suite=check:60,e2e:240` runs it as one part of a device call.)

Parts (NAME:SECONDS):
  check    the engine's greedy tokens with the compiled step, in-place state writes and fused decode
           launches against the uncompiled step without them (functional scatters, separate norms), and
           both against the one-shot forward: where they differ, the reference's top-2 gap says whether
           it was a near-tie
  e2e      benchmarks/e2e_bench.py (mtlqwen vs mlx-lm)
  runtime  benchmarks/runtime_bench.py (1 / 4 / 8 concurrent)
  prefix   benchmarks/prefix_cache_bench.py (off / cold / warm)
  spec     benchmarks/spec_bench.py (speculative step cost)
Extra arguments for a part: --args PART="..." (split on spaces). A part written NAME@ROWS:SECONDS runs under
those selection rows (ROW=V[,ROW=V], as MTLQWEN_SELECT), its JSON named after them, so one process times
variants back to back on the same weights: --parts prefix:100 prefix@prefill_eval_layers=4:100
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import traceback
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import build_model  # noqa: E402
from mtlqwen.kernels.selection import parse_rows, selected  # noqa: E402
from mtlqwen.model.builtin import SHAPES  # noqa: E402


class PartTimeout(BaseException):
    """A part's time limit. Not an Exception: the kernels' dispatch turns a kernel off on any Exception raised
    while it builds or launches one, and the limit firing there is not the kernel's failure."""


def _alarm(signum, frame):
    raise PartTimeout


def split_part(p: str) -> tuple[str, str, str]:
    """"NAME[@ROWS][:SECONDS]" -> (NAME, ROWS, SECONDS); ROWS may hold ':'-free "ROW=V,ROW=V"."""
    spec, _, secs = p.rpartition(":") if ":" in p else (p, "", "")
    name, _, rows = spec.partition("@")
    return name, rows, secs


def json_name(base: str, tag: str) -> str:
    """A part's JSON file, named after its selection rows when it ran under some (file-name-safe)."""
    return base.replace(".json", "-" + re.sub(r"[^A-Za-z0-9_]+", "-", tag) + ".json") if tag else base


def check(model, argv: list[str], out: str, tag: str = "") -> None:
    """Compiled decode with the selection table's in-place writes and fused launches vs uncompiled without
    them vs the one-shot forward."""
    from mtlqwen.runtime import Engine, SamplingParams  # noqa: PLC0415

    vocab, gen = model.config.vocab_size, 48
    rng = np.random.default_rng()
    lens = [int(a) for a in argv] or [300, 129, 7, 1]  # 5+ prompts: decode rows reach the tensor-core qmv
    prompts = [rng.integers(0, vocab, n).tolist() for n in lens]
    # the decode-path variants the baseline switches off: in-place state writes and the fused launches; the
    # compiled run uses the selection table as it stands
    unfused = {k: 0 for k in ("gdn_state_inplace", "conv_state_inplace", "gdn_fused_norm", "qmv_residual_norm")}

    def run(compiled: bool, rows: dict) -> list[list[int]]:
        with selected(rows):
            eng = Engine(model, slots=len(prompts), step_tokens=128, num_blocks=4 * len(prompts), prefix_interval=0, compile_decode=compiled)
            outs = eng.generate(prompts, SamplingParams(max_tokens=gen, ignore_eos=True))
            st = eng.stats()
            assert st["free_blocks"] == st["total_blocks"] and st["running"] == 0, st
            return [o.token_ids for o in outs]

    base = run(False, unfused)
    new = run(True, {})
    report = []
    for p, a, b in zip(prompts, base, new):
        rows = np.asarray(model.logits(p + a[:-1])[len(p) - 1 :].astype(mx.float32))
        gaps = [(r.max() - r[t]) / np.abs(r).max() for t, r in zip(a, rows)]  # 0 where a is the argmax
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        top2 = None
        if first is not None:
            s = np.sort(rows[first])[-2:]
            top2 = float((s[1] - s[0]) / np.abs(rows[first]).max())
        report.append({"prompt_len": len(p), "first_difference": first, "ref_top2_gap_there": top2,
                       "uncompiled_vs_one_shot_differ": int(sum(g > 0 for g in gaps)),
                       "worst_gap": float(max(gaps))})
        print(f"[check] prompt {len(p):4d}: compiled+fused vs uncompiled+unfused first differs at "
              f"{first} (ref top-2 gap there {top2}); uncompiled vs one-shot: "
              f"{report[-1]['uncompiled_vs_one_shot_differ']} of {gen} differ, worst gap {max(gaps):.2e}", flush=True)
    if out:
        with open(os.path.join(out, json_name("check.json", tag)), "w") as f:
            json.dump({"mlx": mx.__version__, "gen": gen, "prompts": report}, f, indent=1)


def script_part(module: str, base: str):
    def run(model, argv: list[str], out: str, tag: str = "") -> None:
        mod = __import__(module)
        mod.main(argv + (["--json", os.path.join(out, json_name(base, tag))] if out else []))
    return run


PARTS = {
    "check": check,
    "e2e": script_part("e2e_bench", "e2e.json"),
    "runtime": script_part("runtime_bench", "runtime.json"),
    "prefix": script_part("prefix_cache_bench", "prefix.json"),
    "spec": script_part("spec_bench", "spec.json"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", required=True, help="NAME:SECONDS, run in this order")
    ap.add_argument("--args", nargs="*", default=[], help='PART="extra arguments" for that part\'s script')
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for each part's JSON")
    args = ap.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    extra = {k: v.split() for k, _, v in (a.partition("=") for a in args.args)}
    for p in args.parts:
        name, rows, secs = split_part(p)
        if name not in PARTS:
            ap.error(f"unknown part {p!r}; parts: {', '.join(PARTS)}")
        if secs and not secs.isdigit():
            ap.error(f"part {p!r}: the time limit {secs!r} is not a whole number of seconds")
        try:
            parse_rows(rows, source="--parts")  # a typo fails before the weights are built
        except ValueError as e:
            ap.error(str(e))

    t = time.perf_counter()
    model, name = build_model(SimpleNamespace(model=None, shape=args.shape, bits=4, group_size=64))
    print(f"[suite] {name} built in {time.perf_counter() - t:.1f} s on {mx.default_device()}, MLX {mx.__version__}",
          flush=True)
    signal.signal(signal.SIGALRM, _alarm)
    status = {}
    for p in args.parts:
        part, tag, secs = split_part(p)
        spec = f"{part}@{tag}" if tag else part
        argv_p = (["--shape", args.shape] if part != "check" else []) + extra.get(part, [])
        t = time.perf_counter()
        signal.alarm(int(secs or 0))
        try:
            with selected(parse_rows(tag, source="--parts")):
                if tag:
                    print(f"[suite] {spec}: under {tag}", flush=True)
                PARTS[part](model, argv_p, args.out, tag)
            status[spec] = "ok"
        except PartTimeout:
            status[spec] = f"cut at its {secs} s limit"
        except Exception:  # one part's failure must not take the others' numbers with it
            traceback.print_exc()
            status[spec] = "failed"
        finally:
            signal.alarm(0)
        mx.synchronize()
        mx.clear_cache()
        print(f"[suite] {spec}: {status[spec]} after {time.perf_counter() - t:.1f} s", flush=True)
    print("[suite] " + ", ".join(f"{k} {v}" for k, v in status.items()))
    return 0 if all(v == "ok" for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
