"""Prefix-cache benchmark: requests sharing a long system prompt, and a multi-turn chat, cache off and on.

    python benchmarks/prefix_cache_bench.py                     # Qwen3.5-9B shape, random weights, 4-bit g64
    python benchmarks/prefix_cache_bench.py --shape demo --system-len 96 --question-len 8 \\
        --interval 32 --block-tokens 16 --gen-len 4 --repeats 1 \\
        --chat-turns 3 --turn-len 40 --turn-gen 8              # quick CPU smoke run

--requests requests (8) of --system-len shared tokens (2048) + --question-len distinct tokens (64) are
submitted at once and run to completion (EOS ignored: each generates exactly --gen-len tokens). Modes:
  off    prefix_interval=0
  cold   the cache on but empty: the requests arrive together, so one computes the system prompt and
         the others wait for its snapshot (README, "shared prompts arriving together"), then restore it
  warm   the cache on, after one earlier request with the same system prompt (another question) put
         the system prompt's snapshots in: each request restores the longest one and computes the rest
  chat-off, chat
         one conversation of --chat-turns turns, cache off / on: turn k's prompt is turn k-1's prompt, its
         reply (--turn-gen tokens) and --turn-len new tokens; with the cache each turn restores the
         previous turn's entry. Reported: TTFT of every turn, and turn N's over turn 1's.
Before the modes, one short generate compiles the kernels. Each mode then runs --discard untimed repeats
(1) of its own workload with other questions: the first run at the real shapes pays first-use compiles
(several times a clean run's TTFT; benchmarks/prefix_cache.md), which would turn a median of 3 into the
worse of the two clean repeats. --variants runs selection rows (kernels/selection.py) beside the defaults,
each a fresh engine in this process (--interleave alternates the settings round by round). Reported per mode
(median over --repeats): TTFT mean and max over the requests, total wall time, prompt tokens served from
the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from mtlqwen.kernels.selection import parse_rows, selected
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.block_pool import BlockPool

from bench_common import (DENSE_WEIGHTS, add_dense_weights_arg, add_model_args, build_model, host_profile, timed_generate,
                          ttft_ms, write_json)


def tokens(rng, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, size=n)]


def run(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[dict, list[list[int]]]:
    outs, wall, first = timed_generate(engine, prompts, gen_len)
    res = {**ttft_ms(first), "wall_s": wall, "hit_tokens": sum(o.cached_tokens for o in outs)}
    return res, [o.token_ids for o in outs]


def earlier_request(engine: Engine, system: list[int], question_len: int, vocab: int, seed: int) -> None:
    """Warm mode: an earlier request with the same system prompt (another question) puts its snapshots in;
    its own generator, so the measured requests' questions stay those of the off mode."""
    engine.generate([system + tokens(np.random.default_rng(seed), question_len, vocab)], SamplingParams(max_tokens=1))


