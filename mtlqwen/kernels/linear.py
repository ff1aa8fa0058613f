"""Linear projections, float or MLX affine-quantized (4/8-bit, groups of 32/64/128)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .backend import kernel_for


@dataclass
class LinearParams:
    """One projection `y = x @ W.T`. Quantized when `scales` is set: `weight` is uint32-packed
    [out, in * bits / 32] and `W = scales * q + biases` per group of `group_size` input columns."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int = 0
    group_size: int = 0

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 32 // self.bits if self.quantized else self.weight.shape[1]

    def dequantized(self) -> mx.array:
        if not self.quantized:
            return self.weight
        return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows of W for token ids: an embedding lookup that works on quantized tables too."""
        if not self.quantized:
            return self.weight[ids]
        return mx.dequantize(
            self.weight[ids], self.scales[ids], self.biases[ids], group_size=self.group_size, bits=self.bits
        )


def linear_ref(x: mx.array, p: LinearParams) -> mx.array:
    """x [..., in] -> [..., out] with MLX's own ops."""
    if p.quantized:
        return mx.quantized_matmul(
            x, p.weight, p.scales, p.biases, transpose=True, group_size=p.group_size, bits=p.bits
        )
    return x @ p.weight.T


def linear(x: mx.array, p: LinearParams) -> mx.array:
    kern = kernel_for("linear")
    out = kern(x, p) if kern is not None else None
    if out is not None:
        return out
    return linear_ref(x, p)


def gather_linear_ref(x: mx.array, p: LinearParams, inds: mx.array) -> mx.array:
    """Per-token expert projections. x [T, in], p.weight [E, out, in(packed)], inds [T, k] -> [T, k, out]."""
    xe = x[:, None, None, :]  # [T, 1, 1, in]: one row per token, broadcast over its k experts
    if p.quantized:
        y = mx.gather_qmm(
            xe, p.weight, p.scales, p.biases, rhs_indices=inds, transpose=True,
            group_size=p.group_size, bits=p.bits,
        )
    else:
        y = mx.gather_mm(xe, p.weight.swapaxes(-1, -2), rhs_indices=inds)
    return y[:, :, 0, :]


def gather_linear(x: mx.array, p: LinearParams, inds: mx.array) -> mx.array:
    kern = kernel_for("gather_linear")
    out = kern(x, p, inds) if kern is not None else None
    return out if out is not None else gather_linear_ref(x, p, inds)
