"""config.json parsing and the clear errors users get for bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest

import hf_checkpoints as H
import mlx.core as mx
import mtlqwen
from mtlqwen.model import CheckpointError, ConfigError, parse_config
from mtlqwen.model.builtin import qwen35_9b_config

TEXT = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 6, "linear_key_head_dim": 32, "linear_value_head_dim": 48,
}


@pytest.mark.parametrize("top,text", [("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")])
def test_nested_text_config(top, text):
    extra = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48} if "moe" in top else {}
    c = parse_config({"model_type": top, "tie_word_embeddings": True,
                      "text_config": {"model_type": text, **TEXT, **extra, "eos_token_id": 5}})
    assert c.is_moe == ("moe" in top)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert (c.gdn_ratio, c.conv_dim, c.rotary_dim) == (3, 2 * 64 + 288, 16)
    assert c.tie_word_embeddings and c.eos_token_ids == [5]


def test_top_level_text_config_and_layer_types():
    types = ["full_attention", "linear_attention"] * 4
    c = parse_config({"model_type": "qwen3_5_text", **TEXT, "layer_types": types})
    assert c.layer_types == types and c.full_attention_layers == [0, 2, 4, 6]


def test_full_attention_interval():
    c = parse_config({"model_type": "qwen3_5_text", **TEXT, "full_attention_interval": 2})
    assert c.full_attention_layers == [1, 3, 5, 7]


def test_9b_geometry():
    c = qwen35_9b_config()
    assert (c.conv_dim, c.value_dim, c.gdn_ratio, len(c.full_attention_layers)) == (8192, 4096, 2, 8)


@pytest.mark.parametrize("mt", ["llama", "qwen3_next", None])
def test_unknown_model_type_names_supported(mt):
    with pytest.raises(ConfigError, match="qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text"):
        parse_config({"model_type": mt, **TEXT})


def test_missing_fields_and_bad_layer_types():
    with pytest.raises(ConfigError, match="hidden_size"):
        parse_config({"model_type": "qwen3_5_text", **{k: v for k, v in TEXT.items() if k != "hidden_size"}})
    with pytest.raises(ConfigError, match="layer_types has 2 entries"):
        parse_config({"model_type": "qwen3_5_text", **TEXT, "layer_types": ["full_attention"] * 2})


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return H.write_tiny_checkpoint(tmp_path_factory.mktemp("good"), moe=False, r=3, seed=1)


def _copy(good, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(good, d)
    return d


def test_missing_directory_and_repo():
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        mtlqwen.load("./does/not/exist")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        mtlqwen.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="not supported"):
        mtlqwen.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        mtlqwen.load(tmp_path)


def _edit_tensors(d, fn):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        w = dict(mx.load(str(d / shard)))
        fn(w)
        mx.save_safetensors(str(d / shard), w)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in w or v != shard}
        index["weight_map"].update({k: shard for k in w})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_is_named(good, tmp_path):
    d = _copy(good, tmp_path)
    _edit_tensors(d, lambda w: w.pop("model.language_model.layers.2.linear_attn.A_log", None))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model.layers.2.linear_attn.A_log"):
        mtlqwen.load(d)


def test_extra_tensor_is_named(good, tmp_path):
    d = _copy(good, tmp_path)

    def add(w):
        if "model.language_model.norm.weight" in w:
            w["model.language_model.layers.0.mlp.bogus.weight"] = mx.zeros((3,))
    _edit_tensors(d, add)
    with pytest.raises(CheckpointError, match="unexpected tensors.*layers.0.mlp.bogus.weight"):
        mtlqwen.load(d)


def test_wrong_shape_is_named(good, tmp_path):
    d = _copy(good, tmp_path)

    def bad(w):
        k = "model.language_model.layers.3.self_attn.k_proj.weight"
        if k in w:
            w[k] = w[k][:64]
    _edit_tensors(d, bad)
    with pytest.raises(CheckpointError, match=r"self_attn.k_proj.weight \(64, 128\) \(expected \(128, 128\)\)"):
        mtlqwen.load(d)


def test_missing_shard(good, tmp_path):
    d = _copy(good, tmp_path)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        mtlqwen.load(d)


@pytest.mark.parametrize("q", [{"bits": 3, "group_size": 64}, {"bits": 4, "group_size": 16}, {"mode": "mxfp4"}])
def test_unsupported_quantization(good, tmp_path, q):
    d = _copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"] = q
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not supported|unsupported quantization"):
        mtlqwen.load(d)


@pytest.mark.parametrize("arg", ["3bit", "4bit-g16", "fp8", 5])
def test_unsupported_quantize_argument(good, arg):
    with pytest.raises(ConfigError, match="unsupported quantization|not understood"):
        mtlqwen.load(good, quantize=arg)
