"""Speculative-decoding step cost: one speculative step (draft + verify of n_draft + 1 tokens + commit)
against one plain decode step, and the speed-up that implies for a given acceptance length.

    python benchmarks/spec_bench.py                       # Qwen3.5-9B shape, 4-bit g64 target, 9B drafter shape (bf16)
    python benchmarks/spec_bench.py --shape demo --prompt-len 32 --steps 3 --warmup 1   # CPU smoke run

Weights are random (no download): the target is `random_model(qwen35_9b_config(), quantize=QuantSpec(4, 64))`;
the drafter has the published z-lab/Qwen3.5-9B-DFlash shape (5 layers, hidden 4096, 32 heads, 8 KV heads,
head_dim 128, intermediate 12288, taps [1, 8, 15, 22, 29], mask 248070), built in memory. A random drafter
accepts ~nothing, which hardly matters here: a step's cost barely depends on how many drafts it accepts
(the commit's gathers and drafter-context rows), so acceptance enters only through the formula

    speed-up(tau) = tau * T_plain / T_spec          (tau = tokens per speculative step, bonus included)

The exception is the commit mode (--commit, Engine(verify_commit=...)): "candidates" keeps the GDN state
after every verified token, "replay" reruns anchor + accepted drafts at commit, so its cost grows with the
acceptance. --accept K makes every verification accept min(K, n_draft) drafts whatever the target says
(the outputs are then the drafts: timing does not care), so both modes commit realistic lengths.

n_draft 0 measures the engine with the drafter loaded and nobody drafting (taps and drafter context still
written): the plain column of the adaptive policy's step-cost table (`--json` output loads with
`mtlqwen.runtime.draft_policy.StepCosts.load`, `Engine(draft_costs=...)`). Speculative engines run the
fixed draft policy, so every step drafts n_draft.

--acceptance measures acceptance instead of cost: the same greedy workload generated with the drafter
in bf16 and quantized (--acceptance-bits, default 0 8 4: `quantize_drafter`), per n_draft and batch
size: tokens per verification (tau), accepted / drafted, tok/s, and whether each output equals the
plain engine's. With --pair (the trained demo pair, `mtlqwen.demo.load_demo_pair`; a path, or the
packaged one) prompts are windows of its held-out text; otherwise the random --shape pair and random
prompts (a random drafter accepts ~nothing: a smoke run).

    python benchmarks/spec_bench.py --acceptance --pair --seqs 1 8 --n-draft 3 7 15 --prompt-len 256 --gen 128

Measured per (sequences S, n_draft, commit mode):
  engine   wall time per Engine.step() in steady state, every sequence decoding (S requests, EOS
           ignored): plain engine (pipelined) vs speculative engine (synchronous: drafting needs the
           previous step's tokens). This is the number the speed-up uses.
  parts    the same batch through the model alone: plain decode forward, drafter pass (uncompiled, and
           compiled as the engine runs it with compile_decode: model/compiled_draft.py), verification
           forward (taps + candidate states or replay inputs) + commit of n_draft // 2 accepted drafts
           (--accept K: min(K, n_draft)), each timed with a sync.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from types import SimpleNamespace

import mlx.core as mx

from mtlqwen.kernels import SeqLayout
from mtlqwen.model import QuantSpec
from mtlqwen.model.compiled_draft import CompiledDraft
from mtlqwen.model.dflash import Drafter, drafter_shapes
from mtlqwen.model.dflash_config import parse_dflash_config
from mtlqwen.model.qwen35 import VERIFY_COMMITS
from mtlqwen.runtime import Engine, SamplingParams, speculative
from mtlqwen.runtime.block_pool import BlockPool

from bench_common import build_model

TAUS = (3, 5, 7)


def drafter_raw(shape: str, target_config) -> dict:
    """The config.json body of the drafter: the published 9B drafter, or a small one for --shape demo."""
    if shape == "9b":
        dims = dict(hidden_size=4096, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    intermediate_size=12288, taps=[1, 8, 15, 22, 29], mask=248070, theta=1e7)
    else:
        dims = dict(hidden_size=target_config.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, intermediate_size=384, taps=[1, 4, 6],
                    mask=target_config.vocab_size - 1, theta=1e6)
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
        **{k: dims[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "intermediate_size")},
        "vocab_size": target_config.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": dims["theta"],
        "max_position_embeddings": 262144, "block_size": 16, "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {"mask_token_id": dims["mask"], "target_layer_ids": dims["taps"], "block_size": 16},
    }


def random_drafter(shape: str, target, bits: int = 0, dtype=mx.bfloat16) -> Drafter:
    """Random weights of the published layout: linears N(0, 1/fan_in) in `dtype` (quantized when bits),
    norms 1 + N(0, 0.1^2) fp32."""
    config = parse_dflash_config(drafter_raw(shape, target.config))
    weights = {}
    for i, (name, shp) in enumerate(sorted(drafter_shapes(config).items())):
        k = mx.random.key(7_000_003 + i)
        if len(shp) == 1:
            weights[name] = 1.0 + 0.1 * mx.random.normal(shp, key=k)
        else:
            weights[name] = (mx.random.normal(shp, key=k) / shp[-1] ** 0.5).astype(dtype)
        mx.eval(weights[name])
    if bits:
        from mtlqwen.model.quantize import quantize_weights  # noqa: PLC0415

        weights = quantize_weights(weights, config, QuantSpec(bits, 64))
    return Drafter(config, weights, target)


def build_target(shape: str, bits: int):
    model, _ = build_model(SimpleNamespace(model=None, shape=shape, bits=bits, group_size=64))
    return model


def _timed(fn, repeats: int) -> float:
    """Median wall ms of fn() (which must leave nothing lazy behind)."""
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


@contextlib.contextmanager
def forced_acceptance(accept: int | None):
    """While inside, every verification accepts min(accept, its drafts) drafts (None: what the target
    says). The step keeps the verifier's next token: a consistent run whose tokens are the drafts."""
    real = speculative.verify
    if accept is not None:
        def verify(*args):  # the verifier's signature, whatever it is
            _, tok = real(*args)
            n = args[2]
            return mx.minimum(mx.array(n, dtype=mx.int32), accept), tok

        speculative.verify = verify
    try:
        yield
    finally:
        speculative.verify = real


