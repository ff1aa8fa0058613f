"""Tiny random DFlash drafters in the published layout (dflash.md §2), for the tiny Qwen3.5 targets of
hf_checkpoints.py. A plain helper module: tests import it explicitly. Nothing is downloaded.

Written by `write_tiny_drafter`:
  config.json        Qwen3-style (model_type qwen3, architectures ["DFlashDraftModel"]) + nested dflash_config
  model.safetensors  one unprefixed file: fc, hidden_norm, norm, layers.{i}.* (no embed_tokens, no lm_head)
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_DIM, DRAFT_INTERMEDIATE = 4, 2, 32, 192  # head_dim != target's 64


def default_taps(num_target_layers: int, k: int) -> list[int]:
    """§1.2's rule, restated here so the fixture does not depend on the code under test."""
    if k == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k)]


def _target_text_config(target) -> dict:
    if isinstance(target, dict):
        return target.get("text_config") or target
    cfg = json.loads((pathlib.Path(target) / "config.json").read_text())
    return cfg.get("text_config") or cfg


def drafter_config(target, *, num_layers=2, taps=None, block_size=16, mask_token_id=511, write_taps=True,
                   hidden_size=None, **overrides) -> dict:
    """The config.json body. `overrides` set top-level fields (layer_types, sliding_window, is_causal,
    rope_parameters, ...); a value of None removes the field."""
    t = _target_text_config(target)
    n_target = int(t["num_hidden_layers"])
    taps = list(taps) if taps is not None else default_taps(n_target, num_layers)
    dfl = {"mask_token_id": mask_token_id, "block_size": block_size}
    if write_taps:
        dfl["target_layer_ids"] = taps
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": hidden_size or int(t["hidden_size"]),
        "num_hidden_layers": num_layers,
        "num_attention_heads": DRAFT_HEADS,
        "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": DRAFT_HEAD_DIM,
        "intermediate_size": DRAFT_INTERMEDIATE,
        "hidden_act": "silu",
        "vocab_size": int(t["vocab_size"]),
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "block_size": block_size,
        "num_target_layers": n_target,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
        "dflash_config": dfl,
    }
    for k, v in overrides.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def drafter_tensors(cfg: dict, num_taps: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights: norms 1 + N(0, 0.1^2) (plain Qwen3 norms sit near 1), linears N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    nH, nKV, hd, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]

    def lin(out_f, in_f):
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": lin(H, num_taps * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(L):
        p = f"layers.{i}"
        w.update({
            f"{p}.input_layernorm.weight": norm(H), f"{p}.post_attention_layernorm.weight": norm(H),
            f"{p}.self_attn.q_proj.weight": lin(nH * hd, H), f"{p}.self_attn.k_proj.weight": lin(nKV * hd, H),
            f"{p}.self_attn.v_proj.weight": lin(nKV * hd, H), f"{p}.self_attn.o_proj.weight": lin(H, nH * hd),
            f"{p}.self_attn.q_norm.weight": norm(hd), f"{p}.self_attn.k_norm.weight": norm(hd),
            f"{p}.mlp.gate_proj.weight": lin(I, H), f"{p}.mlp.up_proj.weight": lin(I, H),
            f"{p}.mlp.down_proj.weight": lin(H, I),
        })
    return w


def write_tiny_drafter(dest, target_dir_or_config, num_layers: int = 2, taps=None, block_size: int = 16,
                       mask_token_id: int = 511, seed: int = 0, *, write_taps: bool = True, hidden_size=None,
                       drop=(), extra=None, **overrides) -> pathlib.Path:
    """Write a tiny random drafter for the target at `target_dir_or_config` (a checkpoint dir or its
    config dict) into dest and return dest. taps=None uses §1.2's rule with k = num_layers;
    write_taps=False leaves `target_layer_ids` out of the config (the loader must apply the rule).
    drop / extra remove or add tensors (for loading-error tests); overrides edit config fields."""
    from safetensors.numpy import save_file

    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = drafter_config(target_dir_or_config, num_layers=num_layers, taps=taps, block_size=block_size,
                         mask_token_id=mask_token_id, write_taps=write_taps, hidden_size=hidden_size, **overrides)
    n_taps = len(taps) if taps is not None else num_layers
    w = drafter_tensors(cfg, n_taps, seed)
    for k in drop:
        del w[k]
    w.update(extra or {})
    save_file(w, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dest
