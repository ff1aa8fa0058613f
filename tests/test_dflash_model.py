"""The DFlash drafter against an independent float64 numpy re-implementation of dflash.md §1/§3, fed by
transformers' hidden states of the tiny Qwen3.5 target; chunked context writes, packed drafting, the
fit / loading errors and the config rules (tap fallback, causality, block size, RoPE)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dflash_checkpoints as D
import hf_checkpoints as H
import mlx.core as mx
import mtlqwen
from mtlqwen import SeqLayout
from mtlqwen.model.config import ConfigError
from mtlqwen.model.dflash import load_drafter
from mtlqwen.model.dflash_config import DrafterFitError, default_target_layer_ids, parse_dflash_config
from mtlqwen.model.weights import CheckpointError

BT = 16  # block tokens: small so contexts span several blocks
P = 37  # committed context length in the single-sequence tests (not a multiple of BT)
TABLE = [5, 0, 3]  # a scrambled block table for it
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}
VARIANTS = {
    "full": dict(taps=[1, 4, 6]),  # 3 taps for 2 layers: the counts are independent
    "sliding-causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "sliding-noncausal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8, is_causal=False),
    "full-causal": dict(is_causal=True),
    "yarn": dict(rope_parameters=YARN, rope_theta=None),
}


def rel_err(out, ref) -> float:
    return float(np.abs(np.asarray(out, dtype=np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return H.write_tiny_checkpoint(tmp_path_factory.mktemp("target"), moe=False, r=3, seed=21)


@pytest.fixture(scope="module")
def target(target_dir):
    return mtlqwen.load(target_dir)


@pytest.fixture(scope="module")
def prompt():
    ids = H.random_token_ids(P + 1, 508, seed=5)
    return ids[:P], ids[P]  # committed tokens, anchor


def hf_taps(target_dir, ids, taps) -> np.ndarray:
    """[T, k*H] float64: HF output_hidden_states[L + 1] for each tap L (§1.2)."""
    import torch  # noqa: PLC0415

    with torch.no_grad():
        hs = H.load_hf_model(target_dir)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return np.concatenate([hs[t + 1][0].double().numpy() for t in taps], axis=-1)


# ------------------------------------------------------------------------- the float64 reference
def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, inv_freq, attn):
    """NeoX rotate-half over the full head dim; cos/sin scaled by the YaRN attention factor."""
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = (np.cos(ang) * attn)[:, None, :], (np.sin(ang) * attn)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _inv_freq(cfg):
    """Plain theta^(-2i/d), or transformers' own YaRN frequencies (independent of mtlqwen's code)."""
    hd = cfg["head_dim"]
    rp = cfg.get("rope_parameters") or {}
    if rp.get("rope_type") != "yarn":
        return 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd), 1.0
    import transformers as tf  # noqa: PLC0415
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    c = tf.Qwen3Config(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"], head_dim=hd,
                       max_position_embeddings=cfg["max_position_embeddings"], rope_parameters=dict(rp))
    inv, attn = ROPE_INIT_FUNCTIONS["yarn"](c, None)
    return inv.double().numpy(), attn


def reference_draft(ddir, target_dir, feat, anchor, n_draft):
    """dflash.md §3.2 for one sequence with context rows 0..P-1 = feat [P, k*H]: logits [n_draft, vocab]."""
    from safetensors.numpy import load_file  # noqa: PLC0415

    cfg = json.loads((ddir / "config.json").read_text())
    W = {k: v.astype(np.float64) for k, v in load_file(str(ddir / "model.safetensors")).items()}
    hf = H.load_hf_model(target_dir)
    embed = hf.model.embed_tokens.weight.detach().double().numpy()
    head = hf.lm_head.weight.detach().double().numpy()
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    nH, nKV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inv_freq, attn = _inv_freq(cfg)
    n_ctx, B = feat.shape[0], n_draft + 1
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    ctx = _rms(feat @ W["fc.weight"].T, W["hidden_norm.weight"], eps)  # §1.3
    x = embed[[anchor] + [cfg["dflash_config"]["mask_token_id"]] * n_draft]  # §1.7
    cpos, bpos = np.arange(n_ctx), n_ctx + np.arange(B)
    for i, kind in enumerate(types):
        p = f"layers.{i}."
        g = lambda n: W[p + n]  # noqa: E731
        # §1.4: the layer's own k_proj / k_norm / v_proj on ctx (context positions) and on the block
        kc = _rope(_rms((ctx @ g("self_attn.k_proj.weight").T).reshape(n_ctx, nKV, hd), g("self_attn.k_norm.weight"), eps), cpos, inv_freq, attn)
        vc = (ctx @ g("self_attn.v_proj.weight").T).reshape(n_ctx, nKV, hd)
        h = _rms(x, g("input_layernorm.weight"), eps)
        q = _rope(_rms((h @ g("self_attn.q_proj.weight").T).reshape(B, nH, hd), g("self_attn.q_norm.weight"), eps), bpos, inv_freq, attn)
        kb = _rope(_rms((h @ g("self_attn.k_proj.weight").T).reshape(B, nKV, hd), g("self_attn.k_norm.weight"), eps), bpos, inv_freq, attn)
        vb = (h @ g("self_attn.v_proj.weight").T).reshape(B, nKV, hd)
        K, V = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        kpos = np.concatenate([cpos, bpos])
        # §1.5: explicit is_causal wins, else sliding layers are causal; sliding layers see a window
        causal = cfg["is_causal"] if cfg.get("is_causal") is not None else kind == "sliding_attention"
        ok = np.ones((B, len(kpos)), dtype=bool)
        if causal:
            ok &= kpos[None, :] <= bpos[:, None]
        if kind == "sliding_attention":
            ok &= bpos[:, None] - kpos[None, :] < cfg["sliding_window"]
        out = np.zeros((B, nH, hd))
        for head_i in range(nH):
            kvh = head_i // (nH // nKV)
            s = np.where(ok, q[:, head_i] @ K[:, kvh].T / np.sqrt(hd), -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, head_i] = (pr / pr.sum(-1, keepdims=True)) @ V[:, kvh]
        x = x + out.reshape(B, nH * hd) @ g("self_attn.o_proj.weight").T
        h = _rms(x, g("post_attention_layernorm.weight"), eps)
        gt = h @ g("mlp.gate_proj.weight").T
        x = x + (gt / (1 + np.exp(-gt)) * (h @ g("mlp.up_proj.weight").T)) @ g("mlp.down_proj.weight").T
    return _rms(x, W["norm.weight"], eps)[1:] @ head.T  # drop slot 0; slot j predicts position P + j


# ------------------------------------------------------------------------------------ helpers
def layout(kv_valid, q_lens, tables):
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(int).tolist()
    return SeqLayout(qsl, list(kv_valid), [list(t) for t in tables], list(range(len(kv_valid))), BT)


def fresh_cache(drafter, target, num_blocks=10):
    return drafter.make_cache(target.make_cache(num_blocks=num_blocks, num_slots=4, block_tokens=BT))


def draft_one(drafter, dcache, anchor, n_ctx, table, n_draft):
    return drafter.propose_with_logits([anchor], layout([n_ctx], [0], [table]), dcache, n_draft)


# -------------------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_matches_float64_reference(variant, target_dir, target, prompt, tmp_path):
    ids, anchor = prompt
    ddir = D.write_tiny_drafter(tmp_path / variant, target_dir, seed=3, **VARIANTS[variant])
    drafter = load_drafter(ddir, target)
    feat = hf_taps(target_dir, ids, drafter.tap_layers)
    dcache = fresh_cache(drafter, target)
    drafter.write_context(mx.array(feat, dtype=mx.float32), layout([0], [P], [TABLE]), dcache)
    for n_draft in (15, 4):
        toks, logits = draft_one(drafter, dcache, anchor, P, TABLE, n_draft)
        ref = reference_draft(ddir, target_dir, feat, anchor, n_draft)
        assert logits.shape == (1, n_draft, 512) and toks.dtype == mx.int32
        assert rel_err(logits[0], ref) <= 1e-4
        assert toks[0].tolist() == ref.argmax(-1).tolist()


def test_end_to_end_with_mtlqwen_taps(target_dir, target, prompt, tmp_path):
    """Taps from the engine's own forward_with_taps (not HF's) give the same proposals."""
    ids, anchor = prompt
    # not the last layer: HF's last hidden_states entry is after the final norm, a DFlash tap is before it
    ddir = D.write_tiny_drafter(tmp_path / "d", target_dir, taps=[0, 3, 6], seed=4)
    drafter = load_drafter(ddir, target)
    cache = target.make_cache(num_blocks=10, num_slots=1, block_tokens=BT)
    dcache = drafter.make_cache(cache)
    lay = layout([0], [P], [TABLE])
    _, taps = target.forward_with_taps(mx.array(ids, dtype=mx.int32), lay, cache, drafter.tap_layers)
    drafter.write_context(taps, lay, dcache)
    toks, logits = draft_one(drafter, dcache, anchor, P, TABLE, 15)
    ref = reference_draft(ddir, target_dir, hf_taps(target_dir, ids, drafter.tap_layers), anchor, 15)
    assert rel_err(logits[0], ref) <= 1e-3
    assert toks[0].tolist() == ref.argmax(-1).tolist()


# -------------------------------------------------------------------------------------- (b), (c)
@pytest.fixture(scope="module")
def sliding_drafter(target_dir, target, tmp_path_factory):
    d = D.write_tiny_drafter(tmp_path_factory.mktemp("sd"), target_dir, num_layers=3, seed=8,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=12)
    return load_drafter(d, target)


def test_chunked_context_equals_one_shot(sliding_drafter, target):
    dr = sliding_drafter
    feat = mx.array(np.random.default_rng(1).standard_normal((P, dr.config.num_taps * 128)), dtype=mx.float32)
    whole, chunked = fresh_cache(dr, target), fresh_cache(dr, target)
    dr.write_context(feat, layout([0], [P], [TABLE]), whole)
    for a, b in ((0, 10), (10, 16), (16, 23), (23, P)):  # splits on and off block boundaries
        dr.write_context(feat[a:b], layout([a], [b - a], [TABLE]), chunked)
    for kw, kc in zip(whole.arrays(), chunked.arrays()):
        assert np.array_equal(np.array(kw), np.array(kc))
    t1, l1 = draft_one(dr, whole, 7, P, TABLE, 6)
    t2, l2 = draft_one(dr, chunked, 7, P, TABLE, 6)
    assert t1.tolist() == t2.tolist() and rel_err(l2, np.array(l1)) <= 1e-6


def test_packed_propose_equals_each_alone(sliding_drafter, target):
    dr = sliding_drafter
    lens, tables, anchors = [P, 1, 16], [TABLE, [7], [2, 9]], [11, 300, 42]
    rng = np.random.default_rng(2)
    feats = [rng.standard_normal((n, dr.config.num_taps * 128)) for n in lens]
    dcache = fresh_cache(dr, target)
    # one packed write (as one prefill step of three sequences) ...
    dr.write_context(mx.array(np.concatenate(feats), dtype=mx.float32), layout([0, 0, 0], lens, tables), dcache)
    before = [np.array(a) for a in dcache.arrays()]
    toks, logits = dr.propose_with_logits(anchors, layout(lens, [0, 0, 0], tables), dcache, 5)
    assert toks.shape == (3, 5) and logits.shape == (3, 5, 512)
    for i in range(3):  # ... and each sequence drafted alone over its own blocks
        t, lg = draft_one(dr, dcache, anchors[i], lens[i], tables[i], 5)
        assert toks[i].tolist() == t[0].tolist()
        assert rel_err(logits[i], np.array(lg[0])) <= 1e-5
    # the block's own K/V are transient: drafting never writes the pools
    assert all(np.array_equal(b, np.array(a)) for b, a in zip(before, dcache.arrays()))
    assert np.array_equal(np.array(dr.propose(anchors, layout(lens, [0, 0, 0], tables), dcache, 5)), np.array(toks))


def test_cache_shares_target_geometry(sliding_drafter, target):
    cache = target.make_cache(num_blocks=6, num_slots=2, block_tokens=BT)
    dc = sliding_drafter.make_cache(cache)
    assert len(dc.k_pools) == len(dc.v_pools) == 3
    assert all(p.shape == (6, BT, D.DRAFT_KV_HEADS, D.DRAFT_HEAD_DIM) and p.dtype == cache.dtype for p in dc.arrays())
    assert dc.bytes_per_block(sliding_drafter.config, BT, mx.float32) == sum(p.nbytes for p in dc.arrays()) // 6


# -------------------------------------------------------------------------------------- (d)
def _expect(exc, match, target, path):
    with pytest.raises(exc, match=match):
        load_drafter(path, target)


def test_fit_errors_name_the_problem(target_dir, target, tmp_path):
    W = lambda name, **kw: D.write_tiny_drafter(tmp_path / name, target_dir, **kw)  # noqa: E731
    _expect(DrafterFitError, r"hidden_size: drafter 64 != target 128", target, W("h", hidden_size=64))
    _expect(DrafterFitError, r"target_layer_ids \[8\] are outside the target's layers 0\.\.7", target,
            W("t", taps=[1, 8]))
    _expect(DrafterFitError, r"mask_token_id 512 is outside the target vocabulary", target, W("m", mask_token_id=512))
    both = W("hm", hidden_size=96, mask_token_id=-1)
    with pytest.raises(DrafterFitError) as e:
        load_drafter(both, target)
    assert "hidden_size" in str(e.value) and "mask_token_id -1" in str(e.value)
    d = W("fc", taps=[1, 4, 6])  # fc sized for 3 taps, config then lists 2
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 4]
    (d / "config.json").write_text(json.dumps(cfg))
    _expect(DrafterFitError, r"fc.weight is \[128, 384\] but 2 tap layers x hidden 128 need \[128, 256\]", target, d)


def test_tensor_errors_name_the_tensors(target_dir, target, tmp_path):
    W = lambda name, **kw: D.write_tiny_drafter(tmp_path / name, target_dir, **kw)  # noqa: E731
    _expect(CheckpointError, r"missing tensors \(1\): layers\.1\.mlp\.up_proj\.weight", target,
            W("a", drop=["layers.1.mlp.up_proj.weight"]))
    _expect(CheckpointError, r"unexpected tensors \(1\): layers\.0\.self_attn\.q_proj\.bias", target,
            W("b", extra={"layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)}))
    _expect(CheckpointError, r"wrong shapes \(1\): layers\.0\.self_attn\.k_norm\.weight \[16\] \(expected \[32\]\)",
            target, W("c", extra={"layers.0.self_attn.k_norm.weight": np.ones(16, np.float32)}))


def test_config_errors(target_dir):
    base = D.drafter_config(target_dir)
    bad = [
        (dict(architectures=["DFlash2DraftModel"]), "DFlash2"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "no sliding_window"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "rope_type 'llama3'"),
        (dict(model_type="llama"), "model_type 'llama'"),
        (dict(dflash_config={"target_layer_ids": [1, 5]}), "mask_token_id"),
    ]
    for edit, match in bad:
        with pytest.raises(ConfigError, match=match):
            parse_dflash_config({**base, **edit})


# -------------------------------------------------------------------------------------- (e)
def test_default_tap_rule():
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Qwen3.5-4B / 9B drafters
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # 27B
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]  # 35B-A3B
    assert default_target_layer_ids(8, 1) == [4]
    for n, k in ((8, 2), (8, 3), (48, 5), (94, 7)):
        assert default_target_layer_ids(n, k) == D.default_taps(n, k)


def test_config_fallbacks(target_dir, target, tmp_path):
    d = D.write_tiny_drafter(tmp_path / "rule", target_dir, num_layers=3, write_taps=False)
    assert "target_layer_ids" not in json.loads((d / "config.json").read_text())["dflash_config"]
    assert load_drafter(d, target).tap_layers == (1, 3, 5)  # rule(8 target layers, 3 drafter layers)
    cfg = D.drafter_config(target_dir, write_taps=False, num_target_layers=None)
    assert parse_dflash_config(cfg, num_target_layers=32).target_layer_ids == (1, 29)
    with pytest.raises(ConfigError, match="default tap rule"):
        parse_dflash_config(cfg)
    # block size: dflash_config wins over the top level; rope theta from rope_parameters
    cfg = D.drafter_config(target_dir, block_size=8, rope_theta=None, rope_parameters={"rope_theta": 1e7})
    cfg["block_size"] = 16
    c = parse_dflash_config(cfg)
    assert (c.block_size, c.rope_theta, c.rope_scaling) == (8, 1e7, None)
    # causality: explicit is_causal > dflash_config.causal > sliding => causal
    lt = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert parse_dflash_config(D.drafter_config(target_dir, **lt)).causal == (True, False)
    cfg = D.drafter_config(target_dir, **lt)
    cfg["dflash_config"]["causal"] = False
    assert parse_dflash_config(cfg).causal == (False, False)
    assert parse_dflash_config({**cfg, "is_causal": True}).causal == (True, True)


def first_draft_logits(drafters, target_dir, target, ids, anchor) -> list[np.ndarray]:
    """Each drafter's logits for its first draft after the context of `ids` (HF taps) at position P."""
    feat = mx.array(hf_taps(target_dir, ids, drafters[0].tap_layers), dtype=mx.float32)
    outs = []
    for dr in drafters:
        dc = fresh_cache(dr, target)
        dr.write_context(feat, layout([0], [P], [TABLE]), dc)
        outs.append(np.array(draft_one(dr, dc, anchor, P, TABLE, 8)[1][0]))
    return outs


