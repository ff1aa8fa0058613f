"""`mtlqwen.load`: a local directory or Hugging Face repo id -> a `Qwen35Model`."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .config import ConfigError, QuantSpec, Qwen35Config, load_config
from .qwen35 import Qwen35Model
from .distributed import check_same_checkpoint, checkpoint_fingerprint
from .sharding import Shard, check_split, shard_config, shard_weights
from .quantize import parse_quantize_arg, quantize_weights, validate_quant
from .weights import CheckpointError, check_weights, sanitize

# What a model load needs from a repo (mlx-lm fetches the same kinds of files)
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken"]


def resolve_model_path(path_or_repo: str | Path, allow_patterns: list[str] | None = None) -> Path:
    """A local directory as is; anything else is taken as a Hugging Face repo id and downloaded."""
    p = Path(path_or_repo).expanduser()
    if p.is_dir():
        return p
    s = str(path_or_repo)
    if p.exists():
        raise FileNotFoundError(f"{s} is a file, not a checkpoint directory")
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise FileNotFoundError(f"no checkpoint directory at {s} (and it is not a Hugging Face repo id)")
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        return Path(snapshot_download(s, allow_patterns=allow_patterns or ALLOW_PATTERNS))
    except Exception as e:  # network, auth, missing repo: one clear line instead of a traceback
        raise FileNotFoundError(f"could not find {s} locally or download it from Hugging Face: {type(e).__name__}: {e}") from None


def read_safetensors(model_dir: Path) -> dict[str, mx.array]:
    """All tensors of the checkpoint's safetensors files, loaded lazily by MLX (no copy until used)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors files")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        absent = sorted(f for f in listed if not (model_dir / f).is_file())
        if absent:
            raise CheckpointError(f"{index.name} lists shards that are missing: {', '.join(absent)}")
        files = [model_dir / f for f in sorted(listed)]
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise CheckpointError(f"cannot read {f.name}: {e}") from None
    return weights


def _internal_overrides(config: Qwen35Config) -> None:
    """Per-module quantization keys are full module paths in mlx-lm's naming; map them to ours."""
    fixed: dict[str, QuantSpec | None] = {}
    for k, v in config.quant_overrides.items():
        if k.startswith("language_model."):
            k = k[len("language_model.") :]
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model.") :]
        fixed[k] = v
    config.quant_overrides = fixed


EVAL_CHUNK_BYTES = 256 * 1024**2  # tensors materialised per mx.eval: a progress update every ~256 MiB


def evaluate(weights: dict[str, mx.array], progress=None) -> None:
    """mx.eval the (lazily loaded) tensors; with `progress`, in chunks, calling progress(done_bytes,
    total_bytes) after each. Dict order keeps the halves of a split tensor in the same chunk."""
    if progress is None:
        mx.eval(weights)
        return
    total = sum(v.nbytes for v in weights.values())
    done, chunk, size = 0, [], 0
    progress(0, total)
    for v in weights.values():
        chunk.append(v)
        size += v.nbytes
        if size >= EVAL_CHUNK_BYTES:
            mx.eval(chunk)
            done, chunk, size = done + size, [], 0
            progress(done, total)
    if chunk:
        mx.eval(chunk)
        progress(total, total)


def load_model_dir(model_dir: Path, quantize=None, progress=None, group=None) -> Qwen35Model:
    if group is not None and group.size() > 1:  # before any tensor is read: a mismatch fails fast
        check_same_checkpoint(checkpoint_fingerprint(model_dir, f"quantize={quantize!r}"), group)
        check_split(load_config(model_dir), group.size())  # after: every rank reaches the collective
    config = load_config(model_dir)
    _internal_overrides(config)
    weights = sanitize(read_safetensors(model_dir), config)
    if config.quantization is not None or any(k.endswith(".scales") for k in weights):
        validate_quant(config, weights)
    check_weights(weights, config)
    if quantize is not None:
        if config.quantization is not None:
            raise ConfigError("this checkpoint is already quantized; load it without quantize=")
        weights = quantize_weights(weights, config, parse_quantize_arg(quantize))
    if group is None or group.size() == 1:
        evaluate(weights, progress)
        return Qwen35Model(config, weights)
    # this rank's shard only: the lazily read full tensors are dropped once their slices are evaluated
    return shard_model(config, weights, group, progress)


def shard_model(config: Qwen35Config, weights: dict[str, mx.array], group, progress=None) -> Qwen35Model:
    """The rank's Qwen35Model of a whole model (config + weights, e.g. `model.config, model.weights`)."""
    weights = shard_weights(weights, config, Shard(group.rank(), group.size()))
    evaluate(weights, progress)
    return rank_model(config, weights, group)


def rank_model(config: Qwen35Config, rank_weights: dict[str, mx.array], group) -> Qwen35Model:
    """The Qwen35Model of one rank from the whole model's config and that rank's tensors (already cut)."""
    return Qwen35Model(shard_config(config, group.size()), rank_weights, group=group, full_config=config)


def load(path_or_repo: str | Path, quantize=None, progress=None, group=None) -> Qwen35Model:
    """Load a Qwen3.5 / 3.6 checkpoint: official Hugging Face layout or an mlx-lm conversion (possibly
    quantized). `quantize="4bit"` / `"8bit"` / `(bits, group_size)` quantizes a float checkpoint at load.
    progress: called as progress(done_bytes, total_bytes) while the tensors are read (see `evaluate`).
    group: an mx.distributed group (e.g. `mx.distributed.init()`) for tensor parallelism: this rank loads
    and keeps only its shard (sharding.py); every rank must call it with the same checkpoint."""
    model = load_model_dir(resolve_model_path(path_or_repo), quantize=quantize, progress=progress, group=group)
    model.source = str(path_or_repo)
    return model
