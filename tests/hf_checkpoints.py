"""Tiny random Qwen3.5 checkpoints in the official HF layout, plus HF reference logits.

A plain helper module (not a conftest): tests import it explicitly. Everything here runs on CPU with
transformers + torch; nothing is downloaded. See docs/qwen35.md §5 and §8.

Layout written by `write_tiny_checkpoint` (as in the published checkpoints):
  config.json                     model_type qwen3_5 / qwen3_5_moe, decoder fields under text_config
  generation_config.json          eos ids
  model-0000k-of-0000N.safetensors (N >= 2) + model.safetensors.index.json
  keys: model.language_model.*, model.visual.*, lm_head.weight (absent when tied), mtp.* (fake MTP block)
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np


# Special ids of the tiny models, at the top of the tiny vocabulary. They mirror the real ones
# (text_config.eos_token_id = <|endoftext|>; generation_config eos = [<|im_end|>, <|endoftext|>]).
def tiny_special_ids(vocab_size: int = 512) -> dict:
    endoftext = vocab_size - 4
    return {"endoftext": endoftext, "im_start": endoftext + 1, "im_end": endoftext + 2}


TINY_HIDDEN = 128
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,  # must be a square: the vision tower resamples a square grid
)


def random_token_ids(n: int, vocab_size: int = 512, seed: int = 0) -> list[int]:
    """n token ids uniform in [0, vocab_size), deterministic from seed."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, size=n)]


def _text_config_kwargs(*, moe: bool, tied: bool, r: int, num_layers: int, vocab_size: int) -> dict:
    if r < 1:
        raise ValueError("r (value heads per key head) must be >= 1")
    ids = tiny_special_ids(vocab_size)
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=TINY_HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2 * r,
        linear_key_head_dim=32,
        linear_value_head_dim=48,  # dk != dv catches layout mistakes
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
        eos_token_id=ids["endoftext"],
        # Always explicit: class defaults differ from the checkpoints. mrope_section sums to
        # head_dim * partial_rotary_factor / 2 = 8 rotary frequencies.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    )
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        kw.update(intermediate_size=256)
    return kw


def _randomise_text(text_model, lm_head, seed: int) -> None:
    """Overwrite HF's init (zero norms, dt_bias 1, std-0.02 linears) with §8's distributions.

    Draws from one numpy generator over the text model's parameters in module order, so the VL and the
    text-only checkpoint with the same arguments and seed carry identical decoder weights.
    """
    import torch

    rng = np.random.default_rng(seed)

    def set_(p, arr):
        with torch.no_grad():
            p.copy_(torch.from_numpy(np.asarray(arr, dtype=np.float64)).to(p.dtype))

    for name, p in text_model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            # log U(1, 16): HF's init goes down to log(0.01); a narrower, known range shows randomisation
            set_(p, np.log(rng.uniform(1.0, 16.0, size=shape)))
        elif name.endswith("dt_bias"):
            set_(p, 0.5 * rng.standard_normal(shape))
        elif name.endswith("linear_attn.norm.weight"):
            # gated RMSNorm uses a plain weight (not zero-centred), so centre it at 1
            set_(p, 1.0 + 0.2 * rng.standard_normal(shape))
        elif name.endswith("norm.weight"):
            # zero-centred norms (input/post-attention, q/k, final): stored w, applied as (1 + w)
            set_(p, 0.2 * rng.standard_normal(shape))
        elif name.endswith("embed_tokens.weight"):
            set_(p, rng.standard_normal(shape))
        elif p.ndim >= 2:
            # Linears [out, in], fused experts [E, out, in], depthwise conv [C, 1, K]: fan_in is the
            # product of all dims after the output one (K for the conv).
            fan_in = int(np.prod(shape[-1:] if p.ndim == 3 and "experts" in name else shape[1:]))
            set_(p, rng.standard_normal(shape) / np.sqrt(fan_in))
        else:
            raise AssertionError(f"no randomisation rule for {name} {shape}")
    if lm_head is not None:
        set_(lm_head.weight, rng.standard_normal(tuple(lm_head.weight.shape)) / np.sqrt(lm_head.weight.shape[1]))


