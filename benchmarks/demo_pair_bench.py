"""The trained demo pair (mtlqwen/demo/pair) on held-out text: acceptance, speed-up, chat prefix hits.

    python benchmarks/demo_pair_bench.py                     # all three parts (GPU: a minute or two)
    python benchmarks/demo_pair_bench.py --prompts 4 --gen 32 --parts tau   # CPU-sized

Parts:
  tau      acceptance length τ (tokens per speculative step, bonus included) of the drafter at n_draft
           15 on the first --prompt-len tokens of held-out stdlib files (never trained on), greedy and
           at temperature 0.7 (seeded: Gumbel-coupled verification keeps the target's distribution).
  speedup  greedy tokens/s of the engine without the drafter, with it at a fixed n_draft, and with the
           adaptive draft policy (by the built-in table, and learning its step costs from there),
           1 and 8 sequences at once, the same prompts (EOS ignored, so every run
           generates the same number of tokens); output equality too.
  chat     a multi-turn chat built from held-out functions' docstrings through the pair's ChatML
           template: each turn's prompt is the previous turns plus a new user message; per turn, the
           tokens restored from the prefix cache and the TTFT, cache on against off.
The pair runs as shipped (8-bit) unless --bf16; the 18.5M target is tiny, so GPU numbers are bound by
per-step launch overhead rather than by the weights.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import time

from mtlqwen import Engine, SamplingParams
from mtlqwen.kernels import use_kernels
from mtlqwen.demo import load_demo_pair

from training.corpus import read_corpus


def heldout_files(min_chars: int = 2000) -> list[dict]:
    return [r for r in read_corpus() if r["kind"] == "file" and r["split"] == "heldout" and len(r["text"]) >= min_chars]


def heldout_prompts(tok, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of n held-out files (in corpus order)."""
    out = []
    for r in heldout_files():
        ids = tok.encode(r["text"])
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def part_tau(pair, args) -> dict:
    prompts = heldout_prompts(pair.tokenizer, args.prompts, args.prompt_len)
    res = {}
    for name, sp in (("greedy", SamplingParams(temperature=0.0, max_tokens=args.gen)),
                     ("temp0.7", SamplingParams(temperature=0.7, max_tokens=args.gen, seed=7))):
        engine = Engine(pair.model, tokenizer=pair.tokenizer, slots=min(8, len(prompts)), draft=pair.drafter,
                        n_draft=15, prefix_interval=0, draft_policy="fixed")
        engine.generate(prompts, sp)
        st = engine.spec.stats()
        res[name] = {"tau": round(st["mean_acceptance_length"], 3), "verifications": st["spec_verifications"],
                     "accepted": st["accepted_tokens"], "drafted": st["draft_tokens"]}
        print(f"tau {name:>8}: {st['mean_acceptance_length']:.2f} tokens per verification "
              f"({st['accepted_tokens']} of {st['draft_tokens']} drafts accepted, {st['spec_verifications']} "
              "verifications)", flush=True)
    return res


def _timed(engine, prompts, gen) -> tuple[float, list]:
    """The workload once untimed, then timed: the first run compiles a kernel instantiation for every
    shape it meets (with a drafter: each draft length, as drafts shrink near max_tokens), seconds on CUDA."""
    sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    engine.generate(prompts, sp)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    return time.perf_counter() - t0, outs


def part_speedup(pair, args) -> dict:
    res = {}
    for S in (1, 8):
        prompts = heldout_prompts(pair.tokenizer, S, args.prompt_len)
        row = {}
        variants = (("plain", {}), ("drafter", {"draft": pair.drafter, "n_draft": args.n_draft, "draft_policy": "fixed"}),
                    ("adaptive", {"draft": pair.drafter, "n_draft": args.n_draft, "draft_policy": "adaptive"}),
                    # the built-in table (the 9B pair's on the H200) corrected by this engine's own step times
                    ("adaptive_learned", {"draft": pair.drafter, "n_draft": args.n_draft, "draft_policy": "adaptive",
                                          "learn_draft_costs": True}))
        for name, kw in variants:
            runs = []
            for _ in range(args.repeats):
                engine = Engine(pair.model, tokenizer=pair.tokenizer, slots=S, prefix_interval=0, **kw)
                wall, outs = _timed(engine, prompts, args.gen)
                runs.append((wall, outs, engine.spec.stats() if engine.spec is not None else None))
            wall = statistics.median(r[0] for r in runs)
            row[name] = {"tok_s": round(S * args.gen / wall, 1), "wall_s": round(wall, 3)}
            if runs[0][2] is not None:
                row[name]["tau"] = round(runs[0][2]["mean_acceptance_length"], 3)
                row[name]["verifications"] = runs[0][2]["spec_verifications"]
                if "step_cost_ratios" in runs[0][2]:
                    row[name]["step_cost_ratios"] = runs[0][2]["step_cost_ratios"]
            print(f"  S={S} {name}: {row[name]}", flush=True)  # at once: a run cut by a time limit keeps it
            row[f"{name}_tokens"] = [o.token_ids for o in runs[0][1]]
        plain = row.pop("plain_tokens")
        same = {v: sum(a == b for a, b in zip(plain, row.pop(f"{v}_tokens"))) for v in ("drafter", "adaptive", "adaptive_learned")}
        row["speedup"] = round(row["drafter"]["tok_s"] / row["plain"]["tok_s"], 3)
        row["speedup_adaptive"] = round(row["adaptive"]["tok_s"] / row["plain"]["tok_s"], 3)
        row["speedup_adaptive_learned"] = round(row["adaptive_learned"]["tok_s"] / row["plain"]["tok_s"], 3)
        row["same_greedy_output"] = {v: f"{k} of {S}" for v, k in same.items()}
        res[f"S{S}"] = row
        print(f"speed-up S={S}: plain {row['plain']['tok_s']} tok/s, drafter (n_draft {args.n_draft}) "
              f"{row['drafter']['tok_s']} tok/s (tau {row['drafter'].get('tau')}) -> {row['speedup']}x, adaptive "
              f"{row['adaptive']['tok_s']} tok/s -> {row['speedup_adaptive']}x (learning its step costs: "
              f"{row['speedup_adaptive_learned']}x); same output {row['same_greedy_output']}",
              flush=True)
    return res


