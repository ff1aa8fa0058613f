"""The models that need no --model: the trained demo pair shipped in the package (mtlqwen.demo), and
random-weight Qwen3.5 models built in memory (`--model random`, tests, and real-size shapes such as
Qwen3.5-9B at 4-bit for benchmarks when real weights cannot be downloaded)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import mlx.core as mx

from .config import QuantSpec, Qwen35Config, parse_config
from .quantize import ROUTER, quantizable
from .qwen35 import Qwen35Model
from .weights import expected_shapes

BYTE_VOCAB = 512  # 256 byte tokens + specials + padding
BYTE_EOS = 256


def demo_config() -> Qwen35Config:
    """A small model with every Qwen3.5 feature (r = 2 head grouping, dk != dv, 3:1 interleave)."""
    return parse_config({
        "model_type": "qwen3_5_text", "vocab_size": BYTE_VOCAB, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 48,
        "linear_conv_kernel_dim": 4, "max_position_embeddings": 8192, "eos_token_id": BYTE_EOS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    })


def qwen35_9b_config() -> Qwen35Config:
    """Qwen3.5-9B geometry (docs/qwen35.md §1.3)."""
    return parse_config({
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "tie_word_embeddings": False, "eos_token_id": 248044,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    })


def random_weights(config: Qwen35Config, seed: int = 0, dtype=mx.bfloat16, quantize: QuantSpec | None = None):
    """Weights in the internal naming: linears N(0, 1/fan_in), embeddings N(0, 1), norms near 1,
    gates in their checkpoint ranges. Each tensor is quantized as soon as it exists (low peak memory)."""
    out: dict[str, mx.array] = {}
    overrides: dict[str, QuantSpec | None] = {}
    for i, (name, shape) in enumerate(sorted(expected_shapes(config).items())):
        k = mx.random.key(seed * 1_000_003 + i)
        if name.endswith("A_log"):
            w = mx.log(mx.random.uniform(1.0, 16.0, shape, key=k))
        elif name.endswith("dt_bias"):
            w = 0.5 * mx.random.normal(shape, key=k)
        elif len(shape) == 1:  # norms (stored with +1 folded in)
            w = 1.0 + 0.1 * mx.random.normal(shape, key=k)
        elif name.endswith("conv1d.weight"):
            w = (mx.random.normal(shape, key=k) / shape[-1] ** 0.5).astype(dtype)
        elif "embed_tokens" in name:
            w = mx.random.normal(shape, key=k).astype(dtype)
        else:
            w = (mx.random.normal(shape, key=k) / shape[-1] ** 0.5).astype(dtype)
        if name.endswith(("A_log", "dt_bias")) or len(shape) == 1:
            w = w.astype(mx.float32)
        module = name[: -len(".weight")]
        if quantize is not None and quantizable(name, w, quantize.group_size):
            spec = QuantSpec(8, quantize.group_size) if ROUTER.search(module) else quantize
            if spec != quantize:
                overrides[module] = spec
            q, s, b = mx.quantize(w, group_size=spec.group_size, bits=spec.bits)
            out[name], out[f"{module}.scales"], out[f"{module}.biases"] = q, s, b
        else:
            out[name] = w
        mx.eval(*[out[n] for n in out if n.startswith(module)])
    if quantize is not None:
        config.quantization, config.quant_overrides = quantize, overrides
    return out


def random_model(
    config: Qwen35Config | None = None, seed: int = 0, dtype=mx.bfloat16, quantize: QuantSpec | None = None
) -> Qwen35Model:
    """A model with random weights (the demo model when `config` is None)."""
    config = config or demo_config()
    model = Qwen35Model(config, random_weights(config, seed, dtype, quantize))
    model.source = "built-in random weights"
    return model


RANDOM_MODEL = "random"  # the --model name of the random-weight demo model


@dataclass
class BuiltinModel:
    """What a front end runs when no checkpoint is named: model, tokenizer, the drafter to speculate
    with (None for random weights) and a note for the user."""

    model: Qwen35Model
    tokenizer: object
    drafter: object | None
    note: str


def is_builtin(name) -> bool:
    """Whether a --model value names a built-in model (absent, or "random") rather than a checkpoint."""
    return name is None or name == RANDOM_MODEL


def load_builtin(name: str | None = None, pair_path=None) -> BuiltinModel:
    """name None: the trained demo pair (its DFlash drafter included) when the package has it, else the
    random model with a note saying why; name "random": the random-weight model with the byte tokenizer.
    pair_path: a demo-pair directory to use instead of the packaged one (mtlqwen.demo's layout)."""
    if not is_builtin(name):
        raise ValueError(f"{name!r} is not a built-in model (None or {RANDOM_MODEL!r})")
    random_note = ("running the small built-in Qwen3.5 model with RANDOM weights (its text is meaningless; "
                   "it shows the engine works). Pass --model for a real checkpoint.")
    if name == RANDOM_MODEL:
        return BuiltinModel(random_model(), ByteTokenizer(), None, "--model random: " + random_note)
    from ..demo import DemoPairMissing, load_demo_pair  # noqa: PLC0415

    try:
        pair = load_demo_pair(pair_path)
    except DemoPairMissing as e:
        return BuiltinModel(random_model(), ByteTokenizer(), None, f"No --model given and {e}; {random_note}")
    note = ("No --model given: running the built-in demo model (a small Qwen3.5 trained on the Python "
            "standard library) with its DFlash drafter. Pass --model for a real checkpoint.")
    return BuiltinModel(pair.model, pair.tokenizer, pair.drafter, note)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, id 256 as end of text: the demo model's tokenizer."""

    eos_token_ids = {BYTE_EOS}
    vocab_size = BYTE_VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> "_ByteStream":
        return _ByteStream()


class _ByteStream:
    """Holds back bytes until they complete a UTF-8 character; invalid bytes become U+FFFD."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self.decoder.decode(bytes([token_id])) if token_id < 256 else ""

    def finish(self) -> str:
        return self.decoder.decode(b"", final=True)
