"""What a request's sampler options cost the batch: aggregate decode tok/s of S requests when one of them carries
an option (penalties, a logit bias, min_tokens, logprobs, a grammar, prompt logprobs) against none.

    python benchmarks/sampler_options_bench.py --seqs 8 32                    # 9B shape, 4-bit, random weights
    python benchmarks/sampler_options_bench.py --shape demo --bits 0 --seqs 2 --prompt-len 32 --gen 16 \\
        --tokenizer DIR                                                       # CPU smoke (numbers mean nothing)

Each option runs outside the compiled step (docs/frontends.md): penalties, the bias and min_tokens add a
[rows, vocab] scatter a step; logprobs a log-softmax and top-k beside the sampler; a grammar llguidance's mask
on the host and, while it runs, every step read back before the next (the pipelining lag given up); prompt
logprobs one extra pass over the prompt at admission. S requests of --prompt-len random tokens are submitted
together (EOS ignored, --gen tokens each); once all decode, the engine steps to the last finish and the rate is
the tokens generated over that time (every host cost included), as spec_e2e_bench.py measures. A grammar
needs a tokenizer: --tokenizer DIR (a tokenizer.json directory whose vocabulary fits the model's); the
structured row asks for exactly --gen digits, which any vocabulary can write, so it runs as long as the others.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx

import bench_common
from bench_common import add_model_args, build_model, write_json
from mtlqwen.runtime import Engine, SamplingParams
from mtlqwen.runtime.block_pool import BlockPool
from mtlqwen.runtime.structured import Structure

OPTIONS = {
    "none": {},
    "penalties": {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logit_bias": {"logit_bias": {5: 2.0, 7: -3.0}},
    "min_tokens": {"min_tokens": 8},
    "logprobs": {"logprobs": 5},
    "structured": {},  # set in main: exactly --gen digits, so the request runs as long as the others
    "prompt_logprobs": {"prompt_logprobs": 1},
}


def decode_rate(eng: Engine, prompts: list[list[int]], gen: int, option: dict) -> tuple[float, int]:
    """bench_common.decode_rate with the first request carrying `option`."""
    params = [SamplingParams(max_tokens=gen, ignore_eos=True, **(option if i == 0 else {})) for i in range(len(prompts))]
    return bench_common.decode_rate(eng, prompts, params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--seqs", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--options", nargs="+", choices=sorted(OPTIONS), default=list(OPTIONS))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (needed by the structured row)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    OPTIONS["structured"] = {"structured": Structure("regex", f"[0-9]{{{args.gen}}}")}
    model, desc = build_model(args)
    tok = None
    if args.tokenizer:
        from mtlqwen.tokenizer import load_tokenizer  # noqa: PLC0415

        tok = load_tokenizer(args.tokenizer)
    options = [o for o in args.options if o != "structured" or tok is not None]
    if len(options) < len(args.options):
        print("structured: skipped (it needs --tokenizer)", flush=True)
    print(f"device {mx.default_device()}, {desc}", flush=True)
    rows = []
    for S in args.seqs:
        V = tok.vocab_size if tok is not None else model.config.vocab_size
        prompts = mx.random.randint(0, min(V, model.config.vocab_size), (S, args.prompt_len), key=mx.random.key(S)).tolist()
        need = BlockPool.blocks_for(args.prompt_len + args.gen + 32, 128)
        eng = Engine(model, tokenizer=tok, slots=S, block_tokens=128, num_blocks=S * need + 1, prefix_interval=0)
        base = None
        for name in ["none"] + [o for o in options if o != "none"]:
            for _ in range(2):  # the first pass meets every trace of the workload; the second is timed
                rate, n = decode_rate(eng, prompts, args.gen, OPTIONS[name])
            base = rate if name == "none" else base
            rows.append({"seqs": S, "option": name, "tok_s": rate, "vs_none": rate / base, "tokens": n})
            print(json.dumps(rows[-1]), flush=True)
            write_json(args.json, "sampler_options", args, rows)
    print("\n| seqs | option on one request | tok/s | against none |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['seqs']} | {r['option']} | {r['tok_s']:.1f} | {r['vs_none']:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
