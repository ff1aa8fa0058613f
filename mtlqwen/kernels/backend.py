"""Which back-end runs the ops: custom kernels on Metal / CUDA, plain-MLX references on CPU.

`MTLQWEN_FORCE_REFERENCE=1` forces the references everywhere (debugging a kernel against its twin).
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


def force_reference() -> bool:
    return os.environ.get("MTLQWEN_FORCE_REFERENCE", "0") not in ("", "0", "false", "False")


def use_kernels() -> bool:
    """True when ops should dispatch to custom kernels: a GPU back-end, GPU default device, no override."""
    return (
        gpu_backend() is not None
        and mx.default_device().type == mx.DeviceType.gpu
        and not force_reference()
    )
