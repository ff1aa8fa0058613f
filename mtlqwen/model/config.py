"""Qwen3.5 configuration parsed from a Hugging Face `config.json`.

Published checkpoints are vision-language: the decoder fields sit under `text_config`. A text-only
config keeps them at the top level. Both are accepted (docs/qwen35.md §1.1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class ConfigError(ValueError):
    """A config.json that does not describe a supported Qwen3.5 decoder."""


@dataclass(frozen=True)
class QuantSpec:
    """MLX affine quantization of one module: `w = scales * q + biases` per group of `group_size`."""

    bits: int
    group_size: int
    mode: str = "affine"


@dataclass
class Qwen35Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: list[str]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    intermediate_size: int = 0
    # MoE fields (every layer is MoE when set)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    # quantization: the default spec plus per-module overrides keyed by our module path
    quantization: QuantSpec | None = None
    quant_overrides: dict[str, QuantSpec | None] = field(default_factory=dict)

    # ---- derived geometry (names follow docs/qwen35.md's notation)
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gdn_ratio(self) -> int:
        """r = Hv / Hk: value head j reads key head j // r."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def to_text_dict(self) -> dict[str, Any]:
        """A text-only config.json body that parses back to this config."""
        d: dict[str, Any] = {
            "model_type": "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        else:
            d["intermediate_size"] = self.intermediate_size
        return d


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _layer_types(text: dict[str, Any], n: int) -> list[str]:
    types = text.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}")
        bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise ConfigError(f"unknown layer types {bad}; expected linear_attention / full_attention")
        return list(types)
    interval = int(text.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _parse_quant(q: dict[str, Any] | None) -> tuple[QuantSpec | None, dict[str, QuantSpec | None]]:
    if not q:
        return None, {}
    mode = q.get("mode", "affine")
    default = QuantSpec(int(q.get("bits", 4)), int(q.get("group_size", 64)), mode)
    overrides: dict[str, QuantSpec | None] = {}
    for key, val in q.items():
        if isinstance(val, dict):
            overrides[key] = QuantSpec(
                int(val.get("bits", default.bits)),
                int(val.get("group_size", default.group_size)),
                val.get("mode", mode),
            )
        elif isinstance(val, bool):
            overrides[key] = default if val else None
    return default, overrides


def parse_config(raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> Qwen35Config:
    """Build a `Qwen35Config` from a parsed config.json (and optionally generation_config.json)."""
    top_type = raw.get("model_type")
    if top_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type {top_type!r} is not supported; mtlqwen runs Qwen3.5-family decoders "
            f"with model_type one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    text = raw.get("text_config") or raw
    text_type = text.get("model_type", top_type)
    if text_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"text_config.model_type {text_type!r} is not a Qwen3.5 decoder")
    missing = [k for k in _REQUIRED if k not in text]
    if missing:
        raise ConfigError(f"config.json lacks required decoder fields: {', '.join(missing)}")

    rope = dict(text.get("rope_parameters") or raw.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only default rotary embeddings)")
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    theta = rope.get("rope_theta", text.get("rope_theta", 1e7))

    n = int(text["num_hidden_layers"])
    is_moe = text_type in MOE_MODEL_TYPES or top_type in MOE_MODEL_TYPES
    # tie_word_embeddings appears at both levels; the decoder's own value wins (as mlx-lm reads it)
    tied = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    eos = _as_id_list(text.get("eos_token_id", raw.get("eos_token_id")))
    if generation_config:
        eos += [e for e in _as_id_list(generation_config.get("eos_token_id")) if e not in eos]
    quant, overrides = _parse_quant(raw.get("quantization") or raw.get("quantization_config"))
    if quant is not None and quant.mode != "affine":
        raise ConfigError(f"quantization mode {quant.mode!r} is not supported; mtlqwen reads MLX affine 4/8-bit")

    cfg = Qwen35Config(
        model_type=text_type,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=n,
        num_attention_heads=int(text["num_attention_heads"]),
        num_key_value_heads=int(text["num_key_value_heads"]),
        head_dim=int(text.get("head_dim", 256)),
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]),
        linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        layer_types=_layer_types(text, n),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        partial_rotary_factor=float(partial),
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        tie_word_embeddings=bool(tied),
        intermediate_size=int(text.get("intermediate_size", 0) or 0),
        num_experts=int(text.get("num_experts", 0) or 0) if is_moe else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
        eos_token_ids=eos,
        quantization=quant,
        quant_overrides=overrides,
    )
    _validate(cfg)
    return cfg


def _validate(cfg: Qwen35Config) -> None:
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.is_moe and (cfg.num_experts_per_tok <= 0 or cfg.moe_intermediate_size <= 0):
        raise ConfigError("MoE config needs num_experts_per_tok and moe_intermediate_size")
    if not cfg.is_moe and cfg.intermediate_size <= 0:
        raise ConfigError("dense config needs intermediate_size")
    if cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim:
        raise ConfigError(f"rotary dims {cfg.rotary_dim} must be even and at most head_dim {cfg.head_dim}")


def read_config_json(model_dir: Path, what: str = "a Hugging Face checkpoint directory") -> dict[str, Any]:
    """config.json of a checkpoint directory, with one-line errors for a missing or broken file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; is it {what}?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def load_config(model_dir: Path) -> Qwen35Config:
    """Read config.json (+ generation_config.json when present) from a checkpoint directory."""
    raw = read_config_json(model_dir)
    gen_path = Path(model_dir) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_config(raw, gen)
