"""A 35B-A3B-shaped MoE model at reduced depth (4 layers: 3 GDN + 1 attention, hidden 2048, 16 attention /
2 KV heads, Hk 16 / Hv 32, Im = Is = 512, top-8 of 32 experts, vocabulary 4096), random weights at MLX
4-bit g64 with the routers at 8 bits (as mlx-community checkpoints), against the same weights dequantized
and run in fp32 on the CPU. CPU: the reference ops (quantized, fp32 activations) against fp32, and the compiled decode step
of an MoE model against the model run alone. GPU: the kernels (routing, fused experts, grouped prefill)
against fp32; the budget is test_gpu_model.py's (bf16 activations)."""

from __future__ import annotations


import numpy as np
import pytest

import mlx.core as mx
from mtlqwen.kernels import backend
from mtlqwen.model import QuantSpec
from mtlqwen.model.config import parse_config
from mtlqwen.runtime import Engine

from engine_checks import assert_reference, greedy
from gpu_checks import NEEDS_GPU

TOLERANCE = 5e-2  # max |model - fp32 reference| / max |reference logit| (test_gpu_model.py's budget)


def moe_35b_shape(layers: int = 4, experts: int = 32):
    base = {
        "model_type": "qwen3_5_moe_text", "vocab_size": 4096, "hidden_size": 2048, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": experts, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "eos_token_id": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    }
    return parse_config(base)


@pytest.fixture(scope="module")
def model():
    from mtlqwen.model.builtin import random_model  # noqa: PLC0415

    return random_model(config=moe_35b_shape(), seed=3, quantize=QuantSpec(4, 64))


def dense_twin(model):
    """The same weights, every quantized matrix dequantized (experts included), everything fp32."""
    from mtlqwen.model.qwen35 import Qwen35Model  # noqa: PLC0415
    from mtlqwen.model.quantize import dense_config, dequantize_weights  # noqa: PLC0415

    return Qwen35Model(dense_config(model.config),
                       dequantize_weights(model.weights, model.config, mx.float32, cast_all=True))


def cpu_logits(m, prompt) -> np.ndarray:
    """Logits on the CPU back-end (its reference ops), whatever the default device."""
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        return np.asarray(m.logits(prompt).astype(mx.float32))
    finally:
        mx.set_default_device(prev)


def compare(got: np.ndarray, ref: np.ndarray) -> float:
    assert np.isfinite(got).all()
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_routers_at_8_bits(model):
    ov = model.config.quant_overrides
    assert ov["model.layers.0.mlp.gate"] == QuantSpec(8, 64)
    assert ov["model.layers.0.mlp.shared_expert_gate"] == QuantSpec(8, 64)
    assert model.layers[0].mlp.gate_proj.weight.shape == (32, 512, 2048 * 4 // 32)


def test_reference_path_matches_fp32():
    """The reference ops on the quantized model (fp32 scales and activations: MLX's CPU quantized matmul
    is inexact with bf16 inputs, test_gpu_model.py) = the dequantized fp32 model: the routing, the
    experts' gather_qmm and the shared expert wired as the dense twin computes them."""
    from mtlqwen.model.builtin import random_model  # noqa: PLC0415

    m = random_model(config=moe_35b_shape(experts=16), seed=4, dtype=mx.float32, quantize=QuantSpec(4, 64))
    prompt = np.random.default_rng(0).integers(0, 4096, 12).tolist()
    rel = compare(cpu_logits(m, prompt), cpu_logits(dense_twin(m), prompt))
    print(f"quantized reference vs fp32: {rel:.2e}")
    assert rel <= 1e-4


def test_compiled_decode_of_an_moe_model(tmp_path):
    """The MoE decode step goes through CompiledDecode as the dense one does: same tokens as the model
    run alone, one trace per shape class (CPU: over the reference ops)."""
    import mtlqwen  # noqa: PLC0415
    from hf_checkpoints import random_token_ids, write_tiny_checkpoint  # noqa: PLC0415

    m = mtlqwen.load(write_tiny_checkpoint(tmp_path / "moe", moe=True, r=2, seed=8))
    assert m.config.is_moe
    eng = Engine(m, slots=2, step_tokens=64, block_tokens=16, num_blocks=32, compile_decode=True, prefix_interval=0)
    prompts = [random_token_ids(n, 512, seed=n) for n in (20, 9)]
    outs = eng.generate(prompts, greedy(12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert_reference(m, p, o, 12, ignore_eos=True)
    assert eng.compiled is not None and 1 <= eng.compiled.traces <= 2


# MoE routing in bf16 flips near-tied experts against fp32 (a whole expert's share of the output): on the H200
# MLX's own ops in bf16 on this model and prompt are 7.7e-2 off the fp32 reference, the kernels 7.67e-2. So the
# kernels' budget is the larger of TOLERANCE and BF16_MARGIN x what MLX's bf16 ops reach on the same tokens.
BF16_MARGIN = 1.25
BF16_CEILING = 0.15  # the premise: bf16 itself stays this close, or the comparison says nothing


@pytest.mark.gpu
@pytest.mark.skipif(backend.gpu_backend() is None, reason=NEEDS_GPU)
def test_kernels_match_fp32(model, monkeypatch):
    """Prefill of 150 tokens (grouped-by-expert path) then 6 decode steps (fused kernels) on the GPU, against
    fp32 on the CPU, within the bf16 error of MLX's own ops (MTLQWEN_FORCE_REFERENCE) on the same tokens."""
    from mtlqwen.kernels import dispatch  # noqa: PLC0415
    from test_gpu_model import greedy as greedy_steps  # noqa: PLC0415

    ref_model = dense_twin(model)
    prompt = np.random.default_rng(1).integers(0, 4096, 150).tolist()
    ref = cpu_logits(ref_model, prompt)
    rel = compare(np.asarray(model.logits(prompt).astype(mx.float32)), ref)
    toks, rows = greedy_steps(model, prompt[:40], 6)  # decode rows after the first: T = 1, the fused kernels
    row_refs = [cpu_logits(ref_model, prompt[:40] + toks[:i])[-1] for i in range(1, 6)]  # on the kernels' tokens
    monkeypatch.setattr(backend, "FORCE_REFERENCE", True)
    base = compare(np.asarray(model.logits(prompt).astype(mx.float32)), ref)
    base = max([base] + [compare(np.asarray(model.logits(prompt[:40] + toks[:i])[-1].astype(mx.float32)), r)
                         for i, r in zip(range(1, 6), row_refs)])
    monkeypatch.setattr(backend, "FORCE_REFERENCE", False)
    budget = max(TOLERANCE, BF16_MARGIN * base)
    print(f"kernels vs fp32 reference (prefill): {rel:.2e}; MLX's bf16 ops: {base:.2e}; budget {budget:.2e}")
    assert base <= BF16_CEILING
    assert rel <= budget
    for i, r in zip(range(1, 6), row_refs):
        assert compare(rows[i], r) <= budget
    for name in ("moe_route", "moe_experts"):
        assert dispatch.OPS[name].failed is None, dispatch.OPS[name].failed
