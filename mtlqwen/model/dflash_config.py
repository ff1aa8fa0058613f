"""DFlash drafter configuration (dflash.md §1, §2.1), parsed from the drafter's own config.json.

The drafter is a small Qwen3-style transformer (top-level fields as in a Qwen3 config) with a nested
`dflash_config` that names its tap layers and mask token. Everything the engine needs about the drafter
(tap layers, block size, mask id, per-layer masking) is read from here, never assumed (§5.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .config import ConfigError, QuantSpec, _parse_quant

LAYER_TYPES = ("full_attention", "sliding_attention")


class DrafterFitError(ConfigError):
    """A drafter that does not fit the target it is loaded for; the message names every misfit."""


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The reference's fallback when `target_layer_ids` is absent (§1.2): `num_taps` layers spread evenly
    from layer 1 to layer N - 3; a single tap takes the middle layer. Python's round() (half to even) is
    the reference's rounding, so e.g. N=32, k=5 gives [1, 8, 15, 22, 29]."""
    if num_taps < 1:
        raise ConfigError("a drafter needs at least one tap layer")
    if num_taps == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    vocab_size: int = 0  # informational: the drafter reads the target's embedding and head
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = plain RoPE; {"rope_type": "yarn", ...} otherwise
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    causal: tuple[bool, ...] = ()  # per drafter layer: causal inside the block (§1.5)
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    quantization: QuantSpec | None = None
    quant_overrides: dict[str, QuantSpec | None] = field(default_factory=dict)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """Keys at distance >= window are masked for a sliding layer; None = sees every key."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def parse_dflash_config(raw: dict[str, Any], num_target_layers: int | None = None) -> DFlashConfig:
    """config.json dict -> DFlashConfig. `num_target_layers` (the target's layer count) is used for the
    tap fallback only when the config has neither `target_layer_ids` nor `num_target_layers`."""
    archs = raw.get("architectures") or []
    dfl = dict(raw.get("dflash_config") or {})
    if any("DFlash2" in a for a in archs) or int(dfl.get("conv_kernel_size", 0) or 0) > 0:
        # DFlash2 adds grouped convolutions and a candidate selector (§2.2): a different body.
        raise ConfigError("DFlash2 drafters (grouped convs + candidate selector) are not supported; "
                          "mtlqwen runs DFlash (v1) drafters")
    if raw.get("model_type") not in (None, "qwen3"):
        raise ConfigError(f"drafter model_type {raw.get('model_type')!r} is not supported; DFlash drafters "
                          "for Qwen targets are Qwen3-style (model_type 'qwen3')")
    if not dfl and "DFlashDraftModel" not in archs:
        raise ConfigError("config.json is not a DFlash drafter: no 'dflash_config' and architectures "
                          f"{archs} lacks 'DFlashDraftModel'")
    missing = [k for k in _REQUIRED if k not in raw]
    if "mask_token_id" not in dfl and "mask_token_id" not in raw:
        missing.append("dflash_config.mask_token_id")
    if missing:
        raise ConfigError(f"drafter config.json lacks required fields: {', '.join(missing)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"drafter hidden_act {raw['hidden_act']!r} is not supported (SwiGLU/silu only)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError("drafters with attention/MLP biases are not supported (published drafters have none)")

    n = int(raw["num_hidden_layers"])
    nH, nKV = int(raw["num_attention_heads"]), int(raw["num_key_value_heads"])
    H = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or H // nH)
    if nH % nKV:
        raise ConfigError(f"drafter num_attention_heads {nH} is not a multiple of num_key_value_heads {nKV}")

    n_target = raw.get("num_target_layers")
    n_target = int(n_target) if n_target is not None else None
    taps = dfl.get("target_layer_ids", raw.get("target_layer_ids"))
    if taps is None:
        # The reference couples the tap count to the drafter's layer count when the list is absent.
        n_rule = n_target if n_target is not None else num_target_layers
        if n_rule is None:
            raise ConfigError("drafter config has no dflash_config.target_layer_ids and no num_target_layers; "
                              "pass the target's layer count to apply the default tap rule")
        taps = default_target_layer_ids(n_rule, n)
    taps = tuple(int(t) for t in taps)
    if not taps:
        raise ConfigError("dflash_config.target_layer_ids is empty")

    layer_types = tuple(raw.get("layer_types") or ("full_attention",) * n)
    if len(layer_types) != n:
        raise ConfigError(f"drafter layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"unknown drafter layer types {unknown}; expected {' / '.join(LAYER_TYPES)}")
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise ConfigError("drafter has sliding_attention layers but no sliding_window")
    # Causality inside the block (§1.5, the newer reference): explicit is_causal > dflash_config.causal >
    # "sliding layers are causal, full-attention layers are not".
    explicit = raw.get("is_causal", dfl.get("causal"))
    causal = tuple(bool(explicit) if explicit is not None else t == "sliding_attention" for t in layer_types)

    theta, scaling = _parse_rope(raw, head_dim)
    quant, overrides = _parse_quant(raw.get("quantization") or raw.get("quantization_config"))
    softcap = dfl.get("final_logit_softcapping", raw.get("final_logit_softcapping"))
    return DFlashConfig(
        hidden_size=H,
        num_hidden_layers=n,
        num_attention_heads=nH,
        num_key_value_heads=nKV,
        head_dim=head_dim,
        intermediate_size=int(raw["intermediate_size"]),
        target_layer_ids=taps,
        mask_token_id=int(dfl.get("mask_token_id", raw.get("mask_token_id"))),
        block_size=int(dfl.get("block_size", raw.get("block_size", 16))),
        vocab_size=int(raw.get("vocab_size", 0) or 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        causal=causal,
        num_target_layers=n_target,
        input_embedding_scale=float(dfl.get("input_embedding_scale", 1.0)),
        output_multiplier=float(dfl.get("output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
        quantization=quant,
        quant_overrides=overrides,
    )


def _parse_rope(raw: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling). transformers v5 folds theta and scaling into `rope_parameters`; older configs
    keep `rope_theta` and `rope_scaling` at the top level. Only plain and YaRN RoPE are supported."""
    rope = dict(raw.get("rope_parameters") or {})
    rope.update(raw.get("rope_scaling") or {})
    theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("drafter partial_rotary_factor != 1 is not supported (DFlash drafters rotate all dims)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ConfigError(f"drafter rope_type {kind!r} is not supported (default and yarn are)")
    if "factor" not in rope:
        raise ConfigError("drafter yarn rope_scaling lacks 'factor'")
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = "yarn"
    scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 32768))
    return theta, scaling


def rope_frequencies(config: DFlashConfig) -> tuple[mx.array, float]:
    """(inv_freq [head_dim / 2] fp32, attention factor). Plain RoPE: theta^(-2i/d), factor 1.
    YaRN (the Qwen3.6-27B drafter, §1.6): low frequencies interpolated by `factor`, high ones kept, with a
    linear ramp between the dims that turn beta_fast and beta_slow times over the original context; cos and
    sin are scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    d = config.head_dim
    exponents = [2 * i / d for i in range(d // 2)]
    base = [config.rope_theta**e for e in exponents]  # per-frequency wavelength / 2pi
    s = config.rope_scaling
    if s is None:
        return mx.array([1.0 / b for b in base], dtype=mx.float32), 1.0
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_for(rotations: float) -> float:  # the dim index whose frequency turns `rotations` times in `orig`
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

    lo, hi = dim_for(float(s.get("beta_fast") or 32)), dim_for(float(s.get("beta_slow") or 1))
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    inv = []
    for i, b in enumerate(base):
        keep = 1.0 - min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 1: extrapolate (keep), 0: interpolate
        inv.append((1.0 / (factor * b)) * (1 - keep) + (1.0 / b) * keep)
    return mx.array(inv, dtype=mx.float32), float(attn)
