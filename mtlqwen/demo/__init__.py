"""The demo pair shipped with the package: a small Qwen3.5 target trained on the CPython standard library
and its DFlash drafter (training/README.md says how they were made). Used when no --model is given.

Layout of a pair directory (the package's own is `mtlqwen/demo/pair/`):
  target/    an mtlqwen-loadable checkpoint (mlx 8-bit conversion) with its tokenizer files
  drafter/   a DFlash drafter in the published layout (8-bit)
  demo.json  what was recorded at export: held-out loss of `heldout.txt`, its window, acceptance length
  heldout.txt  text of held-out stdlib files (never trained on)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..model.builtin import ByteTokenizer, random_model
from ..model.qwen35 import Qwen35Model

PAIR_DIR = Path(__file__).resolve().parent / "pair"
LOSS_WINDOW = 512  # tokens per held-out window (each scored from a fresh state, as in training)
# The pair's drafts a step by default: its acceptance hardly grows past 3 (tau 1.64 at 3, 1.70 at 15 on
# held-out text) while each draft costs verification rows (benchmarks/demo_pair.md, "Draft length")
DEMO_N_DRAFT = 3


class DemoPairMissing(FileNotFoundError):
    """The package was built without the trained demo pair."""


@dataclass
class DemoPair:
    model: object  # Qwen35Model
    tokenizer: object  # mtlqwen.tokenizer.Tokenizer
    drafter: object  # Drafter
    record: dict
    path: Path

    @property
    def heldout_text(self) -> str:
        return (self.path / "heldout.txt").read_text(encoding="utf-8")


def pair_dir(path: str | Path | None = None) -> Path:
    """The pair directory to use: `path`, else the packaged one; DemoPairMissing when it is not there."""
    d = Path(path) if path is not None else PAIR_DIR
    need = [d / "target" / "config.json", d / "drafter" / "config.json", d / "demo.json"]
    missing = [str(p.relative_to(d)) for p in need if not p.is_file()]
    if missing:
        raise DemoPairMissing(f"no trained demo pair at {d} (missing {', '.join(missing)}); "
                              "see training/README.md to train and install one, or pass --model")
    return d


def _dequantize(weights: dict, config, fp32: bool = False):
    """(dense weights, their config): quantized modules back to bf16; fp32: every float tensor in fp32."""
    import mlx.core as mx  # noqa: PLC0415

    from ..model.quantize import dense_config, dequantize_weights  # noqa: PLC0415

    out = dequantize_weights(weights, config, mx.float32 if fp32 else mx.bfloat16, cast_all=fp32)
    mx.eval(out)
    return out, dense_config(config)


def _load_target(d: Path, dequantize: bool, fp32: bool = False):
    from ..model import load  # noqa: PLC0415
    from ..model.config import load_config  # noqa: PLC0415
    from ..model.loading import _internal_overrides, read_safetensors  # noqa: PLC0415
    from ..model.quantize import validate_quant  # noqa: PLC0415
    from ..model.weights import check_weights, sanitize  # noqa: PLC0415

    if not dequantize:
        return load(d)
    config = load_config(d)
    _internal_overrides(config)
    weights = sanitize(read_safetensors(d), config)
    if config.quantization is not None:
        validate_quant(config, weights)
    check_weights(weights, config)
    if config.quantization is not None:
        weights, config = _dequantize(weights, config, fp32)
    return Qwen35Model(config, weights)


def _load_drafter(d: Path, target, dequantize: bool, fp32: bool = False):
    import mlx.core as mx  # noqa: PLC0415

    from ..model.config import read_config_json  # noqa: PLC0415
    from ..model.dflash import Drafter, check_drafter_weights, check_fit, load_drafter  # noqa: PLC0415
    from ..model.dflash_config import parse_dflash_config  # noqa: PLC0415
    from ..model.loading import read_safetensors  # noqa: PLC0415
    from ..model.quantize import validate_quant  # noqa: PLC0415

    if not dequantize:
        return load_drafter(d, target)
    config = parse_dflash_config(read_config_json(d, "a DFlash drafter directory"), target.config.num_hidden_layers)
    weights = read_safetensors(d)
    if config.quantization is not None:
        validate_quant(config, weights)
        weights, config = _dequantize(weights, config, fp32)
    check_fit(config, weights, target.config)
    check_drafter_weights(weights, config)
    weights = {k: v.astype(mx.float32) if k.endswith("norm.weight") else v for k, v in weights.items()}
    return Drafter(config, weights, target)


def load_demo_pair(path: str | Path | None = None, dequantize: bool = True, fp32: bool = False) -> DemoPair:
    """Target, tokenizer and drafter of the demo pair (the packaged one unless `path` is given).

    The pair is stored 8-bit to stay small; dequantize=True (default) runs it in bf16 instead, because at
    this size memory is no concern and the CPU reference's quantized matmul is ~8x slower than a float one
    (the values multiplied are the same). fp32=True runs it in fp32: bf16 logits of even a trained model
    tie within one rounding step every few hundred tokens, so exact comparisons across schedules use fp32."""
    from .. import load_tokenizer  # noqa: PLC0415

    d = pair_dir(path)
    if fp32 and not dequantize:
        raise ValueError("fp32=True needs dequantize=True (the quantized matmul runs in the activations' dtype)")
    model = _load_target(d / "target", dequantize, fp32)
    model.source = "built-in demo model (trained on the Python standard library)"
    drafter = _load_drafter(d / "drafter", model, dequantize, fp32)
    drafter.source = "built-in demo drafter"
    drafter.default_n_draft = DEMO_N_DRAFT
    record = json.loads((d / "demo.json").read_text())
    return DemoPair(model, load_tokenizer(d / "target"), drafter, record, d)


def heldout_loss(model, token_ids: list[int], window: int = LOSS_WINDOW) -> tuple[float, int]:
    """(mean next-token NLL in nats, tokens scored) over consecutive windows of `window` tokens, each
    run from an empty cache; a final partial window of >= 2 tokens counts too."""
    import mlx.core as mx  # noqa: PLC0415

    from ..kernels import SeqLayout  # noqa: PLC0415

    block = 128
    total, n = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        ids = token_ids[start : start + window]
        if len(ids) < 2:
            break
        nblocks = math.ceil(len(ids) / block)
        cache = model.make_cache(num_blocks=nblocks, num_slots=1, block_tokens=block)
        layout = SeqLayout([0, len(ids)], [0], [list(range(nblocks))], [0], block)
        logits = model.forward(mx.array(ids, dtype=mx.int32), layout, cache).astype(mx.float32)
        logp = logits[:-1] - mx.logsumexp(logits[:-1], axis=-1, keepdims=True)
        nll = -mx.take_along_axis(logp, mx.array(ids[1:], dtype=mx.int32)[:, None], axis=-1)
        total += float(mx.sum(nll))
        n += len(ids) - 1
    if n == 0:
        raise ValueError("held-out loss needs at least 2 tokens")
    return total / n, n


# What a front end runs when no checkpoint is named (the demo pair stands above the model package).
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
    try:
        pair = load_demo_pair(pair_path)
    except DemoPairMissing as e:
        return BuiltinModel(random_model(), ByteTokenizer(), None, f"No --model given and {e}; {random_note}")
    note = ("No --model given: running the built-in demo model (a small Qwen3.5 trained on the Python "
            "standard library) with its DFlash drafter. Pass --model for a real checkpoint.")
    return BuiltinModel(pair.model, pair.tokenizer, pair.drafter, note)