def _fake_mtp_tensors(hidden: int, seed: int, dtype) -> dict:
    """A small stand-in for the real MTP block; loaders must ignore every `mtp.*` key."""
    import torch

    rng = np.random.default_rng(seed + 1_000_003)
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 0.2).to(dtype)  # noqa: E731
    return {
        "mtp.fc.weight": t(hidden, 2 * hidden),
        "mtp.norm.weight": t(hidden),
        "mtp.pre_fc_norm_embedding.weight": t(hidden),
        "mtp.pre_fc_norm_hidden.weight": t(hidden),
        "mtp.layers.0.input_layernorm.weight": t(hidden),
    }


def _cast_for_save(model, dtype: str) -> None:
    """float32 as built; bfloat16 casts everything except A_log, which real checkpoints keep in fp32."""
    import torch

    if dtype == "float32":
        return
    if dtype != "bfloat16":
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    a_logs = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("A_log")}
    model.to(torch.bfloat16)
    params = dict(model.named_parameters())
    for n, v in a_logs.items():
        params[n].data = v  # Module.to() has no per-parameter exceptions, so restore after the cast


def _save_sharded(model, dest: pathlib.Path, *, seed: int, extra_tensors: bool, dtype: str,
                  fused_experts: bool) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # A limit around a third of the model gives a few shards and an index json, like real checkpoints.
    # save_original_format=True (the default) reverts transformers' load-time conversions, which for MoE
    # means per-expert `experts.{e}.{gate,up,down}_proj.weight`; the official Qwen3.5 files hold the fused
    # `experts.gate_up_proj` / `experts.down_proj` that the in-memory model already uses.
    model.save_pretrained(dest, max_shard_size=max(total // 3, 1), save_original_format=not fused_experts)

    index_path = dest / "model.safetensors.index.json"
    if not index_path.exists():  # single-file save: wrap it in an index so the layout is always sharded
        (dest / "model.safetensors").rename(dest / "model-00001-of-00001.safetensors")
        keys = load_file(dest / "model-00001-of-00001.safetensors").keys()
        index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in keys}}
    else:
        index = json.loads(index_path.read_text())

    if extra_tensors:
        # Append the fake MTP block to the last shard, as real checkpoints keep mtp.* in ordinary shards.
        last = sorted(set(index["weight_map"].values()))[-1]
        tensors = load_file(dest / last)
        mtp = _fake_mtp_tensors(model.config.get_text_config().hidden_size, seed,
                                torch.float32 if dtype == "float32" else torch.bfloat16)
        tensors.update(mtp)
        save_file(tensors, dest / last, metadata={"format": "pt"})
        index["weight_map"].update({k: last for k in mtp})

    total_size = 0
    for shard in sorted(set(index["weight_map"].values())):
        for v in load_file(dest / shard).values():
            total_size += v.numel() * v.element_size()
    index.setdefault("metadata", {})["total_size"] = total_size
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def _finish_configs(dest: pathlib.Path, *, extra_tensors: bool, text_only: bool, vocab_size: int) -> None:
    ids = tiny_special_ids(vocab_size)
    cfg_path = dest / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg if text_only else cfg["text_config"]
    if extra_tensors:
        # Real text configs announce the MTP block; transformers ignores these fields.
        text["mtp_num_hidden_layers"] = 1
        text["mtp_use_dedicated_embeddings"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    # transformers writes a generation_config.json without eos ids for a config built in code.
    gen_path = dest / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen.update(
        bos_token_id=ids["endoftext"],
        eos_token_id=[ids["im_end"], ids["endoftext"]],
        pad_token_id=ids["endoftext"],
    )
    gen_path.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _build(dest, *, moe, tied, r, num_layers, seed, vocab_size, extra_tensors, dtype, fused_experts, text_only):
    import torch
    import transformers as tf

    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    text_kw = _text_config_kwargs(moe=moe, tied=tied, r=r, num_layers=num_layers, vocab_size=vocab_size)
    TextConfig = tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig
    text_cfg = TextConfig(**text_kw)

    # fork_rng: HF draws A_log and the vision init from torch's global RNG; seed it without leaking.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if text_only:
            Model = tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM
            model = Model(text_cfg)
            text_model = model.model
        else:
            Config = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
            VisionConfig = tf.Qwen3_5MoeVisionConfig if moe else tf.Qwen3_5VisionConfig
            Model = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
            cfg = Config(
                text_config=text_cfg,
                vision_config=VisionConfig(out_hidden_size=TINY_HIDDEN, **TINY_VISION),
                tie_word_embeddings=tied,  # stored at top level and in text_config, as real configs do
            )
            model = Model(cfg)
            text_model = model.model.language_model
    model.eval()

    embed = text_model.embed_tokens.weight
    if tied:
        assert model.lm_head.weight is embed, "transformers did not tie lm_head to embed_tokens"
    _randomise_text(text_model, None if tied else model.lm_head, seed)
    _cast_for_save(model, dtype)
    _save_sharded(model, dest, seed=seed, extra_tensors=extra_tensors, dtype=dtype, fused_experts=fused_experts)
    _finish_configs(dest, extra_tensors=extra_tensors, text_only=text_only, vocab_size=vocab_size)
    return dest


def write_tiny_checkpoint(
    dest: pathlib.Path,
    *,
    moe: bool = False,
    tied: bool = False,
    r: int = 3,
    num_layers: int = 8,
    seed: int = 0,
    vocab_size: int = 512,
    extra_tensors: bool = True,
    dtype: str = "float32",
    fused_experts: bool = True,
    text_only: bool = False,
) -> pathlib.Path:
    """Write a tiny random Qwen3.5 (VL layout) checkpoint into dest and return dest.

    r = linear_num_value_heads / linear_num_key_heads (Hk = 2). dtype "float32" or "bfloat16";
    A_log stays float32 either way. extra_tensors adds a fake `mtp.*` block and MTP config fields.
    MoE experts are saved fused (`experts.gate_up_proj` [E, 2*Im, H], gate rows first, and
    `experts.down_proj` [E, H, Im]) as in the official files; fused_experts=False writes the per-expert
    `experts.{e}.{gate,up,down}_proj.weight` form that transformers also accepts. text_only: see
    write_tiny_text_only_checkpoint.
    """
    return _build(dest, moe=moe, tied=tied, r=r, num_layers=num_layers, seed=seed, vocab_size=vocab_size,
                  extra_tensors=extra_tensors, dtype=dtype, fused_experts=fused_experts, text_only=text_only)


def write_tiny_text_only_checkpoint(dest: pathlib.Path, **kw) -> pathlib.Path:
    """Same model as write_tiny_checkpoint (identical decoder weights for equal keyword arguments), saved by
    Qwen3_5ForCausalLM: text-only config (model_type qwen3_5_text / qwen3_5_moe_text, no text_config),
    keys `model.*` and `lm_head.weight`, no vision tower."""
    return write_tiny_checkpoint(dest, text_only=True, **kw)


# path -> (config.json mtime, model); loading costs ~1 s, forwards are cheap.
_HF_MODELS: dict = {}


def load_hf_model(dest: pathlib.Path):
    """Qwen3_5(Moe)ForCausalLM in float32, eager attention, CPU; raises if any weight was not loaded.

    Qwen3_5ForCausalLM loads the VL layout directly in this transformers version: it reads text_config,
    maps `model.language_model.*` -> `model.*` and ignores `model.visual.*` / `mtp.*` (checked in
    tests/test_hf_checkpoints.py).
    """
    import torch
    import transformers as tf

    dest = pathlib.Path(dest).resolve()
    stamp = os.stat(dest / "config.json").st_mtime_ns
    hit = _HF_MODELS.get(str(dest))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    model_type = json.loads((dest / "config.json").read_text())["model_type"]
    Model = tf.Qwen3_5MoeForCausalLM if model_type.startswith("qwen3_5_moe") else tf.Qwen3_5ForCausalLM
    model, info = Model.from_pretrained(
        dest, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"HF did not load every weight of {dest}: {info}")
    model.eval()
    _HF_MODELS[str(dest)] = (stamp, model)
    return model


def hf_reference_logits(dest: pathlib.Path, token_ids: list[int]) -> np.ndarray:
    """One-shot HF forward over token_ids (batch 1, no cache): logits [T, vocab] float32."""
    import torch

    model = load_hf_model(dest)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(token_ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy().copy()
