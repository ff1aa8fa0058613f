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

PAIR_DIR = Path(__file__).resolve().parent / "pair"
LOSS_WINDOW = 512  # tokens per held-out window (each scored from a fresh state, as in training)


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


def load_demo_pair(path: str | Path | None = None) -> DemoPair:
    """Target, tokenizer and drafter of the demo pair (the packaged one unless `path` is given)."""
    from .. import load, load_drafter, load_tokenizer  # noqa: PLC0415

    d = pair_dir(path)
    model = load(d / "target")
    model.source = "built-in demo model (trained on the Python standard library)"
    drafter = load_drafter(d / "drafter", model)
    drafter.source = "built-in demo drafter"
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
