"""MLX affine quantization of a float checkpoint (at load or by `mtlqwen convert`).

Quantized: every projection, the embedding and the head, experts included, whose input width divides
by the group size. Kept float: norms, conv weights, `A_log` (fp32), `dt_bias`. MoE routers and the
shared-expert gate stay at 8 bits (their outputs pick experts; mlx-lm does the same).
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx

from .config import ConfigError, QuantSpec, Qwen35Config

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
ROUTER = re.compile(r"\.mlp\.(gate|shared_expert_gate)$")


def parse_quantize_arg(q) -> QuantSpec:
    """'4bit' | '8bit' | '4bit-g32' | 4 | (bits, group) | QuantSpec -> QuantSpec (group 64 by default)."""
    if isinstance(q, QuantSpec):
        spec = q
    elif isinstance(q, int):
        spec = QuantSpec(q, 64)
    elif isinstance(q, (tuple, list)) and len(q) == 2:
        spec = QuantSpec(int(q[0]), int(q[1]))
    elif isinstance(q, str):
        m = re.fullmatch(r"(\d+)\s*-?bits?(?:[-_ ]?g(?:roup)?(\d+))?", q.strip().lower())
        if not m:
            raise ConfigError(f"quantize={q!r} not understood; use '4bit', '8bit' or e.g. '4bit-g32'")
        spec = QuantSpec(int(m.group(1)), int(m.group(2) or 64))
    else:
        raise ConfigError(f"quantize={q!r} not understood; use '4bit', '8bit' or (bits, group_size)")
    _check_spec(spec, "quantize=")
    return spec


def _check_spec(spec: QuantSpec, where: str) -> None:
    if spec.mode != "affine" or spec.bits not in SUPPORTED_BITS or spec.group_size not in SUPPORTED_GROUPS:
        raise ConfigError(
            f"unsupported quantization {spec.mode} {spec.bits}-bit g{spec.group_size} ({where}); "
            f"mtlqwen supports affine {'/'.join(map(str, SUPPORTED_BITS))}-bit with groups "
            f"{'/'.join(map(str, SUPPORTED_GROUPS))}"
        )


def validate_quant(config: Qwen35Config, weights: dict[str, mx.array]) -> None:
    """A quantized checkpoint must say how (config `quantization`) and use a supported scheme."""
    if config.quantization is None:
        raise ConfigError("checkpoint has quantized tensors (*.scales) but config.json has no 'quantization' field")
    _check_spec(config.quantization, "config.json quantization")
    for module, spec in config.quant_overrides.items():
        if spec is not None and f"{module}.scales" in weights:
            _check_spec(spec, f"override for {module}")


def quantizable(name: str, w: mx.array, group_size: int) -> bool:
    if not name.endswith(".weight") or w.ndim < 2:
        return False
    if "norm" in name or "conv1d" in name:
        return False
    return w.shape[-1] % group_size == 0


def quantize_weights(weights: dict[str, mx.array], config: Qwen35Config, spec: QuantSpec) -> dict[str, mx.array]:
    """Quantize every eligible module; records the scheme (and router overrides) in `config`."""
    out: dict[str, mx.array] = {}
    overrides: dict[str, QuantSpec | None] = {}
    for name in list(weights):
        w = weights.pop(name)  # drop our reference so each float tensor is freed once quantized
        module = name[: -len(".weight")]
        if not quantizable(name, w, spec.group_size):
            out[name] = w
            continue
        mspec = QuantSpec(8, spec.group_size) if ROUTER.search(module) else spec
        if mspec != spec:
            overrides[module] = mspec
        q, s, b = mx.quantize(w, group_size=mspec.group_size, bits=mspec.bits)
        mx.eval(q, s, b)  # one module at a time keeps peak memory near the weights' size
        out[name], out[f"{module}.scales"], out[f"{module}.biases"] = q, s, b
    config.quantization = spec
    config.quant_overrides = overrides
    return out


def dequantize_weights(weights: dict[str, mx.array], config, dtype=None, cast_all: bool = False) -> dict[str, mx.array]:
    """quantize_weights undone: each quantized module's packed weight, scales and biases become one dense
    weight (mx.dequantize: the values the quantized matmul multiplies by), in `dtype` (None: the scales').
    cast_all: every other float tensor in `dtype` too. `config` (a Qwen35Config or DFlashConfig) names
    each module's bits and group size; pair the result with dense_config(config)."""
    out = {}
    for name, w in weights.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{module}.weight" in weights:
            continue
        if f"{module}.scales" in weights:
            spec = config.quant_overrides.get(module, config.quantization)
            w = mx.dequantize(w, weights[f"{module}.scales"], weights[f"{module}.biases"],
                              group_size=spec.group_size, bits=spec.bits)
            w = w if dtype is None else w.astype(dtype)
        elif cast_all and dtype is not None and mx.issubdtype(w.dtype, mx.floating):
            w = w.astype(dtype)
        out[name] = w
    return out


def dense_config(config):
    """A copy of `config` describing float weights (no quantization, no per-module overrides)."""
    return dataclasses.replace(config, quantization=None, quant_overrides={})
