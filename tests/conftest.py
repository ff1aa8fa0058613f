"""Fixtures shared by the runtime tests: one tiny random Qwen3.5 checkpoint (official layout) per run."""

from __future__ import annotations

import pytest

import mtlqwen
from hf_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """Dense, untied, r = 3, 8 layers, vocab 512 (eos 508 / 510). Modules may override the name."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def model(ckpt):
    return mtlqwen.load(ckpt)
