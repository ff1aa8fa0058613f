"""`mtlqwen convert SRC DST [--quantize 4bit]`: write an MLX-format checkpoint (mlx-lm's layout).

The output uses mlx-lm's names (`language_model.model.*`, `language_model.lm_head.*`), conv weights
[C, K, 1], norms with +1 folded in, and the `quantization` block in config.json, so mlx-lm and mtlqwen
both load it; it loads back to the same logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from .loading import load_model_dir, resolve_model_path

SHARD_BYTES = 5 * 1024**3  # mlx-lm's shard size
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "special_tokens_map.json", "vocab.json", "merges.txt")


def _external(name: str, w: mx.array) -> tuple[str, mx.array]:
    if name.endswith("conv1d.weight"):
        w = w[:, :, None]  # [C, K] -> [C, K, 1]
    return "language_model." + name, w


def _shards(weights: dict[str, mx.array]) -> list[dict[str, mx.array]]:
    shards, cur, size = [], {}, 0
    for k, v in weights.items():
        if cur and size + v.nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + v.nbytes
    if cur:
        shards.append(cur)
    return shards


def convert(src, dst, quantize=None, progress=None) -> Path:
    """Load `src` (directory or repo id), optionally quantize, and write an MLX checkpoint to `dst`.
    progress: called as progress(stage, done_bytes, total_bytes), stage "loading" then "writing"."""
    src_dir = resolve_model_path(src)
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty; choose a new output directory")
    stage = (lambda name: (lambda done, total: progress(name, done, total))) if progress else (lambda name: None)
    model = load_model_dir(src_dir, quantize=quantize, progress=stage("loading"))
    c = model.config
    dst.mkdir(parents=True, exist_ok=True)
    weights = dict(_external(k, v) for k, v in model.weights.items())
    shards = _shards(weights)
    n = len(shards)
    total = sum(v.nbytes for v in weights.values())
    weight_map, written = {}, 0
    report = stage("writing")
    if report:
        report(0, total)
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(dst / fname), shard, metadata={"format": "mlx"})
        weight_map.update({k: fname for k in shard})
        written += sum(v.nbytes for v in shard.values())
        if report:
            report(written, total)
    if n > 1:
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    raw = json.loads((src_dir / "config.json").read_text())
    if c.quantization is not None:
        q = {"group_size": c.quantization.group_size, "bits": c.quantization.bits, "mode": "affine"}
        for module, spec in c.quant_overrides.items():
            q["language_model." + module] = (
                {"group_size": spec.group_size, "bits": spec.bits} if spec is not None else False
            )
        raw["quantization"] = raw["quantization_config"] = q
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    for f in COPIED:
        if (src_dir / f).is_file():
            shutil.copy2(src_dir / f, dst / f)
    return dst
