"""Small quantized projections on a GPU, the shapes of tests/test_kernels_moe.py's shared expert: each
x [T, K] @ W [N, K]^T through MLX's quantized_matmul and through our `linear` op, against fp32 on the CPU,
by rows T, bits, group size and N x K (K down to one quantization group). A row ending in `<--` is off by
more than bf16 rounding (2e-2 relative). benchmarks/moe.md says what it found.

    source .device/env.sh && python benchmarks/small_k_check.py
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx
from mtlqwen.kernels.qmatmul import LinearParams, linear
from mtlqwen.kernels.qmatmul.reference import linear_ref


def quantized(rng, shape, bits: int, gs: int, dtype) -> LinearParams:
    w = mx.array(rng.standard_normal(shape).astype(np.float32) * 0.05)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits, stream=mx.cpu)
    return LinearParams(wq, s.astype(dtype), b.astype(dtype), bits, gs)


def rel_err(a: mx.array, ref: np.ndarray) -> float:
    a = np.array(a.astype(mx.float32))
    return float("nan") if not np.isfinite(a).all() else float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def main() -> None:
    rng = np.random.default_rng(0)
    print("T bits gs N K | mlx_qmm ours")
    for bits, gs in [(8, 128), (4, 64), (8, 64), (4, 128), (8, 32), (4, 32)]:
        for N, K in [(256, gs), (128, 2 * gs), (512, 2048), (2048, 512)]:
            p = quantized(rng, (N, K), bits, gs, mx.bfloat16)
            p32 = LinearParams(p.weight, p.scales.astype(mx.float32), p.biases.astype(mx.float32), bits, gs)
            for T in (1, 8, 9, 16, 33):
                x = mx.array(rng.standard_normal((T, K)).astype(np.float32)).astype(mx.bfloat16)
                with mx.stream(mx.cpu):
                    ref = np.array(linear_ref(x.astype(mx.float32), p32))
                e1, e2 = rel_err(linear_ref(x, p), ref), rel_err(linear(x, p), ref)
                flag = "" if e1 < 2e-2 and e2 < 2e-2 else "  <--"
                print(f"{T} {bits} {gs} {N} {K} | {e1:.4f} {e2:.4f}{flag}", flush=True)


if __name__ == "__main__":
    main()