def ttft_phases(engine: Engine, prompts: list[list[int]]) -> dict:
    """The same prompts once more, one token each, with the host's time per step phase (ms, exclusive of the
    phases nested in it; spec_trace.Phases): what the time to first token is made of. "read-back" includes
    waiting for the device; "other" is the rest of the generate loop."""
    import spec_trace  # noqa: PLC0415
    from mtlqwen.runtime import engine as engine_mod  # noqa: PLC0415

    phases = spec_trace.Phases()
    undo = spec_trace.instrument(engine, phases)
    for obj, attr, name in ((engine.scheduler, "schedule", "schedule"), (engine.kv, "step_snapshots", "restores"),
                            (engine.model, "forward", "forward (eager: building it)"), (engine_mod, "pack", "pack"),
                            (engine_mod, "sample_isolating", "sampling")):
        undo.append((obj, attr, getattr(obj, attr), attr in vars(obj)))
        setattr(obj, attr, phases.wrap(name, getattr(obj, attr)))
    steps = engine.counters["steps"]
    mx.synchronize()
    t0 = time.perf_counter()
    try:
        phases.wrap("other", engine.generate)(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        spec_trace.restore(undo)
    wall = 1e3 * (time.perf_counter() - t0)
    return {"wall_ms": round(wall, 2), "steps": engine.counters["steps"] - steps,
            **{k: round(1e3 * v, 2) for k, v in sorted(phases.total.items(), key=lambda kv: -kv[1])}}


def step_plans(engine: Engine, prompts: list[list[int]], gen_len: int) -> dict:
    """The prompts once more (--gen-len tokens each): what each step computes until every request has sampled
    its first token, as "sequences x tokens" (+ requests held for a leader's snapshot), and the step that
    samples each request's first token. No timing: the scheduler's plans, the same on any machine."""
    plans, firsts, real = [], [], engine.scheduler.schedule

    def record():
        plan = real()
        if len(firsts) < len(prompts):
            toks = sorted({s.num_tokens for s in plan.scheduled})
            span = f"{toks[0]}" if len(toks) == 1 else f"{toks[0]}-{toks[-1]}"
            plans.append(f"{len(plan.scheduled)} x {span}" + (f" +{len(plan.held)} held" if plan.held else ""))
            firsts.extend(len(plans) for s in plan.scheduled if s.samples and s.sample_index == 0)
        return plan

    engine.scheduler.schedule = record
    try:
        engine.generate(prompts, SamplingParams(max_tokens=gen_len, ignore_eos=True))
    finally:
        engine.scheduler.schedule = real
    return {"steps": plans, "first_token_steps": sorted(firsts)}


def kernel_summary(engine: Engine, prompts: list[list[int]], top: int) -> dict:
    """The prompts once more, one token each, under CUPTI (step_trace.kernel_events): the call's wall time, the
    kernels it ran (count, busy time, first-to-last span) and the `top` kernels by total time, with counts."""
    from step_trace import busy_us, kernel_events, short  # noqa: PLC0415

    mx.synchronize()
    t0 = time.perf_counter()
    ks = kernel_events(lambda: engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True)))
    wall = 1e3 * (time.perf_counter() - t0)
    if not ks:
        return {"wall_ms_profiled": round(wall, 2), "kernels": 0}  # no CUPTI (a CPU run)
    per: dict[str, list[float]] = {}
    for a, b, name in ks:
        per.setdefault(short(name), []).append(b - a)
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"wall_ms_profiled": round(wall, 2), "kernels": len(ks), "busy_ms": round(busy_us(ks) / 1e3, 2),
            "span_ms": round((ks[-1][1] - ks[0][0]) / 1e3, 2),
            "top": [f"{n} x{len(d)} {sum(d) / 1e3:.2f} ms" for n, d in rows]}


def chat(engine: Engine, vocab: int, args, seed: int) -> tuple[dict, list[list[int]]]:
    """One conversation, turn by turn: (TTFT and cached tokens per turn, each turn's reply)."""
    rng = np.random.default_rng(seed)
    prompt, ttft, cached, replies = [], [], [], []
    for _ in range(args.chat_turns):
        prompt = prompt + tokens(rng, args.turn_len, vocab)
        (out,), _, first = timed_generate(engine, [prompt], args.turn_gen)
        ttft.append(1e3 * first[0])
        cached.append(out.cached_tokens)
        replies.append(out.token_ids)
        prompt = prompt + out.token_ids
    return {"ttft_ms": ttft, "cached_tokens": cached, "last_over_first": ttft[-1] / ttft[0]}, replies


