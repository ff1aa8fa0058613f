"""One rank of the tensor-parallel tests, started by `mlx.launch --backend ring -n 2` (test_tensor_parallel.py).

usage: tp_worker.py CHECKPOINT OUT_PREFIX [--draft DIR] [--single] [--rank1-checkpoint DIR] [--quantize SPEC] [--compile]
Runs `workload` on a model sharded over the launched group (or, with --single, on the whole model in one
process, the reference) and writes OUT_PREFIX.rank<R>.json: every request's tokens and cached_tokens,
this rank's weight and cache-pool bytes.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx

import mtlqwen
from mtlqwen import Engine, SamplingParams


def _ids(n: int, seed: int) -> list[int]:
    import numpy as np  # noqa: PLC0415

    return [int(t) for t in np.random.default_rng(seed).integers(0, 500, size=n)]


def workload(engine: Engine) -> list[dict]:
    """Two waves: three prompts batched together (one sampled with the engine's seed), then prompts
    that share the first wave's prefixes, so the second wave starts from prefix-cache hits."""
    p1, p2, p3 = _ids(40, 1), _ids(27, 2), _ids(33, 3)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True)
    wave1 = engine.generate([p1, p2, p3], [greedy, greedy, sampled])
    wave2 = engine.generate([p1[:32] + [7, 8, 9], p2 + [11, 12], p1 + [3]], greedy)
    return [{"tokens": o.token_ids, "cached_tokens": o.cached_tokens, "finish": o.finish_reason}
            for o in wave1 + wave2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--quantize", default=None, help="quantize at load, e.g. 4bit-g32")
    ap.add_argument("--compile", action="store_true", help="compile_decode=True (mx.compile over the collectives)")
    ap.add_argument("--rank1-checkpoint", default=None, help="rank 1 loads this one (the mismatch test)")
    a = ap.parse_args()
    group = None if a.single else mx.distributed.init(strict=True, backend="ring")
    ckpt = a.rank1_checkpoint if a.rank1_checkpoint and group is not None and group.rank() == 1 else a.checkpoint
    model = mtlqwen.load(ckpt, quantize=a.quantize, group=group)
    kw = {"draft": a.draft, "n_draft": 3} if a.draft else {}
    if a.compile:
        kw["compile_decode"] = True
    engine = Engine(model, slots=3, step_tokens=32, block_tokens=8, num_blocks=64, prefix_interval=16, seed=1234, **kw)
    outputs = workload(engine)
    rank = 0 if group is None else group.rank()
    report = {
        "rank": rank,
        "size": 1 if group is None else group.size(),
        "outputs": outputs,
        "prefix_hits": engine.stats().get("prefix_hits"),

        "weight_bytes": sum(v.nbytes for v in model.weights.values()),
        "cache_bytes": sum(a.nbytes for a in engine.cache.arrays()),
    }
    if a.draft and a.compile:
        # greedy verifications long enough to pipeline (compiled engines pipeline all-verify steps by default):
        # no prefix cache, whose snapshot boundaries send steps back to the synchronous rule
        pipe = Engine(model, slots=2, step_tokens=32, block_tokens=8, num_blocks=64, prefix_interval=0, **kw)
        outs = pipe.generate([_ids(21, 4), _ids(30, 5)], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        report["pipelined"] = {"tokens": [o.token_ids for o in outs],
                               "spec_pipelined_steps": pipe.stats()["spec_pipelined_steps"]}
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
