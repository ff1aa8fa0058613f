"""The norm ops: the GPU row kernels (kernels.py) where they run, the references otherwise."""

from __future__ import annotations

import mlx.core as mx

from ..dispatch import kernel_op
from . import kernels
from .reference import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref


@kernel_op("rms_norm", kernels.rms_norm_kernel)
def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return rms_norm_ref(x, w, eps)


@kernel_op("gated_rms_norm", kernels.gated_rms_norm_kernel)
def gated_rms_norm(x: mx.array, z: mx.array, w: mx.array, eps: float) -> mx.array:
    return gated_rms_norm_ref(x, z, w, eps)


@kernel_op("add_rms_norm", kernels.add_rms_norm_kernel)
def add_rms_norm(h: mx.array, delta: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    return add_rms_norm_ref(h, delta, w, eps)