def run_chat(model, args, mode: str, outputs: dict, engine_kw: dict) -> dict:
    chat_len = args.chat_turns * (args.turn_len + args.turn_gen)
    blocks = 3 * BlockPool.blocks_for(chat_len, args.block_tokens)  # the conversation, plus what entries hold
    kw = dict(engine_kw)
    in_step = kw.pop("in_step", False)
    engine = Engine(model, slots=1, step_tokens=args.step_tokens, block_tokens=args.block_tokens, num_blocks=blocks,
                    prefix_interval=0 if mode == "chat-off" else args.interval, max_model_len=chat_len + 1,
                    prefix_in_step=in_step and mode != "chat-off", **kw)
    warm = tokens(np.random.default_rng(999), min(chat_len, 2 * args.step_tokens), model.config.vocab_size)
    engine.generate([warm], SamplingParams(max_tokens=2, ignore_eos=True))  # compile the kernels
    runs, answers = [], []
    for r in range(-args.discard, args.repeats):  # r < 0: untimed, another conversation at the same shapes
        engine.clear_prefix_cache()
        res, replies = chat(engine, model.config.vocab_size, args, seed=2000 + r if r >= 0 else 3000 - r)
        if r >= 0:
            runs.append(res)
            answers.append(replies)
    med = {"ttft_ms": [statistics.median(x["ttft_ms"][t] for x in runs) for t in range(args.chat_turns)],
           "cached_tokens": runs[0]["cached_tokens"],
           "last_over_first": statistics.median(x["last_over_first"] for x in runs)}
    outputs[mode] = answers
    if mode == "chat" and "chat-off" in outputs:  # greedy: the cache must not change a reply (bf16 near-ties aside)
        pairs = [(a, b) for ra, rb in zip(outputs["chat-off"], answers) for a, b in zip(ra, rb)]
        med["same_tokens_as_off"] = f"{sum(a == b for a, b in pairs)} of {len(pairs)} turns"
    med["stats"] = {k: v for k, v in engine.stats().items() if k.startswith("prefix_")}
    print(f"{mode:>8} TTFT per turn ms: {' '.join(f'{t:.1f}' for t in med['ttft_ms'])} | "
          f"turn {args.chat_turns} / turn 1: {med['last_over_first']:.2f}x | cached: {med['cached_tokens']}", flush=True)
    return med


