"""Sanity checks of the tiny-checkpoint helper (tests/hf_checkpoints.py) itself."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

import hf_checkpoints as hc  # noqa: E402

H, HK, DK, DV, K = 128, 2, 32, 48, 4
VARIANTS = {
    "dense_r3": dict(r=3),
    "dense_r1_tied": dict(r=1, tied=True),
    "moe_r3": dict(r=3, moe=True),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("hf_ckpts")
    return {name: hc.write_tiny_checkpoint(root / name, **kw) for name, kw in VARIANTS.items()}


def read_all(dest: pathlib.Path) -> dict[str, tuple[torch.Tensor, str]]:
    """key -> (tensor, shard file name)."""
    out = {}
    for f in sorted(dest.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                out[k] = (s.get_tensor(k), f.name)
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_layout(ckpts, name):
    kw = VARIANTS[name]
    dest, r, moe, tied = ckpts[name], kw["r"], kw.get("moe", False), kw.get("tied", False)
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_5_moe" if moe else "qwen3_5")
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    tc = cfg["text_config"]
    assert tc["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert (tc["linear_num_key_heads"], tc["linear_num_value_heads"]) == (HK, HK * r)
    assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert tc["tie_word_embeddings"] is tied and cfg["tie_word_embeddings"] is tied
    assert sum(tc["rope_parameters"]["mrope_section"]) == 64 * 0.25 / 2
    assert "vision_config" in cfg and tc["mtp_num_hidden_layers"] == 1

    t = read_all(dest)
    assert all(k.startswith(("model.language_model.", "model.visual.", "lm_head.", "mtp.")) for k in t)
    assert any(k.startswith("model.visual.") for k in t)
    assert ("lm_head.weight" in t) is (not tied)
    assert all(v.dtype == torch.float32 for v, _ in t.values())

    shape = lambda k: tuple(t["model.language_model." + k][0].shape)  # noqa: E731
    conv_dim, vdim = 2 * HK * DK + HK * r * DV, HK * r * DV
    gdn = "layers.0.linear_attn."
    assert shape(gdn + "in_proj_qkv.weight") == (conv_dim, H)
    assert shape(gdn + "in_proj_z.weight") == (vdim, H)
    assert shape(gdn + "in_proj_a.weight") == shape(gdn + "in_proj_b.weight") == (HK * r, H)
    assert shape(gdn + "conv1d.weight") == (conv_dim, 1, K)
    assert shape(gdn + "A_log") == shape(gdn + "dt_bias") == (HK * r,)
    assert shape(gdn + "norm.weight") == (DV,)
    assert shape(gdn + "out_proj.weight") == (H, vdim)
    att = "layers.3.self_attn."
    assert shape(att + "q_proj.weight") == (2 * 4 * 64, H)
    assert shape(att + "k_proj.weight") == shape(att + "v_proj.weight") == (2 * 64, H)
    assert shape(att + "o_proj.weight") == (H, 4 * 64)
    assert shape(att + "q_norm.weight") == (64,)
    assert "model.language_model.layers.3.linear_attn.A_log" not in t
    if moe:
        # official fused expert form, no `.weight` suffix
        assert shape("layers.0.mlp.experts.gate_up_proj") == (8, 64, H)
        assert shape("layers.0.mlp.experts.down_proj") == (8, H, 32)
        assert shape("layers.0.mlp.gate.weight") == (8, H)
        assert shape("layers.0.mlp.shared_expert.gate_proj.weight") == (48, H)
        assert shape("layers.0.mlp.shared_expert_gate.weight") == (1, H)
        assert not any(".experts.0." in k for k in t)
    else:
        assert shape("layers.0.mlp.gate_proj.weight") == (256, H)

    assert tuple(t["mtp.fc.weight"][0].shape) == (H, 2 * H)
    for k in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
              "mtp.layers.0.input_layernorm.weight"):
        assert tuple(t[k][0].shape) == (H,)

    index = json.loads((dest / "model.safetensors.index.json").read_text())
    shards = {p.name for p in dest.glob("*.safetensors")}
    assert len(shards) >= 2 and set(index["weight_map"].values()) == shards
    assert index["weight_map"] == {k: f for k, (_, f) in t.items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v, _ in t.values())

    gen = json.loads((dest / "generation_config.json").read_text())
    ids = hc.tiny_special_ids(512)
    assert gen["eos_token_id"] == [ids["im_end"], ids["endoftext"]] and tc["eos_token_id"] == ids["endoftext"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_randomised(ckpts, name):
    t = {k: v.double() for k, (v, _) in read_all(ckpts[name]).items() if k.startswith("model.language_model.")}
    zc = [v for k, v in t.items() if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))]
    zc.append(t["model.language_model.norm.weight"])
    zc = torch.cat(zc)
    assert 0.15 < zc.std() < 0.25 and abs(zc.mean()) < 0.05
    gated = torch.cat([v for k, v in t.items() if k.endswith("linear_attn.norm.weight")])
    assert abs(gated.mean() - 1) < 0.05 and 0.15 < gated.std() < 0.25
    a_log = torch.cat([v for k, v in t.items() if k.endswith("A_log")])
    # log U(1, 16); HF's init reaches down to log(0.01) < 0
    assert a_log.min() >= 0 and a_log.max() <= np.log(16) and a_log.std() > 0.3
    dt = torch.cat([v for k, v in t.items() if k.endswith("dt_bias")])
    assert abs(dt.mean()) < 0.3 and 0.3 < dt.std() < 0.7
    assert 0.95 < t["model.language_model.embed_tokens.weight"].std() < 1.05
    qkv = t["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert abs(qkv.std() * np.sqrt(H) - 1) < 0.05
    conv = t["model.language_model.layers.0.linear_attn.conv1d.weight"]
    assert abs(conv.std() * np.sqrt(K) - 1) < 0.1


def test_seed_determinism(tmp_path):
    a = read_all(hc.write_tiny_checkpoint(tmp_path / "a", seed=5, r=2))
    b = read_all(hc.write_tiny_checkpoint(tmp_path / "b", seed=5, r=2))
    c = read_all(hc.write_tiny_checkpoint(tmp_path / "c", seed=6, r=2))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k][0], b[k][0]) for k in a)
    assert not torch.equal(a["model.language_model.layers.0.linear_attn.A_log"][0],
                           c["model.language_model.layers.0.linear_attn.A_log"][0])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causal_lm_loads_vl_layout(ckpts, name):
    """Qwen3_5(Moe)ForCausalLM must take every decoder weight from the VL files, not re-initialise any."""
    import transformers as tf

    dest = ckpts[name]
    Model = tf.Qwen3_5MoeForCausalLM if VARIANTS[name].get("moe") else tf.Qwen3_5ForCausalLM
    model, info = Model.from_pretrained(dest, dtype=torch.float32, attn_implementation="eager",
                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    files = {k: v for k, (v, _) in read_all(dest).items()}
    sd = model.state_dict()
    for k, v in sd.items():
        src = "lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)
        if k == "lm_head.weight" and VARIANTS[name].get("tied"):
            src = "model.language_model.embed_tokens.weight"
        assert torch.equal(v, files[src]), k
    n_text = sum(1 for k in files if k.startswith("model.language_model.")) + ("lm_head.weight" in files)
    assert len({k for k in sd if k != "lm_head.weight"}) + ("lm_head.weight" in files) == n_text


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_logits(ckpts, name):
    ids = hc.random_token_ids(70, 512, seed=1)  # 70 > 64 crosses HF's GDN chunk boundary
    a = hc.hf_reference_logits(ckpts[name], ids)
    assert a.shape == (70, 512) and a.dtype == np.float32 and np.isfinite(a).all()
    assert 0.3 < a.std() < 30
    hc._HF_MODELS.clear()  # a fresh load must give the same numbers
    b = hc.hf_reference_logits(ckpts[name], ids)
    assert np.array_equal(a, b)
    # causal: the prefix's logits do not depend on later tokens
    c = hc.hf_reference_logits(ckpts[name], ids[:40])
    # fp32 sums over one chunk (40 tokens) or two (70) round differently: up to ~1e-5 of the logits' scale
    # (transformers 5.24's chunked delta rule: 1.9e-4 where the largest logit is ~20); a leak would be O(1)
    np.testing.assert_allclose(c, a[:40], atol=1.5e-5 * np.abs(a).max(), rtol=2e-5)


def test_variants_differ(ckpts):
    ids = hc.random_token_ids(20, 512, seed=2)
    outs = [hc.hf_reference_logits(ckpts[n], ids) for n in VARIANTS]
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[0], outs[2])


@pytest.mark.parametrize("moe", [False, True])
def test_text_only_checkpoint(tmp_path, ckpts, moe):
    name = "moe_r3" if moe else "dense_r3"
    dest = hc.write_tiny_text_only_checkpoint(tmp_path / "t", **VARIANTS[name])
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert "text_config" not in cfg and "vision_config" not in cfg
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
    t = read_all(dest)
    assert all(k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.", "mtp.")) for k in t)
    assert "lm_head.weight" in t and "model.layers.0.linear_attn.A_log" in t
    # same arguments -> same decoder weights (bitwise) and logits as the VL checkpoint
    vl = read_all(ckpts[name])
    assert all(torch.equal(v, vl[k.replace("model.", "model.language_model.", 1)][0])
               for k, (v, _) in t.items() if k.startswith("model."))
    ids = hc.random_token_ids(30, 512, seed=3)
    # not bitwise: the loaded MoE expert tensors may differ in memory layout, so matmuls round differently
    np.testing.assert_allclose(hc.hf_reference_logits(dest, ids), hc.hf_reference_logits(ckpts[name], ids),
                               atol=1e-5, rtol=0)


def test_bfloat16_keeps_a_log_fp32(tmp_path):
    dest = hc.write_tiny_checkpoint(tmp_path / "bf", moe=True, dtype="bfloat16")
    t = read_all(dest)
    for k, (v, _) in t.items():
        assert v.dtype == (torch.float32 if k.endswith("A_log") else torch.bfloat16), k
    out = hc.hf_reference_logits(dest, hc.random_token_ids(10, 512, seed=4))
    assert out.shape == (10, 512) and out.dtype == np.float32 and np.isfinite(out).all()


def test_per_expert_layout_matches_fused(tmp_path, ckpts):
    dest = hc.write_tiny_checkpoint(tmp_path / "pe", moe=True, fused_experts=False, extra_tensors=False)
    t = read_all(dest)
    assert "model.language_model.layers.0.mlp.experts.7.gate_proj.weight" in t
    assert not any(k.startswith("mtp.") for k in t)
    fused = read_all(ckpts["moe_r3"])
    gu = fused["model.language_model.layers.0.mlp.experts.gate_up_proj"][0]
    # fused gate_up_proj rows: gate first, then up
    assert torch.equal(gu[2, :32], t["model.language_model.layers.0.mlp.experts.2.gate_proj.weight"][0])
    assert torch.equal(gu[2, 32:], t["model.language_model.layers.0.mlp.experts.2.up_proj.weight"][0])
    ids = hc.random_token_ids(12, 512, seed=5)
    np.testing.assert_allclose(hc.hf_reference_logits(dest, ids), hc.hf_reference_logits(ckpts["moe_r3"], ids),
                               atol=1e-5, rtol=0)


def test_random_token_ids():
    a = hc.random_token_ids(100, 50, seed=7)
    assert a == hc.random_token_ids(100, 50, seed=7) != hc.random_token_ids(100, 50, seed=8)
    assert len(a) == 100 and all(isinstance(x, int) and 0 <= x < 50 for x in a)
