"""Start-up warm-up: build the GPU kernels a server's first requests would otherwise wait for.

MLX compiles each custom-kernel instantiation (NVRTC on CUDA, the Metal compiler on Apple GPUs) at its
first launch in a process, and keeps no disk cache of them: on the H200 a fresh process paid 3-9 s of
compiles inside the first chat turns (benchmarks/demo_pair.md). `warm_up` runs a small throwaway
workload first — prompts whose chunks hit the projections' row classes, a prompt that extends a cached
one (the prefix cache's capture, restore and prefill over a cached prefix: the compiles the chat turns
above met), decode batches from every slot count down to one, speculation when a drafter is given — on a
throwaway engine of the same configuration with a small KV pool. It runs before the serving engine is built,
so the two pools never coexist. What it leaves behind is process-wide: the compiled kernels and the
dispatcher's first-use checks (kernels/dispatch.py). The serving engine's `mx.compile` traces are its
own and are still built at their first step (tens of milliseconds, not seconds).
"""

from __future__ import annotations

import dataclasses
import time

from ..kernels import dispatch
from ..kernels.backend import use_kernels
from .config import EngineConfig

WARMUP_MODES = ("auto", "on", "off")
# prompts run alone, so that their prefill steps have these many rows: the GEMV's, then the tensor-core
# GEMM's row classes (up to 32 / 64 / 128; 128 rows at top-8 are also the 1,024 pairs from which an MoE
# model's grouped GEMM serves, at its smallest tile class); the prefill-only budget's step covers
# dequantize + GEMM (and the grouped GEMM's tile class of a full step)
CHUNK_ROWS = (5, 20, 40, 128)


def should_warm_up(mode: str, group=None) -> bool:
    """auto: when the GPU kernels run. Never under tensor parallelism (rank 0 alone would run collectives)."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"warm-up mode must be one of {', '.join(WARMUP_MODES)}, got {mode!r}")
    if group is not None or mode == "off":
        return False
    return mode == "on" or use_kernels()


def instantiations() -> int:
    """Kernel instantiations the dispatcher has built and checked so far in this process."""
    return sum(len(op.checked) for op in dispatch.OPS.values())


def warm_up(model, engine_kw: dict | None = None, tokenizer=None, log=None) -> dict:
    """Run the warm-up workload on a throwaway Engine(model, **engine_kw) (its KV pool cut to what the
    workload needs); returns {"requests", "seconds", "instantiations"} (new ones)."""
    from .engine import Engine  # noqa: PLC0415  (engine imports the runtime; this module is imported by frontends)
    from .sampling import SamplingParams  # noqa: PLC0415

    cfg = EngineConfig.build(None, **(engine_kw or {}))
    budget, slots, bt = cfg.prefill_budget, cfg.slots, cfg.block_tokens
    longest = budget + 8 + slots + 2  # a prompt of a full prefill step plus a remainder, extended, and its tokens
    per_seq = -(-longest // bt) + 1
    # one sequence's worth more than the slots use: the blocks the prefix entries share
    throwaway = dataclasses.replace(cfg, num_blocks=(slots + 1) * per_seq + 1, kv_bytes=None, spec_pipeline=False)
    t0, before = time.perf_counter(), instantiations()
    eng = Engine(model, throwaway, tokenizer=tokenizer)
    vocab = model.config.vocab_size
    ctx = eng.max_model_len

    def prompt(n: int, salt: int) -> list[int]:  # distinct ids, no special meaning
        return [(7 + 31 * i + 1009 * salt) % vocab for i in range(max(1, min(n, ctx - slots - 4)))]

    # prefill, one request at a time (a step's rows are all its sequences' tokens): one prompt per row
    # class, one of a whole prefill-only step and a remainder, then that prompt extended (with the prefix
    # cache on: restored from its entry, the rest prefilled over the cached prefix)
    long = prompt(budget + 3, 9)
    groups = [[(prompt(n, i), 1)] for i, n in enumerate(CHUNK_ROWS)] + [[(long, 1)], [(long + prompt(5, 10), 1)]]
    # decode: `slots` requests together, request i stopping after i + 2 tokens, so every batch size from
    # `slots` down to 1 runs (with a drafter: their verifications too)
    groups.append([(prompt(6 + i, 20 + i), i + 2) for i in range(slots)])
    n = 0
    for group in groups:
        outs = eng.generate([p for p, _ in group], [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in group])
        failed = [o.error for o in outs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"warm-up request failed: {failed[0]}")
        n += len(outs)
    out = {"requests": n, "seconds": round(time.perf_counter() - t0, 2), "instantiations": instantiations() - before}
    del eng
    if log is not None:
        log(f"warm-up: {out['requests']} requests, {out['instantiations']} kernel instantiations built "
            f"in {out['seconds']:.1f} s")
    return out