def run_modes(model, args, modes: list[str], system: list[int], blocks: int, engine_kw: dict) -> dict:
    """Every mode with Engine(**engine_kw): {mode: medians and stats}, printed as they come."""
    vocab, n = model.config.vocab_size, args.requests
    prompt_len = args.system_len + args.question_len
    results, outputs = {}, {}
    header = f"{'mode':>5} {'TTFT mean ms':>13} {'TTFT max ms':>12} {'total s':>9} {'hit tokens':>11} {'prompt tok':>11}"
    for mode in modes:
        if mode.startswith("chat"):
            results[mode] = run_chat(model, args, mode, outputs, engine_kw)
            continue
        interval = 0 if mode == "off" else args.interval
        kw = dict(engine_kw)
        in_step = kw.pop("in_step", False)
        engine = Engine(model, slots=n, step_tokens=max(args.step_tokens, n), block_tokens=args.block_tokens,
                        num_blocks=blocks, prefix_interval=interval, prefix_in_step=in_step and interval > 0, **kw)
        warm = tokens(np.random.default_rng(999), min(prompt_len, 2 * args.step_tokens), vocab)
        engine.generate([warm] * n, SamplingParams(max_tokens=2, ignore_eos=True))  # compile the kernels
        runs, answers = [], []
        for r in range(-args.discard, args.repeats):  # r < 0: untimed, other questions at the same shapes
            engine.clear_prefix_cache()
            qrng = np.random.default_rng(1 + r if r >= 0 else 500 - r)
            if mode == "warm":
                earlier_request(engine, system, args.question_len, vocab, 1000 + r if r >= 0 else 1500 - r)
            prompts = [system + tokens(qrng, args.question_len, vocab) for _ in range(n)]
            res, toks = run(engine, prompts, args.gen_len)
            if r >= 0:
                runs.append(res)
                answers.append(toks)
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        med["ttft_mean_ms_runs"] = [round(x["ttft_mean_ms"], 2) for x in runs]
        def once_more(engine=engine):  # the mode's starting point again, for one more run of the same prompts
            engine.clear_prefix_cache()
            if mode == "warm":
                earlier_request(engine, system, args.question_len, vocab, 999)

        if args.plans:
            once_more()
            med["plans"] = step_plans(engine, prompts, args.gen_len)
            print(f"{mode} step plans until every first token: {' | '.join(med['plans']['steps'])}; first tokens "
                  f"sampled in steps {med['plans']['first_token_steps']}", flush=True)
        if args.phases:
            once_more()
            med["phases"] = ttft_phases(engine, prompts)
            print(f"{mode} phases (host ms, one token each): {med['phases']}", flush=True)
        if args.kernels:  # the same once more under CUPTI: what the device runs before the first tokens
            once_more()
            med["kernels"] = kernel_summary(engine, prompts, args.kernels)
            print(f"{mode} kernels (one token each): {med['kernels']}", flush=True)
        if args.profile:  # the same once more under cProfile: the host's Python by function
            once_more()
            med["host_profile"] = host_profile(
                lambda engine=engine: engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True)), args.profile)
            for p in med["host_profile"][:15]:
                print(f"{mode} host {p['self_ms']:8.3f} ms self {p['cum_ms']:8.3f} cum {p['calls']:6d} calls  {p['fn']}",
                      flush=True)
        outputs[mode] = answers  # every mode sees the same prompts (the question seeds repeat)
        if mode != "off" and "off" in outputs:  # greedy: the cache must not change an answer (bf16 near-ties aside)
            pairs = [(a, b) for ra, rb in zip(outputs["off"], answers) for a, b in zip(ra, rb)]
            med["same_tokens_as_off"] = f"{sum(a == b for a, b in pairs)} of {len(pairs)} requests"
        med["stats"] = {k: v for k, v in engine.stats().items() if k.startswith("prefix_") or k == "preemptions"}
        results[mode] = med
        if sum(not m.startswith("chat") for m in results) == 1:
            print(header)
        print(f"{mode:>5} {med['ttft_mean_ms']:>13.1f} {med['ttft_max_ms']:>12.1f} {med['wall_s']:>9.2f} "
              f"{med['hit_tokens']:>11.0f} {n * prompt_len:>11}", flush=True)
        del engine
    for mode, med in results.items():
        if mode.startswith("chat"):
            print(f"{mode} engine stats: {med['stats']}" + (f"; same tokens as off: {med['same_tokens_as_off']}"
                                                           if "same_tokens_as_off" in med else ""))
            continue
        print(f"{mode} engine stats: {med['stats']}" + (f"; same tokens as off: {med['same_tokens_as_off']}"
                                                        if "same_tokens_as_off" in med else ""))
    if "off" in results and "warm" in results:
        off, on = results["off"], results["warm"]
        print(f"warm vs off: TTFT mean {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x, "
              f"total {off['wall_s'] / on['wall_s']:.2f}x")
    if "off" in results and "cold" in results:
        off, on = results["off"], results["cold"]
        print(f"cold vs off: TTFT mean {on['ttft_mean_ms'] / off['ttft_mean_ms']:.0%} of off, "
              f"total {on['wall_s'] / off['wall_s']:.0%} of off")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--interval", type=int, default=512, help="prefix_interval when the cache is on")
    ap.add_argument("--in-step", nargs="*", choices=["off", "on"], default=None,
                    help="Engine(prefix_in_step=True) when the cache is on: prefill chunks cross the boundaries (the flag "
                         "alone: on); 'off on': both in turn, in one process")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--discard", type=int, default=1, metavar="N",
                    help="untimed repeats of each mode's workload before its --repeats (other prompts, the same shapes): "
                         "they take the first-use compiles of the real shapes out of the medians; 0 keeps them in")
    ap.add_argument("--step-tokens", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--modes", default="off,cold,warm,chat-off,chat")
    ap.add_argument("--chat-turns", type=int, default=10)
    ap.add_argument("--turn-len", type=int, default=200, help="new tokens in each chat turn's prompt")
    ap.add_argument("--turn-gen", type=int, default=128, help="tokens generated in each chat turn")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also run each mode's prompts once (one token each) under cProfile; keep the N Python "
                         "functions with the most self time")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="after each shared-prompt mode's repeats, one more run with one token each under CUPTI: the "
                         "kernels it ran, their busy time and span, and the N that took the most time")
    ap.add_argument("--plans", action="store_true",
                    help="after each shared-prompt mode's repeats, one more run: what each step computes (sequences x "
                         "tokens, requests held) until every request has its first token; no timing, any machine")
    ap.add_argument("--phases", action="store_true",
                    help="after each shared-prompt mode's repeats, one more run with one token each, its host time by step phase")
    add_dense_weights_arg(ap)
    ap.add_argument("--interleave", action="store_true",
                    help="with several settings: run them in turn, one repeat each per round (a fresh engine each), "
                         "--repeats rounds, so that drift within the process falls on every setting alike; medians over "
                         "the rounds")
    ap.add_argument("--variants", nargs="*", default=[], metavar="ROW=V[,ROW=V]",
                    help="selection rows (mtlqwen/kernels/selection.py) to run besides the defaults, each variant a fresh "
                         "engine in this process; with --interleave, rounds alternate them")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    t = time.perf_counter()
    model, name = build_model(args)
    print(f"model: {name} (built/loaded in {time.perf_counter() - t:.1f} s) | device: {mx.default_device()}", flush=True)
    n = args.requests
    rng = np.random.default_rng(0)
    system = tokens(rng, args.system_len, model.config.vocab_size)
    prompt_len = args.system_len + args.question_len
    # room for every request, plus the entries' references to the system prompt's blocks
    blocks = (n + 2) * BlockPool.blocks_for(prompt_len + args.gen_len, args.block_tokens)
    print(f"{n} requests x ({args.system_len} shared + {args.question_len} own) tokens, generate {args.gen_len}; "
          f"interval {args.interval}, step_tokens {args.step_tokens}, block_tokens {args.block_tokens}, pool {blocks} blocks, "
          f"{args.repeats} repeats (median) after {args.discard} untimed", flush=True)

    modes = args.modes.split(",")
    unknown = set(modes) - {"off", "cold", "warm", "chat-off", "chat"}
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}")
    if args.repeats < 1 or args.discard < 0:
        ap.error("--repeats must be >= 1 and --discard >= 0")
    try:
        variants = {"defaults": {}, **{v: parse_rows(v, source="--variants") for v in args.variants}}
    except ValueError as e:
        ap.error(str(e))
    # each setting (dense weights x selection variant) runs every mode; keys tagged when there are several
    in_steps = ["off"] if args.in_step is None else args.in_step or ["on"]
    settings = [(f" dense={dense}" * (len(args.dense_weights) > 1) + f" in_step={step}" * (len(in_steps) > 1)
                 + f" {name}" * (len(variants) > 1), {"dense_weights": DENSE_WEIGHTS[dense], "in_step": step == "on"}, rows)
                for dense in args.dense_weights for step in in_steps for name, rows in variants.items()]
    if args.interleave and len(settings) < 2:
        ap.error("--interleave alternates several settings: give --dense-weights or --in-step two or more, or --variants")
    results = {}
    if args.interleave:
        rounds: dict[str, list[dict]] = {}
        one = argparse.Namespace(**{**vars(args), "repeats": 1})
        for r in range(args.repeats):
            for tag, kw, rows in settings:
                print(f"-- round {r + 1} of {args.repeats}:{tag}", flush=True)
                with selected(rows):
                    res = run_modes(model, one, modes, system, blocks, kw)
                for mode, res in res.items():
                    rounds.setdefault(f"{mode}{tag}", []).append(res)
        results = {key: median_of_rounds(rs) for key, rs in rounds.items()}
        print("medians over the rounds:")
        for key, res in results.items():
            if "ttft_mean_ms" in res:
                print(f"  {key:>28}: TTFT mean {res['ttft_mean_ms']:.1f} ms (rounds: {res['ttft_mean_ms_runs']})")
        for tag, _, _ in settings:
            for mode in ("warm", "cold"):
                off, on = results.get(f"off{tag}"), results.get(f"{mode}{tag}")
                if off and on:
                    ratios = [w / o for w, o in zip(on["ttft_mean_ms_runs"], off["ttft_mean_ms_runs"])]
                    print(f"  {mode} / off{tag}: {on['ttft_mean_ms'] / off['ttft_mean_ms']:.2%} "
                          f"(each round: {', '.join(f'{x:.2%}' for x in ratios)})")
    else:
        for tag, kw, rows in settings:
            if tag:
                print(f"--{tag}", flush=True)
            with selected(rows):
                res = run_modes(model, args, modes, system, blocks, kw)
            results.update({f"{mode}{tag}": r for mode, r in res.items()})
    write_json(args.json, name, args, results)
    return 0


def median_of_rounds(rounds: list[dict]) -> dict:
    """One setting's mode over interleaved rounds: numbers (and lists of numbers, element by element) as medians,
    the rest as the last round had them; ttft_mean_ms_runs: each round's."""
    out = dict(rounds[-1])
    for k, v in rounds[-1].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in rounds)
        elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
            out[k] = [statistics.median(r[k][i] for r in rounds) for i in range(len(v))]
    if "ttft_mean_ms" in out:
        out["ttft_mean_ms_runs"] = [round(r["ttft_mean_ms"], 2) for r in rounds]
    out["rounds"] = len(rounds)
    return out


if __name__ == "__main__":
    sys.exit(main())
