"""In-place writes within one evaluation on MLX's CUDA back-end (docs/design.md, "In-place writes").

    source .device/env.sh && python benchmarks/inplace_order_check.py            # CUDA graphs on (MLX's default)
    source .device/env.sh && MLX_USE_CUDA_GRAPHS=0 python benchmarks/inplace_order_check.py

A 4-layer model at the Qwen3.5-9B layer geometry (4-bit) prefills 4 sequences and decodes 3 steps, twice:
with the prefill evaluated on its own first (as the engine evaluates every step), and with the prefill and
the first decode step built lazily and evaluated together. In the second form the decode step's conv reads
the pool that the prefill's conv writes in place; MLX's CUDA graphs order kernels only by the buffers they
declare as outputs, so nothing orders that read after the write. Printed: the largest logit difference over
the largest logit, for the conv's two launches (row qmv_conv_epilogue off) and for the projections' conv
epilogue (on). Equal logits (0) mean the kernels ran in order; the recorded H200 run
(results/inplace-order-check.log) gives 0.935 for the one-evaluation form with CUDA graphs on, 0 without them,
and 0 between the epilogue and the two launches in the engine's form.
"""

from __future__ import annotations

import numpy as np
import mlx.core as mx

from mtlqwen.kernels import SeqLayout
from mtlqwen.kernels.selection import selected
from mtlqwen.model.builtin import qwen35_9b_config, random_model
from mtlqwen.model.config import QuantSpec

B, L, STEPS = 4, 40, 3


def toy_model():
    """The Qwen3.5-9B layer geometry at 4 layers (3 GDN, 1 attention), 4-bit, a 4096-token vocabulary."""
    c = qwen35_9b_config()
    c.num_hidden_layers, c.layer_types, c.vocab_size = 4, c.layer_types[:4], 4096
    return random_model(config=c, quantize=QuantSpec(4, 64))


def run(model, prompt: mx.array, toks: list[mx.array], row: int, eval_prefill: bool) -> list[np.ndarray]:
    """A prefill of B sequences of L tokens (prompt [B * L]), then one decode step per token array in toks
    ([B] each, every step evaluated), with SELECT["qmv_conv_epilogue"] = row -> each step's logits [B, vocab],
    then every GDN layer's conv pool, as float32. eval_prefill: the prefill in its own evaluation, as the
    engine runs steps; else built lazily into the first decode step's evaluation."""
    with selected({"qmv_conv_epilogue": row}):
        cache = model.make_cache(B + 1, B + 1, 128)
        tables = [[i] for i in range(B)]
        model.hidden(prompt, SeqLayout([i * L for i in range(B + 1)], [0] * B, tables, list(range(1, B + 1)), 128), cache)
        if eval_prefill:
            mx.eval(cache.arrays())
        outs = []
        for s, tok in enumerate(toks):
            lay = SeqLayout(list(range(B + 1)), [L + s] * B, tables, list(range(1, B + 1)), 128)
            outs.append(model.forward(tok, lay, cache, logits_rows=mx.arange(B)))
            mx.eval(outs, cache.arrays())
        return [np.array(a.astype(mx.float32)) for a in (*outs, *cache.conv_states)]


def rel(a: list[np.ndarray], b: list[np.ndarray], steps: int = STEPS) -> float:
    """The largest logit difference over the largest logit, across the decode steps."""
    x, y = np.stack(a[:steps]), np.stack(b[:steps])
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def main() -> None:
    model = toy_model()
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, model.config.vocab_size, B * L).astype(np.int32))
    toks = [mx.array(rng.integers(0, model.config.vocab_size, B).astype(np.int32)) for _ in range(STEPS)]
    for trial in range(3):
        ref = run(model, prompt, toks, 0, True)
        print(f"trial {trial}: one evaluation (prefill+decode), row off, vs prefill evaluated first: rel "
              f"{rel(run(model, prompt, toks, 0, False), ref):.3g}; row on, separate: rel "
              f"{rel(run(model, prompt, toks, 1, True), ref):.3g}; row on, one evaluation: rel "
              f"{rel(run(model, prompt, toks, 1, False), ref):.3g}", flush=True)


if __name__ == "__main__":
    main()
