"""Batched generation with mtlqwen's Engine: many prompts, a fixed number of slots, paged KV memory.

    python examples/batched_generation.py                       # tiny random model, byte tokenizer
    python examples/batched_generation.py --model Qwen/Qwen3.5-0.8B --num-prompts 32 --max-tokens 128

Prints a progress bar over every token the run must process (prompts, then completions) updated at
each engine step, a few completions, then a throughput summary.
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx

from tqdm import tqdm

import mtlqwen
from mtlqwen.runtime import Engine, Output, SamplingParams

TOPICS = ["the sea", "prime numbers", "a lighthouse", "bread", "the moon", "rivers", "chess", "autumn"]


def build(args):
    if args.model:
        model = mtlqwen.load(args.model)
        try:
            tokenizer = mtlqwen.load_tokenizer(args.model)
        except FileNotFoundError:  # weights only: prompts become random token ids, outputs carry no text
            tokenizer = None
        return model, tokenizer
    try:
        from mtlqwen.model.builtin import ByteTokenizer, random_model
    except ImportError:
        raise SystemExit("this mtlqwen has no built-in random model; pass --model PATH_OR_REPO") from None
    return random_model(seed=args.seed), ByteTokenizer()


def run(engine: Engine, prompts, sampling: list[SamplingParams]) -> list[Output]:
    """Submit every prompt, then step the engine; the bar moves with each step's prompt and generated
    tokens, so it starts moving at the first step rather than when the first request finishes."""
    ids = {engine.submit(p, sp): i for i, (p, sp) in enumerate(zip(prompts, sampling))}
    c = engine.counters
    budget = c["prompt_tokens"] + sum(sp.max_tokens for sp in sampling)  # an upper bound: EOS ends some early
    start = c["prefill_tokens"] + c["generated_tokens"]
    outputs: list[Output | None] = [None] * len(prompts)
    with tqdm(total=budget, unit="tok", desc="tokens") as bar:
        while engine.has_work():
            for d in engine.step():
                if d.finished:
                    outputs[ids[d.request_id]] = d.output
            bar.update(c["prefill_tokens"] + c["generated_tokens"] - start - bar.n)
            bar.set_postfix_str(f"{sum(o is not None for o in outputs)}/{len(prompts)} done", refresh=False)
    return outputs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: tiny random model)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", "-m", type=int, default=32)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: sized to the device)")
    ap.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to each prompt")
    args = ap.parse_args()

    model, tokenizer = build(args)
    engine = Engine(model, slots=args.slots, step_tokens=args.step_tokens, block_tokens=args.block_tokens,
                    num_blocks=args.num_blocks, tokenizer=tokenizer, seed=args.seed)
    rng = random.Random(args.seed)
    texts = [f"Write a short note about {rng.choice(TOPICS)} (#{i})." for i in range(args.num_prompts)]
    prompts, templated = texts, False
    if tokenizer is None:
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(24)] for _ in texts]
    elif args.chat and hasattr(tokenizer, "apply_chat_template"):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p in texts]
        templated = True
    # one SamplingParams per prompt: each request draws from its own seed, whatever it is batched with
    sampling = [SamplingParams(temperature=args.temp, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed + i)
                for i in range(len(prompts))]

    mx.reset_peak_memory()
    t0 = time.perf_counter()
    outputs = run(engine, prompts, sampling)
    wall = time.perf_counter() - t0

    for text, prompt, out in list(zip(texts, prompts, outputs))[:3]:
        shown = text if tokenizer is not None else f"{len(prompt)} random token ids"
        print(f"\n--- {shown!r}{' (chat template applied)' if templated else ''}\n"
              f"{out.text!r}  [{out.finish_reason}, {len(out.token_ids)} tokens]")
    ok = [o for o in outputs if o.finish_reason != "error"]
    gen = sum(len(o.token_ids) for o in ok)
    prompt_toks = sum(o.prompt_tokens for o in ok)
    ttft = sorted(o.ttft for o in ok if o.ttft is not None)
    stats = engine.stats()
    print(f"\nRequests: {len(ok)} done, {len(outputs) - len(ok)} failed, {args.slots} slots, "
          f"{stats['preemptions']} preemptions")
    print(f"Prompt: {prompt_toks} tokens | Generation: {gen} tokens, {gen / wall:.1f} tokens-per-sec aggregate")
    if ttft:
        print(f"Time to first token: median {ttft[len(ttft) // 2] * 1e3:.0f} ms, max {ttft[-1] * 1e3:.0f} ms")
    print(f"Wall: {wall:.2f} s over {stats['steps']} steps | KV pool: {stats['total_blocks']} blocks of "
          f"{stats['block_tokens']} tokens | Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