def warm_engine(model, drafter, S: int, n: int, args, commit: str | None = None, compiled: bool | None = None,
                pipeline: bool = False) -> Engine:
    """An Engine with S requests decoding in steady state, args.warmup steps past their prefill (no drafter:
    the plain engine; n = 0 with a drafter: loaded, nobody drafting); pipeline: Engine(spec_pipeline=True).
    Each request has room for args.steps more steps at n_draft n; cancel them when done (cancel_all)."""
    gen = (args.warmup + args.steps) * (n + 1) + 8  # long enough that no step's drafts are capped
    bt = 128
    spec = dict(draft=drafter, n_draft=n or None, verify_commit=commit if n else None, draft_policy="fixed",
                spec_pipeline=pipeline) if drafter is not None else {}
    eng = Engine(model, slots=S, step_tokens=max(128, S * (n + 1)), block_tokens=bt,
                 num_blocks=S * BlockPool.blocks_for(args.prompt_len + gen, bt) + 1,
                 prefix_interval=0, compile_decode=compiled, **spec)
    prompts = mx.random.randint(0, model.config.vocab_size, (S, args.prompt_len), key=mx.random.key(S)).tolist()
    for p in prompts:
        eng.submit(p, SamplingParams(max_tokens=gen, ignore_eos=True, speculative=n > 0))
    while len(eng.scheduler.running) < S or any(len(s.tokens) <= s.prompt_len for s in eng.scheduler.running):
        eng.step()
        if not eng.has_work():
            raise RuntimeError("requests finished before the measurement")
    for _ in range(args.warmup):
        eng.step()
    mx.synchronize()
    return eng


def cancel_all(eng: Engine) -> None:
    for rid in list(eng._seqs):
        eng.cancel(rid)


def engine_step_ms(model, drafter, S: int, n: int, args, commit: str | None = None, compiled: bool | None = None,
                   pipeline: bool = False) -> float:
    """Steady-state ms per Engine.step() of warm_engine's engine."""
    eng = warm_engine(model, drafter, S, n, args, commit, compiled, pipeline)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    mx.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    cancel_all(eng)
    return ms


