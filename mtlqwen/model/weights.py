"""Checkpoint tensors -> mtlqwen's internal names and conventions, and the shape contract they must meet.

Two layouts reach us (docs/qwen35.md §5): official Hugging Face checkpoints
(`model.language_model.*`, raw zero-centred norms, conv [C, 1, K], fused MoE experts, `mtp.*` and
vision tensors) and mlx-lm / mlx-community conversions (`language_model.model.*`, norms already +1,
conv [C, K, 1], `switch_mlp.*`, maybe quantized). Internally: `model.*` / `lm_head.*`, conv [C, K],
+1 folded in fp32 and kept fp32 for norms, `A_log` / `dt_bias` fp32.
"""

from __future__ import annotations

import re

import mlx.core as mx

from .config import Qwen35Config

IGNORED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.")
ZERO_CENTRED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$|^model\.norm\.weight$")
FP32_TENSORS = re.compile(r"(A_log|dt_bias|linear_attn\.norm\.weight)$")


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit its config; the message names the tensors."""


def _rename(name: str) -> str | None:
    """Map a checkpoint key to the internal name; None for tensors we deliberately ignore."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    elif name.startswith("language_model."):
        name = name[len("language_model.") :]
    if name.startswith(IGNORED_PREFIXES):
        return None
    return name


def is_raw_hf(weights: dict[str, mx.array]) -> bool:
    """mlx-lm's rule: a conv weight whose last dim is not 1 means raw HF tensors (§5.2)."""
    return any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())


