"""Token streams of the corpus for training: documents joined by <|endoftext|>, random windows per step.

The train stream's document order is a seeded shuffle; the held-out stream keeps file order and holds
source files only (chat samples are all in train), so its loss is a property of the weights alone.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from .corpus import CORPUS, read_corpus
from .pair_config import ENDOFTEXT
from .tokenizer import OUT as TOKENIZER_DIR, render_chat


def _stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(ENDOFTEXT)
    return np.asarray(ids, dtype=np.int32)


DOC_SHUFFLE_SEED = 0  # the train stream's document order (both stages read the same stream)


def load_streams(cache: Path | None = None, tokenizer_dir: Path = TOKENIZER_DIR, corpus: Path = CORPUS,
                 limit_docs: int | None = None) -> dict:
    """{"train": int32 [N], "heldout": int32 [M], "corpus_sha256": ..., "docs": {...}}. limit_docs keeps
    the first documents of each split (smoke runs). `cache`: an .npz written on first use and read after
    (tokenizing the corpus takes a while; the drafter stage reuses the target stage's streams)."""
    if cache is not None and Path(cache).is_file():
        z = np.load(cache)
        return {"train": z["train"], "heldout": z["heldout"], "corpus_sha256": str(z["corpus_sha256"]),
                "docs": json.loads(str(z["docs"]))}
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    records = read_corpus(corpus)
    train = [r["text"] if r["kind"] == "file" else render_chat(r["messages"]) for r in records if r["split"] == "train"]
    held = [r["text"] for r in records if r["split"] == "heldout" and r["kind"] == "file"]
    random.Random(DOC_SHUFFLE_SEED).shuffle(train)
    if limit_docs is not None:
        train, held = train[:limit_docs], held[: max(1, limit_docs // 8)]
    out = {
        "train": _stream(tok, train),
        "heldout": _stream(tok, held),
        "corpus_sha256": hashlib.sha256(Path(corpus).read_bytes()).hexdigest(),
        "docs": {"train": len(train), "heldout": len(held)},
    }
    if cache is not None:
        np.savez(cache, train=out["train"], heldout=out["heldout"], corpus_sha256=out["corpus_sha256"],
                 docs=json.dumps(out["docs"]))
    return out


class WindowSampler:
    """Batches of random windows [B, T + 1] of a stream (inputs x[:, :-1], next tokens x[:, 1:])."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(stream) <= seq_len + 1:
            raise ValueError(f"stream of {len(stream)} tokens is too short for windows of {seq_len + 1}")
        self.stream = torch.from_numpy(stream.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.stream) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        return torch.stack([self.stream[s : s + self.seq_len + 1] for s in starts.tolist()])


def heldout_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Consecutive non-overlapping windows [W, T + 1] from the start of the held-out stream (fixed set)."""
    n = max(1, min(max_tokens, len(stream) - 1) // seq_len)
    t = torch.from_numpy(stream.astype(np.int64))
    return torch.stack([t[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
