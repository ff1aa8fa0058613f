"""Speculative decoding end to end: the engine's decode rate with a drafter against without, per batch size.

    python benchmarks/spec_e2e_bench.py --seqs 1 8 32 --accept 5        # Qwen3.5-9B shape + the 9B drafter shape
    python benchmarks/spec_e2e_bench.py --shape demo --seqs 2 --prompt-len 32 --gen 24 --accept 3 --policy fixed --n-draft 3   # CPU smoke

spec_bench.py times one step of each kind; this runs the engine as `Engine.generate` does and counts tokens.
S requests of --prompt-len random tokens are submitted together (EOS ignored, --gen tokens each); once every
one of them is decoding, the engine steps until all finish, and the decode rate is the generated tokens over
that time (every host cost of a step included: scheduling, the draft policy, read-back, commit).

Weights are random (spec_bench.py's target and drafter), so the drafter's own proposals are almost never
accepted: --accept K makes every verification accept min(K, its drafts) drafts (spec_bench.forced_acceptance),
so a step that drafts n >= K yields tau = K + 1 tokens. The adaptive policy (the engine's default on the GPU
kernels; --policy) sees that acceptance and picks each step's draft length from its step-cost table, or no
drafting where the table says a plain step yields more (large batches). Reported per batch size: plain and
speculative tok/s, their ratio, tau (mean_acceptance_length) and the share of steps that verified (of
every step of the measured pass, its prefill steps included). --repeats R times R rounds of the engines in turn
(medians); --idle adds the drafter's engine with a table by which drafting never pays (what a loaded drafter
costs when it never drafts); --profile TOP adds a cProfile pass of each engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import mlx.core as mx

from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.block_pool import BlockPool
from mtlqwen.runtime.draft_policy import H200_9B_COMPILED_COSTS, StepCosts

import bench_common
from spec_bench import build_target, forced_acceptance, random_drafter, write_json


def decode_rate(eng: Engine, prompts: list[list[int]], gen: int, speculative: bool) -> tuple[float, int]:
    """(generated tok/s from the step where every request decodes to the last finish, tokens counted)."""
    sp = SamplingParams(max_tokens=gen, ignore_eos=True, speculative=speculative)
    return bench_common.decode_rate(eng, prompts, [sp] * len(prompts))


def engine_for(model, drafter, S: int, args, pipeline: bool | None = None, learn: str = "auto") -> Engine:
    need = BlockPool.blocks_for(args.prompt_len + args.gen + 32, 128)
    learn = {"auto": None, "on": True, "off": False}[learn] if args.policy == "adaptive" else None
    spec = dict(draft=drafter, draft_policy=args.policy, n_draft=args.n_draft, spec_pipeline=pipeline,
                learn_draft_costs=learn, **({"draft_costs": args.costs} if args.costs else {})) if drafter is not None else {}
    return Engine(model, slots=S, block_tokens=128, num_blocks=S * need + 1, prefix_interval=0, **spec)


def never_paying(costs: StepCosts) -> StepCosts:
    """`costs` with every speculative cell 1,000 times its plain one: the policy never drafts, while the engine
    still runs what a loaded drafter costs (the target's taps, the drafter's context writes)."""
    return StepCosts(costs.seqs, costs.drafts, tuple((r[0],) + tuple(1000 * r[0] for _ in r[1:]) for r in costs.ms))


def run(model, drafter, S: int, args, pipeline: str = "auto", learn: str = "auto") -> dict:
    """One batch size: a warm-up pass of each engine (compiles its traces), then --repeats timed rounds, each
    timing the engines in turn (a host whose speed drifts moves every engine of a round alike); rates are the
    rounds' medians, the speed-up the median of the rounds' ratios."""
    prompts = mx.random.randint(0, model.config.vocab_size, (S, args.prompt_len), key=mx.random.key(S)).tolist()
    engines = {"plain": (engine_for(model, None, S, args), False)}
    if args.idle:
        table = StepCosts.load(args.costs) if args.costs else H200_9B_COMPILED_COSTS
        idle_args = argparse.Namespace(**{**vars(args), "policy": "adaptive", "costs": never_paying(table)})
        engines["idle"] = (engine_for(model, drafter, S, idle_args, None, "off"), True)
    spec = engine_for(model, drafter, S, args, {"auto": None, "on": True, "off": False}[pipeline], learn)
    engines["spec"] = (spec, True)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, int] = {}  # generated in a pass, per engine (the same unless one failed)
    with forced_acceptance(args.accept):
        for rnd in range(1 + args.repeats):  # the first pass meets every trace of the workload; the rest are timed
            for name, (eng, speculative) in engines.items():
                if name == "spec" and rnd == 1:
                    s0 = {k: spec.stats()[k] for k in ("spec_steps", "plain_steps", "accepted_tokens",
                                                      "spec_verifications", "spec_pipelined_steps")}
                rate, tokens[name] = decode_rate(eng, prompts, args.gen, speculative)
                if rnd:
                    rates[name].append(rate)
        profiles = {name: bench_common.host_profile(lambda e=eng, sp=speculative: decode_rate(e, prompts, args.gen, sp),
                                                    args.profile)
                    for name, (eng, speculative) in engines.items()} if args.profile else None
    st = spec.stats()
    d = {k: st[k] - s0[k] for k in s0}
    steps = d["spec_steps"] + d["plain_steps"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {"seqs": S, "accept": args.accept, "policy": st["draft_policy"], "pipeline": pipeline, "learn": learn,
           "repeats": args.repeats, "pipelined_steps": d["spec_pipelined_steps"] / args.repeats,
           "plain_tok_s": med["plain"], "spec_tok_s": med["spec"],
           "speedup": statistics.median(s / p for s, p in zip(rates["spec"], rates["plain"])),
           "tau": 1 + d["accepted_tokens"] / max(1, d["spec_verifications"]),
           "verifying_step_share": d["spec_steps"] / max(1, steps), "steps": steps / args.repeats,
           "tokens": tokens, "rates": rates}
    if args.idle:
        out["idle_tok_s"] = med["idle"]
        out["idle_speedup"] = statistics.median(i / p for i, p in zip(rates["idle"], rates["plain"]))
    if "step_cost_ratios" in st:
        out["step_cost_ratios"] = st["step_cost_ratios"]
    if profiles:
        out["host_profile"] = profiles
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["9b", "demo"], default="9b")
    ap.add_argument("--bits", type=int, default=4, help="target quantization bits (0 = bf16)")
    ap.add_argument("--draft-bits", type=int, default=0, help="drafter quantization bits (0 = bf16, as published)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--accept", type=int, default=5, help="drafts each verification accepts (tau = K + 1)")
    ap.add_argument("--policy", choices=["adaptive", "fixed"], default="adaptive")
    ap.add_argument("--n-draft", type=int, default=None, help="Engine(n_draft=...): fixed drafts, adaptive's cap")
    ap.add_argument("--costs", default=None, help="the adaptive policy's step-cost table: spec_bench.py --json output "
                                                  "(default: the engine's own)")
    ap.add_argument("--learn", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                    help="Engine(learn_draft_costs=...), each a row: the adaptive policy corrects its table with the "
                         "engine's own step times (auto: the engine's default, off)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256, help="tokens generated per request")
    ap.add_argument("--pipeline", nargs="+", choices=["auto", "off", "on"], default=["auto"],
                    help="Engine(spec_pipeline=...) of the drafter's engine, each a row (auto: the engine's default)")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds after the warm-up pass (medians reported)")
    ap.add_argument("--idle", action="store_true",
                    help="also time the drafter's engine with a table by which drafting never pays: what a loaded "
                         "drafter costs when it never drafts (the target's taps, its context writes)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="after the timed rounds, one more pass of each engine under cProfile: the TOP functions by "
                         "the host's self time (in the JSON; not in the rates)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.accept < 0:
        ap.error("--accept must be >= 0")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.profile < 0:
        ap.error("--profile must be >= 0 (0: no profile pass)")
    model = build_target(args.shape, args.bits)
    drafter = random_drafter(args.shape, model, args.draft_bits)
    print(f"device {mx.default_device()}, target {args.shape}, drafter {drafter.config.num_hidden_layers} layers, "
          f"{args.policy} policy, accept {args.accept} (tau {args.accept + 1} when drafting >= {args.accept})",
          flush=True)
    rows = []
    for S in args.seqs:
        for pl, learn in itertools.product(args.pipeline, args.learn):
            rows.append(run(model, drafter, S, args, pl, learn))
            print(json.dumps(rows[-1]), flush=True)
            write_json(args, rows)  # after every row: a run cut short keeps what it measured
    idle = args.idle
    for r in rows:
        for name, prof in (r.get("host_profile") or {}).items():
            print(f"host profile, {r['seqs']} seqs, {name} engine (self ms over the pass):")
            for p in prof[:12]:
                print(f"  {p['self_ms']:9.1f} {p['calls']:7d}  {p['fn']}")
    print("\n| seqs | pipeline | learn | plain tok/s |" + (" drafter idle tok/s |" if idle else "") +
          " with drafter tok/s | speed-up | tau | steps that verified |")
    print("|---|---|---|---|" + ("---|" if idle else "") + "---|---|---|---|")
    for r in rows:
        idle_cell = f" {r['idle_tok_s']:.1f} ({r['idle_speedup']:.2f}x) |" if idle else ""
        print(f"| {r['seqs']} | {r['pipeline']} | {r['learn']} | {r['plain_tok_s']:.1f} |{idle_cell} "
              f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} | {r['verifying_step_share']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
