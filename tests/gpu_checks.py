"""Settings shared by the GPU kernel tests (they skip on CPU, whose back-end runs the references)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase

from mtlqwen.kernels import backend

# MTLQWEN_FAST_HYPOTHESIS=1 (device runs): a third of the examples and no shrinking, so a failure
# reports its first falsifying example quickly instead of recompiling kernels while shrinking.
FAST = os.environ.get("MTLQWEN_FAST_HYPOTHESIS", "0") == "1"
GPU_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate] if FAST else list(Phase))


def n_examples(n: int) -> int:
    return max(4, n // 3) if FAST else n


NEEDS_GPU = "needs a GPU back-end (Metal or CUDA); CPU runs the reference"
needs_gpu = pytest.mark.skipif(backend.gpu_backend() is None, reason=NEEDS_GPU)
