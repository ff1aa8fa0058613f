"""A checkpoint for testing what the terminal front-ends print: every greedy token is either the BEL
control byte or the special token <|reserved_3|>. A plain helper module (not a conftest)."""

from __future__ import annotations

import pathlib

import mlx.core as mx

from frontend_fixtures import VOCAB, write_tiny_chat_checkpoint

BEL, RESERVED = 7, VOCAB - 2  # byte 0x07 and <|reserved_3|>


def write_noisy_checkpoint(dest: pathlib.Path) -> pathlib.Path:
    """The tiny chat checkpoint with an lm_head of two non-zero rows, w for <|reserved_3|> and -w for
    BEL: every greedy token is one of the two (whichever side of w the hidden state is on)."""
    path = write_tiny_chat_checkpoint(dest, eos_reachable=False)
    f = str(path / "model.safetensors")
    w = mx.load(f)
    head = mx.zeros_like(w["language_model.lm_head.weight"])
    row = mx.random.normal((head.shape[1],), key=mx.random.key(3))
    head[RESERVED] = row
    head[BEL] = -row
    w["language_model.lm_head.weight"] = head
    mx.save_safetensors(f, w, metadata={"format": "mlx"})
    return path
