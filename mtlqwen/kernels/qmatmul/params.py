"""A projection's weights: float, or MLX affine-quantized (4/8-bit, groups of 32/64/128)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class LinearParams:
    """One projection `y = x @ W.T`. Quantized when `scales` is set: `weight` is uint32-packed
    [out, in * bits / 32] and `W = scales * q + biases` per group of `group_size` input columns."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    bits: int = 0
    group_size: int = 0
    # A dequantized copy kept in memory (model/dense_weights.py) for the GEMMs past qgemm's rows, which would
    # otherwise dequantize W at every step: `dense` [out, in] in the scales' dtype; where projections of one
    # input were dequantized together, a row range of their stacked matrix, and `dense_stack` is (that
    # matrix [sum out, in], this projection's place among them).
    dense: mx.array | None = None
    dense_stack: tuple[mx.array, int] | None = None
    # dense.T, and the stacked matrix's .T (on each projection of the stack), evaluated when kept: views of the
    # same buffers, so a step's GEMMs take them without a Transpose node each (216 a 9B prefill step)
    dense_t: mx.array | None = None
    dense_stack_t: mx.array | None = None

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]  # [out, in] or stacked experts' [E, out, in]

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1] * 32 // self.bits if self.quantized else self.weight.shape[-1]

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
