"""Which back-end runs the ops: custom kernels on Metal / CUDA, plain-MLX references on CPU.

`MTLQWEN_FORCE_REFERENCE=1` forces the references everywhere (debugging a kernel against its twin); it is read
when the module is imported.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx


@lru_cache(maxsize=None)
def gpu_backend() -> str | None:
    """'metal', 'cuda' or None (CPU-only MLX build)."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


# read once: every op's dispatch asks, several hundred times a prefill step, and an environment lookup
# costs microseconds of host time (benchmarks/host_build.py); tests flip the flag itself
FORCE_REFERENCE = os.environ.get("MTLQWEN_FORCE_REFERENCE", "0") not in ("", "0", "false", "False")


def force_reference() -> bool:
    return FORCE_REFERENCE


def use_kernels() -> bool:
    """True when ops should dispatch to custom kernels: a GPU back-end, GPU default device, no override."""
    return (
        gpu_backend() is not None
        and mx.default_device().type == mx.DeviceType.gpu
        and not force_reference()
    )
