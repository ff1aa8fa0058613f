"""End-to-end speed: mtlqwen against mlx-lm on the same MLX, same shape, same quantization.

Random weights at a real shape (default: Qwen3.5-9B, MLX affine 4-bit g64). Measures, for each engine:
batch-1 decode tok/s (512-token prompt, 256 new tokens), prefill tok/s of a 4096-token prompt, and
aggregate decode tok/s of 8 concurrent requests (512 in / 256 out). Warm-up runs first; every number
is the median of --repeats runs; timings synchronise with the device (token ids are read back).
Long contexts: `--prefill 32768 65536` times each prompt length, `--decode-contexts 65536` adds batch-1
decode after a prompt of that length (`decode_b1_ctx65536`), `--skip-batch` leaves out the 8 requests.

    python benchmarks/e2e_bench.py                      # 9B shape, both engines
    python benchmarks/e2e_bench.py --shape 35b-a3b --prefill-steps 1024   # MoE geometry (256 experts, top-8)
    python benchmarks/e2e_bench.py --shape demo --skip-mlxlm --repeats 1   # CPU smoke run
    python benchmarks/e2e_bench.py --skip-mlxlm --prefill 32768 65536 --prefill-steps 1024 4096 \
        --decode-contexts 65536 --skip-batch --repeats 1                       # long prompts

mlx-lm builds its own random weights of the same geometry (its qwen3_5 / qwen3_5_moe model, every linear
4-bit g64 by nn.quantize but the MoE routers at 8 bits as its converter does), not the engine's tensors: speed, not output, is compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import mlx.core as mx

from mtlqwen import Engine, SamplingParams
from mtlqwen.model.builtin import SHAPES
from mtlqwen.runtime.config import EngineConfig

from bench_common import DENSE_WEIGHTS, add_dense_weights_arg, build_model


class Live(dict):
    """Results that are also printed the moment they exist (a run cut by a time limit keeps them)."""

    def __init__(self, engine: str):
        super().__init__()
        self.engine = engine

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        print(f"[{self.engine}] {key} = {value:.4g}", flush=True)


def median_of(fn, repeats: int):
    vals = [fn() for _ in range(repeats)]
    return statistics.median(vals), vals


def rand_prompt(n: int, vocab: int, seed: int) -> list[int]:
    key = mx.random.key(seed)
    return mx.random.randint(0, vocab - 1000, (n,), key=key).tolist()


# ---------------------------------------------------------------- mtlqwen
def ours(config, args) -> dict:
    model, _ = build_model(SimpleNamespace(model=None, shape=args.shape, bits=4, group_size=64))
    vocab = config.vocab_size
    res = Live("mtlqwen")
    res["weights_gib"] = mx.get_active_memory() / 2**30  # the device memory a shape needs before any KV
    greedy = SamplingParams(max_tokens=args.gen, ignore_eos=True)

    # the engine's default prefix cache cuts every prefill chunk at its snapshot boundaries (--prefix-interval)
    cache = {} if args.prefix_interval is None else {"prefix_interval": args.prefix_interval}
    if args.prefix_in_step:  # chunks cross the boundaries, the snapshots taken inside the step
        cache["prefix_in_step"] = True
    cache["dense_weights"] = DENSE_WEIGHTS[args.dense_weights[0]]  # the others: prefill only, below

    def decode_rate(n_req: int, prompt_len: int, step_tokens: int):
        eng = Engine(model, slots=max(n_req, 1), step_tokens=step_tokens,
                     num_blocks=n_req * ((prompt_len + args.gen) // 128 + 2), **cache)
        prompts = [rand_prompt(prompt_len, vocab, 100 + i) for i in range(n_req)]
        t0 = time.perf_counter()
        outs = eng.generate(prompts, greedy)
        total = time.perf_counter() - t0
        last_first = max(o.ttft for o in outs)
        gen = sum(len(o.token_ids) - 1 for o in outs)
        return gen / (total - last_first), statistics.median(o.ttft for o in outs)

    def prefill_rate(n: int, step_tokens: int):
        eng = Engine(model, slots=1, step_tokens=step_tokens, num_blocks=n // 128 + 4, **cache)
        p = rand_prompt(n, vocab, 7)
        t0 = time.perf_counter()
        eng.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
        return n / (time.perf_counter() - t0)

    decode_rate(1, 64, 128)  # warm-up: compiles kernels, fills caches
    res["decode_b1"], _ = median_of(lambda: decode_rate(1, args.prompt, 128)[0], args.repeats)
    for ctx in args.decode_contexts:  # batch-1 decode after a long prompt (its prefill is not timed)
        res[f"decode_b1_ctx{ctx}"], _ = median_of(lambda ctx=ctx: decode_rate(1, ctx, 128)[0], args.repeats)
    for dense in args.dense_weights:
        cache["dense_weights"] = DENSE_WEIGHTS[dense]
        tag = f"_dense-{dense}" if len(args.dense_weights) > 1 else ""
        for n in args.prefill:
            for st in args.prefill_steps:
                prefill_rate(min(n, 4096), st)  # warm-up at this budget
                res[f"prefill_{n}_step{st}{tag}"], _ = median_of(lambda n=n, st=st: prefill_rate(n, st), args.repeats)
    cache["dense_weights"] = DENSE_WEIGHTS[args.dense_weights[0]]
    for b in ([] if args.skip_batch else args.batch):
        # warm-up at the measured prompt length: its prefill steps meet row classes (and the MoE grouped
        # GEMM's tile classes) that 64-token prompts do not, and a first compile inside the run is seconds
        decode_rate(b, args.prompt, 128)
        rb = [decode_rate(b, args.prompt, 128) for _ in range(args.repeats)]
        res[f"decode_b{b}"] = statistics.median(r[0] for r in rb)
        res[f"ttft_b{b}_s"] = statistics.median(r[1] for r in rb)
    res["peak_gib"] = mx.get_peak_memory() / 2**30
    del model
    mx.clear_cache()
    return res


# ---------------------------------------------------------------- mlx-lm
def mlxlm(config, args) -> dict:
    import mlx.nn as nn  # noqa: PLC0415
    from mlx_lm.generate import BatchGenerator, generate_step  # noqa: PLC0415
    from mlx_lm.models import qwen3_5, qwen3_5_moe  # noqa: PLC0415

    text = config.to_text_dict()  # MoE: carries num_experts & co., which mlx-lm's text model reads
    moe = config.is_moe
    text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    arch = qwen3_5_moe if moe else qwen3_5
    margs = arch.ModelArgs.from_dict({"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text})
    model = arch.Model(margs)
    model.set_dtype(mx.bfloat16)
    # MoE: the routers at 8 bits, as mlx-lm's converter quantizes them (its quant_predicate)
    pred = model.language_model.quant_predicate
    nn.quantize(model, group_size=64, bits=4, class_predicate=(lambda p, m: hasattr(m, "to_quantized") and pred(p, m))
                if pred else None)
    mx.eval(model.parameters())
    vocab = config.vocab_size
    res = Live("mlx-lm")

    def b1(prompt_len, gen):
        prompt = mx.array(rand_prompt(prompt_len, vocab, 5))
        t0 = time.perf_counter()
        first = None
        n = 0
        for tok, _ in generate_step(prompt, model, max_tokens=gen):
            int(tok)
            n += 1
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return (n - 1) / (end - first), prompt_len / (first - t0)

    b1(64, 8)
    res["decode_b1"], _ = median_of(lambda: b1(args.prompt, args.gen)[0], args.repeats)
    for n in args.prefill:
        res[f"prefill_{n}"], _ = median_of(lambda n=n: b1(n, 1)[1], 1)
    for ctx in args.decode_contexts:
        res[f"decode_b1_ctx{ctx}"], _ = median_of(lambda ctx=ctx: b1(ctx, args.gen)[0], args.repeats)
    if args.skip_batch:
        return res

    def batched(n_req):
        gen = BatchGenerator(model, max_tokens=args.gen, completion_batch_size=n_req, prefill_batch_size=n_req)
        gen.insert([rand_prompt(args.prompt, vocab, 200 + i) for i in range(n_req)])
        first, count, done = None, 0, 0
        t0 = time.perf_counter()
        while done < n_req:
            for r in gen.next_generated():
                count += 1
                if getattr(r, "finish_reason", None) is not None:
                    done += 1
            if first is None and count >= n_req:
                first, count = time.perf_counter(), 0
        end = time.perf_counter()
        gen.close()
        return count / (end - first), first - t0

    for b in args.batch:
        batched(b)
        rb = [batched(b) for _ in range(args.repeats)]
        res[f"decode_b{b}"] = statistics.median(r[0] for r in rb)
        res[f"ttft_b{b}_s"] = statistics.median(r[1] for r in rb)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096], help="prompt lengths to time the prefill of (none: no prefill)")
    ap.add_argument("--decode-contexts", type=int, nargs="*", default=[],
                    help="also time batch-1 decode after a prompt of each of these lengths")
    ap.add_argument("--skip-batch", action="store_true", help="leave out the --batch concurrent requests")
    ap.add_argument("--prefill-steps", type=int, nargs="+", default=[128, 1024, 4096],
                    help="step_tokens budgets to time the prefill with")
    ap.add_argument("--batch", type=int, nargs="+", default=[8], help="concurrent requests (several sizes allowed)")
    ap.add_argument("--repeats", type=int, default=3)
    interval = EngineConfig.__dataclass_fields__["prefix_interval"].default
    ap.add_argument("--prefix-interval", type=int, default=None,
                    help=f"the engine's prefix_interval (default: the engine's, {interval}, whose snapshot boundaries "
                         f"cut every prefill chunk at {interval} tokens; 0: no cache, chunks of the whole step budget)")
    ap.add_argument("--prefix-in-step", action="store_true",
                    help="Engine(prefix_in_step=True): prefill chunks cross the snapshot boundaries and the GDN "
                         "states there are taken inside the step (model/gdn_taps.py)")
    add_dense_weights_arg(ap)
    ap.add_argument("--skip-mlxlm", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--json", default=None, help="write results here too")
    args = ap.parse_args(argv)
    config = SHAPES[args.shape]()
    out = {"mlx": mx.__version__, "device": str(mx.default_device()), "shape": args.shape}
    if not args.skip_ours:
        out["mtlqwen"] = ours(config, args)
    if not args.skip_mlxlm:
        import mlx_lm  # noqa: PLC0415

        out["mlx_lm_version"] = mlx_lm.__version__
        out["mlx-lm"] = mlxlm(config, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    a, b = out.get("mtlqwen", {}), out.get("mlx-lm", {})
    print(f"\n{'metric':32s} {'mtlqwen':>12s} {'mlx-lm':>12s} {'ratio':>8s}")
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        ratio = f"{va / vb:8.2f}" if va and vb else ""
        print(f"{k:32s} {va if va is None else round(va, 2)!s:>12s} {vb if vb is None else round(vb, 2)!s:>12s} {ratio}")


if __name__ == "__main__":
    main()
