"""Geometry and hyper-parameters of the demo pair (target + DFlash drafter), full and smoke sizes.

One place for the shapes: train_target.py, train_drafter.py and the exporters all read them from here,
and each run records the values it used in its log JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .tokenizer import SPECIALS

ENDOFTEXT, IM_START, IM_END, MASK = (SPECIALS.index(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"))


def target_text_config(vocab_size: int, smoke: bool = False) -> dict:
    """Qwen3_5TextConfig kwargs: GDN 3:1 gated attention (layers 3 and 7 are full attention)."""
    if smoke:
        hidden, layers, inter, heads, lin_v = 64, 4, 128, 2, 2
    else:
        hidden, layers, inter, heads, lin_v = 384, 8, 1024, 6, 6
    return dict(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=lin_v, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
        eos_token_id=[IM_END, ENDOFTEXT], bos_token_id=None, pad_token_id=ENDOFTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    )


@dataclass
class TargetHParams:
    seq_len: int = 1024  # the demo generates prompt + a few hundred tokens: train at that context
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    # The cosine schedule needs a length; the wall-clock budget stops training, so the schedule is
    # stretched to the steps the budget allows, estimated from the measured step time after warm-up.
    max_steps: int = 100_000
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def smoke_target_hparams() -> TargetHParams:
    return TargetHParams(seq_len=64, batch_size=4, lr=3e-3, warmup_steps=2, max_steps=6)


def drafter_config(target: dict, smoke: bool = False) -> dict:
    """The DFlash drafter's config.json body (published layout, dflash.md §2.1)."""
    n_target = target["num_hidden_layers"]
    layers = 1 if smoke else 2
    taps = [1, n_target - 2] if smoke else [1, 3, 5]  # §1.2's rule for 8 layers, 3 taps
    block = 8 if smoke else 16
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": target["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": target["intermediate_size"] if smoke else 768,
        "hidden_act": "silu",
        "vocab_size": target["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "rope_scaling": None,
        "max_position_embeddings": target["max_position_embeddings"],
        "block_size": block,
        "num_target_layers": n_target,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": taps, "block_size": block},
    }


@dataclass
class DrafterHParams:
    seq_len: int = 512
    batch_size: int = 32
    anchors_per_seq: int = 32  # blocks drafted per training sequence (random committed prefixes)
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.05
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    # Later slots matter less: a draft is only useful when every earlier one was accepted
    # (DFlash's decaying per-position loss weight w_j = exp(-(j - 1) / gamma)).
    decay_gamma: float = 7.0
    # Loss = soft cross-entropy to the target's distribution at that position (what verification checks)
    # mixed with the data token's cross-entropy.
    hard_weight: float = 0.1
    max_steps: int = 100_000
    seed: int = 1

    def as_dict(self) -> dict:
        return asdict(self)


def smoke_drafter_hparams() -> DrafterHParams:
    return DrafterHParams(seq_len=64, batch_size=2, anchors_per_seq=4, warmup_steps=2, max_steps=4)


def override(hp, assignments: list[str]):
    """hp with NAME=VALUE assignments applied (values parsed as the field's type)."""
    types = {f.name: type(getattr(hp, f.name)) for f in fields(hp)}
    changes = {}
    for a in assignments:
        name, sep, value = a.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"--set {a!r}: expected NAME=VALUE with NAME one of {', '.join(types)}")
        if types[name] is tuple:
            raise SystemExit(f"--set {name}: tuples cannot be overridden")
        changes[name] = types[name](value)
    return replace(hp, **changes)