def part_ms(model, drafter, S: int, n: int, args, mode: str) -> dict:
    """Model-only times for one batch of S sequences at args.prompt_len context."""
    bt, L = 128, args.prompt_len
    nb = BlockPool.blocks_for(L + n + 1, bt)
    cache = model.make_cache(S * nb, S, bt)
    dcache = drafter.make_cache(cache)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(S)]
    ids = mx.random.randint(0, model.config.vocab_size, (S * L,), key=mx.random.key(1)).astype(mx.int32)
    pre = SeqLayout([i * L for i in range(S + 1)], [0] * S, tables, list(range(S)), bt)
    _, taps = model.forward_with_taps(ids, pre, cache, drafter.tap_layers, mx.array([], dtype=mx.int32))
    drafter.write_context(taps, pre, dcache)
    mx.eval(cache.arrays(), dcache.arrays())
    dec = SeqLayout(list(range(S + 1)), [L] * S, tables, list(range(S)), bt)
    one = mx.zeros((S,), dtype=mx.int32)

    def decode():  # the state written back is the same each time: positions and slots do not move
        mx.eval(mx.argmax(model.forward(one, dec, cache), axis=-1), *cache.arrays())

    def draft():
        mx.eval(drafter.propose([0] * S, dec, dcache, n))

    compiled_draft = CompiledDraft(drafter)

    def draft_compiled():  # the engine's drafter pass when it compiles (one trace, replayed)
        mx.eval(compiled_draft.propose([0] * S, dec, dcache, n))

    B = n + 1
    ver = SeqLayout([i * B for i in range(S + 1)], [L] * S, tables, list(range(S)), bt, verify=[True] * S)
    vids = mx.zeros((S * B,), dtype=mx.int32)

    acc = n // 2 if args.accept is None else min(args.accept, n)

    def verify():  # commits acc drafts: a replay's cost is in its commit (the state moves; timing does not care)
        logits, t, stash = model.forward_verifying(vids, ver, cache, drafter.tap_layers, verify_commit=mode)
        model.commit_candidates(cache, stash, [acc] * S)
        mx.eval(mx.argmax(logits, axis=-1), t, *cache.arrays())

    return {name: _timed(fn, args.steps) for name, fn in (("decode", decode), ("draft", draft),
                                                          ("draft_compiled", draft_compiled), ("verify", verify))}