def test_quantize_at_load(target_dir, target, prompt, tmp_path):
    ids, anchor = prompt
    d = D.write_tiny_drafter(tmp_path / "q", target_dir, seed=6)
    fp, q8 = load_drafter(d, target), load_drafter(d, target, quantize="8bit")
    assert q8.fc.quantized and q8.ctx_kv.quantized and q8.layers[1].kv_proj.bits == 8
    outs = first_draft_logits((fp, q8), target_dir, target, ids, anchor)
    assert rel_err(outs[1], outs[0]) <= 0.05


def test_prequantized_mixed_bits_checkpoint(target_dir, target, prompt, tmp_path):
    """An mlx-style quantized drafter (config `quantization` + per-module override): k_proj of layer 0 at
    4 bits cannot share the stacked context GEMM, so its layer projects k and v apart."""
    ids, anchor = prompt
    d = D.write_tiny_drafter(tmp_path / "f", target_dir, seed=9)
    w = mx.load(str(d / "model.safetensors"))
    odd = "layers.0.self_attn.k_proj"
    q = {}
    for k, v in w.items():
        if "norm" in k:
            q[k] = v
            continue
        m = k[: -len(".weight")]
        q[k], q[f"{m}.scales"], q[f"{m}.biases"] = mx.quantize(v, group_size=64, bits=4 if m == odd else 8)
    qd = tmp_path / "q"
    qd.mkdir()
    mx.save_safetensors(str(qd / "model.safetensors"), q)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 8, odd: {"group_size": 64, "bits": 4}}
    (qd / "config.json").write_text(json.dumps(cfg))
    fp, qm = load_drafter(d, target), load_drafter(qd, target)
    assert qm.ctx_kv is None and qm.layers[0].kv_proj is None and qm.layers[1].kv_proj.bits == 8
    outs = first_draft_logits((fp, qm), target_dir, target, ids, anchor)
    assert rel_err(outs[1], outs[0]) <= 0.1
    with pytest.raises(ConfigError, match="already quantized"):
        load_drafter(qd, target, quantize="4bit")
