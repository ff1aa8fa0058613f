"""Random-weight Qwen3.5 models built in memory (`--model random`, tests, and real-size shapes such as
Qwen3.5-9B at 4-bit for benchmarks when real weights cannot be downloaded) and the byte tokenizer they use.
The trained demo pair, and the choice between it and these, live in mtlqwen.demo."""

from __future__ import annotations

import codecs

import mlx.core as mx

from .config import QuantSpec, Qwen35Config, parse_config
from .quantize import ROUTER, quantizable
from .qwen35 import Qwen35Model
from .loading import rank_model
from .sharding import Shard, check_split, shard_weights
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


def qwen35_35b_a3b_config() -> Qwen35Config:
    """Qwen3.5-35B-A3B geometry (docs/qwen35.md §1.3, read from its published config.json): 40 layers
    (30 GDN / 10 attention), 256 experts of which 8 routed per token plus one shared expert."""
    return parse_config({
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
        "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False, "eos_token_id": 248044,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    })


def qwen35_122b_a10b_config() -> Qwen35Config:
    """Qwen3.5-122B-A10B geometry (docs/qwen35.md §1.3, from training-framework configs: high confidence, not
    read from its config.json): 48 layers (36 GDN / 12 attention), 256 experts, top-8, Im = Is = 1024."""
    return parse_config({
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 3072,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
        "tie_word_embeddings": False, "eos_token_id": 248044,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    })


SHAPES = {"9b": qwen35_9b_config, "35b-a3b": qwen35_35b_a3b_config, "122b-a10b": qwen35_122b_a10b_config,
          "demo": demo_config}


def random_weights(config: Qwen35Config, seed: int = 0, dtype=mx.bfloat16, quantize: QuantSpec | None = None,
                   shard: Shard | None = None):
    """Weights in the internal naming: linears N(0, 1/fan_in), embeddings N(0, 1), norms near 1,
    gates in their checkpoint ranges. Each tensor is quantized as soon as it exists (low peak memory).
    shard: keep only that rank's slice of each tensor, cut as soon as the tensor exists, so a model that
    needs several devices' memory is built without ever holding it whole (every rank draws the same values)."""
    if shard is not None:
        check_split(config, shard.size)
    if quantize is not None:  # before the loop: shard_weights reads each module's spec from the config
        config.quantization, config.quant_overrides = quantize, {}
    overrides = config.quant_overrides if quantize is not None else {}
    out: dict[str, mx.array] = {}
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
            made = {name: q, f"{module}.scales": s, f"{module}.biases": b}
        else:
            made = {name: w}
        if shard is not None:
            made = shard_weights(made, config, shard)
        mx.eval(*made.values())
        out.update(made)
    return out


def random_model(
    config: Qwen35Config | None = None, seed: int = 0, dtype=mx.bfloat16, quantize: QuantSpec | None = None,
    group=None,
) -> Qwen35Model:
    """A model with random weights (the demo model when `config` is None). group: an mx.distributed group of
    2+ ranks: this rank's tensor-parallel shard of that model, built a tensor at a time."""
    config = config or demo_config()
    if group is None or group.size() == 1:
        model = Qwen35Model(config, random_weights(config, seed, dtype, quantize))
    else:
        model = rank_model(config, random_weights(config, seed, dtype, quantize, Shard(group.rank(), group.size())),
                           group)
    model.source = "built-in random weights"
    return model


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

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""


class _ByteStream:
    """Holds back bytes until they complete a UTF-8 character; invalid bytes become U+FFFD."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self.decoder.decode(bytes([token_id])) if token_id < 256 else ""

    def finish(self) -> str:
        return self.decoder.decode(b"", final=True)
