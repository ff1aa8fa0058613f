"""Quantized models against the same model with its weights dequantized, and convert round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hf_checkpoints as H
import mlx.core as mx
import mtlqwen
from mtlqwen.model import Qwen35Model
from mtlqwen.model.convert import convert
from mtlqwen.model.quantize import dense_config, dequantize_weights


def dequantized_twin(model: Qwen35Model) -> Qwen35Model:
    """The same model with every quantized module replaced by its dequantized float weight."""
    return Qwen35Model(dense_config(model.config), dequantize_weights(model.weights, model.config))


def rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    return {
        "dense": H.write_tiny_checkpoint(root / "dense", moe=False, r=3, seed=31),
        "moe": H.write_tiny_checkpoint(root / "moe", moe=True, r=3, seed=32),
    }


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("spec", ["4bit", "8bit", "4bit-g32", "8bit-g128"])
def test_quantized_matches_dequantized(ckpts, kind, spec):
    m = mtlqwen.load(ckpts[kind], quantize=spec)
    assert m.embed.quantized and m.config.quantization is not None
    ids = H.random_token_ids(90, 512, seed=3)
    assert rel_err(m.logits(ids), dequantized_twin(m).logits(ids)) <= 1e-4


def test_moe_router_stays_8bit(ckpts):
    m = mtlqwen.load(ckpts["moe"], quantize="4bit")
    router = m.layers[0].mlp.router
    assert router.bits == 8 and m.layers[0].mlp.gate_proj.bits == 4
    # A_log, dt_bias, norms and conv weights are never quantized
    assert not any(k.endswith(("A_log.scales", "conv1d.scales", "norm.scales")) for k in m.weights)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_convert_quantized_loads_back_to_same_logits(ckpts, kind, tmp_path):
    out = convert(ckpts[kind], tmp_path / "q4", quantize="4bit", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    ids = H.random_token_ids(70, 512, seed=4)
    direct = mtlqwen.load(ckpts[kind], quantize="4bit").logits(ids)
    assert rel_err(mtlqwen.load(out).logits(ids), direct) <= 1e-5


def test_per_module_override_checkpoint(ckpts, tmp_path):
    """An mlx-community style file: one module at 8-bit g32, the rest 4-bit g64, named by full path."""
    out = convert(ckpts["dense"], tmp_path / "mixed", progress=False)
    weights = mx.load(str(out / "model.safetensors"))
    target = "language_model.model.layers.1.linear_attn.in_proj_qkv"
    mixed = {}
    for k, v in weights.items():
        module = k[: -len(".weight")]
        if k.endswith(".weight") and v.ndim == 2 and "conv1d" not in k and v.shape[-1] % 64 == 0:
            bits, group = (8, 32) if module == target else (4, 64)
            mixed[k], mixed[module + ".scales"], mixed[module + ".biases"] = mx.quantize(v, group_size=group, bits=bits)
        else:
            mixed[k] = v
    mx.save_safetensors(str(out / "model.safetensors"), mixed)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4, target: {"group_size": 32, "bits": 8}}
    (out / "config.json").write_text(json.dumps(cfg))
    m = mtlqwen.load(out)
    assert m.layers[1].mixer.in_proj_qkv.bits == 8 and m.layers[1].mixer.in_proj_qkv.group_size == 32
    ids = H.random_token_ids(50, 512, seed=5)
    assert rel_err(m.logits(ids), dequantized_twin(m).logits(ids)) <= 1e-4