def write_json(args, rows: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": str(mx.default_device()), "rows": rows}, f, indent=1)


def acceptance_rows(args) -> list[dict]:
    """--acceptance: the greedy workload once per (drafter bits, n_draft, sequences); see the docstring."""
    from mtlqwen.model.dflash import quantize_drafter  # noqa: PLC0415

    if args.pair is not None:
        from mtlqwen.demo import load_demo_pair  # noqa: PLC0415

        pair = load_demo_pair(args.pair or None)
        model, drafter = pair.model, pair.drafter
        ids = pair.tokenizer.encode(pair.heldout_text)
        stride = max(1, (len(ids) - args.prompt_len) // max(1, args.prompts))
        prompts = [ids[i * stride : i * stride + args.prompt_len] for i in range(args.prompts)]
        source = f"demo pair ({pair.path})"
    else:
        model = build_target(args.shape, args.bits)
        drafter = random_drafter(args.shape, model)
        prompts = mx.random.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len),
                                    key=mx.random.key(11)).tolist()
        source = f"random {args.shape} pair"
    print(f"device {mx.default_device()}, {source}, {len(prompts)} prompts of {args.prompt_len} tokens, "
          f"{args.gen} generated each (greedy, EOS ignored)", flush=True)
    drafters = {b: drafter if b == 0 else quantize_drafter(drafter, b) for b in args.acceptance_bits}
    sp = SamplingParams(max_tokens=args.gen, ignore_eos=True)
    rows = []
    for S in args.seqs:
        bt, need = 128, BlockPool.blocks_for(args.prompt_len + args.gen + 16, 128)
        kw = dict(slots=S, block_tokens=bt, num_blocks=S * need + 1, prefix_interval=0)
        plain = Engine(model, step_tokens=max(128, S), **kw)
        t0 = time.perf_counter()
        base = [o.token_ids for o in plain.generate(prompts, sp)]
        plain_tok_s = len(prompts) * args.gen / (time.perf_counter() - t0)
        for bits, d in drafters.items():
            for n in args.n_draft:
                if n == 0 or n > d.block_size - 1:
                    if n:
                        print(f"n_draft {n} skipped: the drafter's block is {d.block_size}", flush=True)
                    continue
                eng = Engine(model, step_tokens=max(128, S * (n + 1)), draft=d, n_draft=n, draft_policy="fixed", **kw)
                t0 = time.perf_counter()
                outs = eng.generate(prompts, sp)
                wall = time.perf_counter() - t0
                st = eng.stats()
                row = {"seqs": S, "draft_bits": bits, "n_draft": n, "tau": st["mean_acceptance_length"],
                       "accepted_per_drafted": st["accepted_tokens"] / max(1, st["draft_tokens"]),
                       "spec_verifications": st["spec_verifications"], "tok_s": len(prompts) * args.gen / wall,
                       "plain_tok_s": plain_tok_s,
                       "same_as_plain": sum(o.token_ids == b for o, b in zip(outs, base)) / len(prompts)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                write_json(args, rows)
    print("\n| seqs | drafter | n_draft | tau | accepted / drafted | tok/s | plain tok/s | outputs = plain |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = f"{r['draft_bits']}-bit" if r["draft_bits"] else "bf16"
        print(f"| {r['seqs']} | {b} | {r['n_draft']} | {r['tau']:.2f} | {r['accepted_per_drafted']:.3f} | "
              f"{r['tok_s']:.1f} | {r['plain_tok_s']:.1f} | {r['same_as_plain']:.2f} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["9b", "demo"], default="9b")
    ap.add_argument("--bits", type=int, default=4, help="target quantization bits (0 = bf16)")
    ap.add_argument("--draft-bits", type=int, default=0, help="drafter quantization bits (0 = bf16, as published)")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--n-draft", type=int, nargs="+", default=[4, 8, 15])
    ap.add_argument("--commit", nargs="+", choices=[*VERIFY_COMMITS, "auto"], default=list(VERIFY_COMMITS),
                    help="how verified GDN states are committed (Engine(verify_commit=...); auto: the engine's "
                         "choice per step, as served); each is measured")
    ap.add_argument("--compile", nargs="+", choices=["off", "on"], default=["on"],
                    help="speculative steps uncompiled (compile_decode=False) and/or through mx.compile "
                         "(compile_decode=True: target steps and the drafter pass); each is measured. Default "
                         "on: the engine's own default where the GPU kernels run")
    ap.add_argument("--pipeline", nargs="+", choices=["off", "on"], default=["off"],
                    help="Engine(spec_pipeline=...): all-verify steps launched while the previous one is in flight")
    ap.add_argument("--accept", type=int, default=None,
                    help="force min(K, n_draft) accepted drafts per verification (default: the random drafter's ~0)")
    ap.add_argument("--prompt-len", type=int, default=512, help="context of every sequence when measured")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (and repeats of each part)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-parts", action="store_true", help="skip the model-only breakdown")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--acceptance", action="store_true",
                    help="measure acceptance of bf16 vs quantized drafters on one greedy workload (not step cost)")
    ap.add_argument("--acceptance-bits", type=int, nargs="+", choices=[0, 8, 4], default=[0, 8, 4],
                    help="--acceptance: drafter variants (0 = as loaded, bf16)")
    ap.add_argument("--pair", nargs="?", const="", default=None, metavar="PATH",
                    help="--acceptance: the trained demo pair (its directory; no value: the packaged one)")
    ap.add_argument("--prompts", type=int, default=16, help="--acceptance: requests in the workload")
    ap.add_argument("--gen", type=int, default=128, help="--acceptance: tokens generated per request")
    args = ap.parse_args(argv)
    if args.acceptance:
        acceptance_rows(args)
        return 0

    model = build_target(args.shape, args.bits)
    drafter = random_drafter(args.shape, model, args.draft_bits)
    print(f"device {mx.default_device()}, target {args.shape} ({f'{args.bits}-bit' if args.bits else 'bf16'}), "
          f"drafter {drafter.config.num_hidden_layers} layers ({f'{args.draft_bits}-bit' if args.draft_bits else 'bf16'}), "
          f"context {args.prompt_len}", flush=True)
    rows = []
    for S in args.seqs:
        plain = engine_step_ms(model, None, S, 0, args)
        for n in args.n_draft:
            modes = [(m, c, pl) for c in args.compile for m in (args.commit if n else ["auto"])
                     for pl in (args.pipeline if n else ["off"])]
            for mode, comp, pl in modes:
                with forced_acceptance(args.accept):
                    spec = engine_step_ms(model, drafter, S, n, args, None if mode == "auto" else mode,
                                          comp == "on", pl == "on")
                row = {"seqs": S, "n_draft": n, "commit": mode, "compiled": comp, "pipeline": pl,
                       "plain_step_ms": plain, "spec_step_ms": spec,
                       "ratio": spec / plain, "speedup": {t: (t * plain / spec if n and t <= n + 1 else None) for t in TAUS}}
                if n and not args.no_parts and comp == args.compile[0] and pl == args.pipeline[0]:  # model-only parts: the same either way
                    row["parts_ms"] = part_ms(model, drafter, S, n, args,
                                              speculative.commit_mode_for(n, S) if mode == "auto" else mode)
                rows.append(row)
                print(json.dumps(row), flush=True)
                write_json(args, rows)  # after every row: a part cut short by its time limit keeps what it measured
    print("\n| seqs | n_draft | commit | compiled | pipeline | plain step ms | spec step ms | spec / plain | "
          + " | ".join(f"speed-up at tau={t}" for t in TAUS) + " | parts: decode / draft / draft compiled / verify ms |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(TAUS) + "---|")
    for r in rows:
        sp = " | ".join(f"{r['speedup'][t]:.2f}x" if r["speedup"][t] else "-" for t in TAUS)
        parts = " / ".join(f"{r['parts_ms'][k]:.2f}" for k in ("decode", "draft", "draft_compiled", "verify")) \
            if "parts_ms" in r else "-"
        print(f"| {r['seqs']} | {r['n_draft']} | {r['commit']} | {r['compiled']} | {r['pipeline']} | {r['plain_step_ms']:.2f} | {r['spec_step_ms']:.2f} "
              f"| {r['ratio']:.2f} | {sp} | {parts} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