def chat_messages(n: int) -> list[str]:
    """User messages asking for held-out functions from their docstrings (the training chat format)."""
    out = []
    for r in heldout_files():
        try:
            tree = ast.parse(r["text"])
        except SyntaxError:
            continue
        module = r["path"][:-3].replace("/", ".")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                first = ast.get_docstring(node).strip().split("\n\n")[0].strip()
                if len(first) >= 20:
                    out.append(f"Write the Python function `{node.name}` from the `{module}` module. {first}")
            if len(out) == n:
                return out
    return out


def run_chat(pair, messages, interval: int, gen: int, warm: bool = True) -> dict:
    """The conversation's TTFT per turn on a fresh engine; `warm`: the same conversation first on a throwaway
    engine of the same settings, so the timed turns meet no first-use kernel compile (the snapshot capture,
    the restore and the prefill over a cached prefix each compile theirs once per process on a GPU)."""
    tok = pair.tokenizer
    if warm:
        run_chat(pair, messages, interval, gen, warm=False)
    engine = Engine(pair.model, tokenizer=tok, slots=1, prefix_interval=interval)
    engine.generate([tok.encode("def f():")], SamplingParams(max_tokens=2))  # warm up
    history, cached, prompt_len, ttft = [], [], [], []
    for m in messages:
        history.append({"role": "user", "content": m})
        ids = list(tok.apply_chat_template(history, add_generation_prompt=True))
        out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=gen))[0]
        if out.ttft is None:  # no token: the request failed
            raise RuntimeError(f"turn {len(cached) + 1} ({len(ids)} prompt tokens): {out.finish_reason}: {out.error}")
        history.append({"role": "assistant", "content": out.text})
        cached.append(out.cached_tokens)
        prompt_len.append(len(ids))
        ttft.append(round(1e3 * out.ttft, 2))
    st = engine.stats()
    return {"prompt_tokens": prompt_len, "cached_tokens": cached, "ttft_ms": ttft,
            "turn_hits": st["prefix_turn_hits"], "hits": st["prefix_hits"]}


def part_chat(pair, args) -> dict:
    messages = chat_messages(args.turns)
    warm = use_kernels()  # a GPU compiles kernels at first use; the CPU references have nothing to warm
    on, off = run_chat(pair, messages, 128, args.gen, warm), run_chat(pair, messages, 0, args.gen, warm)
    recomputed = [p - c for p, c in zip(on["prompt_tokens"], on["cached_tokens"])]
    print(f"chat {len(messages)} turns: prompt tokens {on['prompt_tokens']}", flush=True)
    print(f"  restored from the cache {on['cached_tokens']} (turn-entry hits {on['turn_hits']}); "
          f"computed {recomputed}", flush=True)
    print(f"  TTFT ms cache on {on['ttft_ms']}", flush=True)
    print(f"  TTFT ms cache off {off['ttft_ms']}", flush=True)
    return {"on": on, "off": off}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="tau,speedup,chat")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for tau")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--n-draft", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--bf16", action="store_true", help="run the pair dequantized to bf16")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    pair = load_demo_pair(dequantize=args.bf16)
    parts = {"tau": part_tau, "speedup": part_speedup, "chat": part_chat}
    out = {"args": vars(args), "weights": "bf16" if args.bf16 else f"{pair.record.get('bits', 8)}-bit"}
    for name in args.parts.split(","):
        out[name] = parts[name](pair, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