def sanitize(raw: dict[str, mx.array], config: Qwen35Config) -> dict[str, mx.array]:
    """Rename, drop ignored tensors and apply the raw-HF transforms (lazily: nothing is evaluated here)."""
    renamed: dict[str, mx.array] = {}
    for k, v in raw.items():
        name = _rename(k)
        if name is not None:
            renamed[name] = v
    raw_hf = is_raw_hf(renamed)
    out: dict[str, mx.array] = {}
    for k, v in renamed.items():
        if k.endswith("conv1d.weight"):
            v = v[:, 0, :] if raw_hf else v[:, :, 0]  # [C, 1, K] or [C, K, 1] -> [C, K]
        elif ZERO_CENTRED.search(k):
            v = v.astype(mx.float32) + 1.0 if raw_hf else v.astype(mx.float32)
        elif FP32_TENSORS.search(k):
            v = v.astype(mx.float32)
        if k.endswith("mlp.experts.gate_up_proj"):  # fused [E, 2*Im, H]: gate rows first
            im = v.shape[1] // 2
            base = k[: -len("experts.gate_up_proj")]
            out[base + "switch_mlp.gate_proj.weight"] = v[:, :im, :]
            out[base + "switch_mlp.up_proj.weight"] = v[:, im:, :]
            continue
        if k.endswith("mlp.experts.down_proj"):
            out[k[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = v
            continue
        out[k] = v
    _stack_per_expert(out, config)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _stack_per_expert(w: dict[str, mx.array], config: Qwen35Config) -> None:
    """transformers also accepts per-expert keys `experts.{e}.{gate,up,down}_proj.weight`: stack them."""
    pat = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    for k in list(w):
        m = pat.match(k)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = w.pop(k)
    for (base, proj), experts in groups.items():
        if sorted(experts) != list(range(config.num_experts)):
            raise CheckpointError(f"{base}.experts has {len(experts)} of {config.num_experts} experts for {proj}")
        w[f"{base}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(config.num_experts)])


def expected_shapes(c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Every float tensor the decoder needs, with its internal shape."""
    H = c.hidden_size
    s: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, H),
        "model.norm.weight": (H,),
    }
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.vocab_size, H)
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}"
        s[f"{p}.input_layernorm.weight"] = (H,)
        s[f"{p}.post_attention_layernorm.weight"] = (H,)
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            Hv = c.linear_num_value_heads
            s.update({
                f"{a}.in_proj_qkv.weight": (c.conv_dim, H),
                f"{a}.in_proj_z.weight": (c.value_dim, H),
                f"{a}.in_proj_b.weight": (Hv, H),
                f"{a}.in_proj_a.weight": (Hv, H),
                f"{a}.conv1d.weight": (c.conv_dim, c.linear_conv_kernel_dim),
                f"{a}.dt_bias": (Hv,),
                f"{a}.A_log": (Hv,),
                f"{a}.norm.weight": (c.linear_value_head_dim,),
                f"{a}.out_proj.weight": (H, c.value_dim),
            })
        else:
            a = f"{p}.self_attn"
            nH, nKV, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            s.update({
                f"{a}.q_proj.weight": (2 * nH * hd, H),
                f"{a}.k_proj.weight": (nKV * hd, H),
                f"{a}.v_proj.weight": (nKV * hd, H),
                f"{a}.o_proj.weight": (H, nH * hd),
                f"{a}.q_norm.weight": (hd,),
                f"{a}.k_norm.weight": (hd,),
            })
        m = f"{p}.mlp"
        if c.is_moe:
            E, Im, Is = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            s.update({
                f"{m}.gate.weight": (E, H),
                f"{m}.switch_mlp.gate_proj.weight": (E, Im, H),
                f"{m}.switch_mlp.up_proj.weight": (E, Im, H),
                f"{m}.switch_mlp.down_proj.weight": (E, H, Im),
                f"{m}.shared_expert.gate_proj.weight": (Is, H),
                f"{m}.shared_expert.up_proj.weight": (Is, H),
                f"{m}.shared_expert.down_proj.weight": (H, Is),
                f"{m}.shared_expert_gate.weight": (1, H),
            })
        else:
            s.update({
                f"{m}.gate_proj.weight": (c.intermediate_size, H),
                f"{m}.up_proj.weight": (c.intermediate_size, H),
                f"{m}.down_proj.weight": (H, c.intermediate_size),
            })
    return s


def check_weights(w: dict[str, mx.array], c: Qwen35Config) -> None:
    """Raise CheckpointError naming missing, unexpected or mis-shaped tensors (quantized ones included)."""
    want = expected_shapes(c)
    missing = sorted(k for k in want if k not in w)
    quant_modules = {k[: -len(".scales")] for k in w if k.endswith(".scales")}
    allowed_extra = {f"{m}.{s}" for m in quant_modules for s in ("scales", "biases")}
    extra = sorted(k for k in w if k not in want and k not in allowed_extra)
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:12])}" + (" ..." if len(missing) > 12 else ""))
    if extra:
        problems.append(f"unexpected tensors ({len(extra)}): {', '.join(extra[:12])}" + (" ..." if len(extra) > 12 else ""))
    bad = []
    for k, shape in want.items():
        if k not in w:
            continue
        module = k[: -len(".weight")] if k.endswith(".weight") else None
        if module in quant_modules:
            spec = c.quant_overrides.get(module, c.quantization)
            if spec is None:
                problems.append(f"{module} is quantized but config.json has no quantization entry for it")
                continue
            exp = (*shape[:-1], shape[-1] * spec.bits // 32)
            exp_s = (*shape[:-1], shape[-1] // spec.group_size)
            got_s = tuple(w[f"{module}.scales"].shape)
            if got_s != exp_s:
                bad.append(f"{module}.scales {got_s} (expected {exp_s} for {spec.bits}-bit g{spec.group_size})")
        else:
            exp = shape
        if tuple(w[k].shape) != exp:
            bad.append(f"{k} {tuple(w[k].shape)} (expected {exp})")
    if bad:
        problems.append("wrong shapes: " + "; ".join(bad[:12]) + (" ..." if len(bad) > 12 else ""))
    if problems:
        raise CheckpointError("checkpoint does not match its config.json: " + " | ".join(problems))
