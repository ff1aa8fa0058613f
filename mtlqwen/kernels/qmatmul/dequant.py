"""Dequantize MLX affine 4/8-bit weights to the activation dtype at memory speed: the first half of the
dequantize + GEMM path that serves many rows (prefill chunks) once the tensor-core GEMM stops winning.

MLX's own `mx.dequantize` took ~100 us for one 12288x4096 4-bit matrix on the H200 (benchmarks/qgemm.md):
as long as the bf16 GEMM it feeds at 1024 rows. This kernel reads each packed word once and writes its
32/BITS weights with one vector store: one thread per uint32 word, w = s*q + b in fp32, one rounding (as
MLX's dequantize). Reference twin: `LinearParams.dequantized` (mx.dequantize).
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, portable_kernel
from .params import LinearParams

POISON: float | None = None  # tests set NaN: every output element must then be written by the kernel

# store EPW consecutive outputs: CUDA packs them into one 16- / 8-byte store; Metal stores element-wise
_HEADER = r"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
template <typename T, int EPW>
__device__ __forceinline__ void dq_store(T* out, const float (&v)[EPW]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < EPW; ++i) out[i] = pl_from_float<T>(v[i]);
    return;
  }
  uint32_t pk[EPW / 2];
#pragma unroll
  for (int i = 0; i < EPW / 2; ++i) {
    T lo = pl_from_float<T>(v[2 * i]), hi = pl_from_float<T>(v[2 * i + 1]);
    pk[i] = (uint32_t)(*reinterpret_cast<unsigned short*>(&lo)) | ((uint32_t)(*reinterpret_cast<unsigned short*>(&hi)) << 16);
  }
  if constexpr (EPW == 8) *reinterpret_cast<uint4*>(out) = make_uint4(pk[0], pk[1], pk[2], pk[3]);
  else *reinterpret_cast<uint2*>(out) = make_uint2(pk[0], pk[1]);
}
#else
template <typename T, int EPW>
inline void dq_store(device T* out, thread const float (&v)[EPW]) {
  for (int i = 0; i < EPW; ++i) out[i] = static_cast<T>(v[i]);
}
#endif
"""

# Template: T (output / scale dtype), BITS, GS. One thread per packed word of the stacked matrices
# [sum N_j, K*BITS/32]: row r of the stack is row r - (N_0 + ... + N_{j-1}) of matrix j (`_pick`).
_BODY = r"""
  constexpr int EPW = 32 / BITS;
  const int KW = w0_shape[1];
  const int NG = s0_shape[1];
  const uint32_t i = GID_X;
  if (i >= (uint32_t)(ROWS) * (uint32_t)KW) return;
  const uint32_t row = i / (uint32_t)KW, col = i - row * (uint32_t)KW;
  uint32_t r = row, word;
  float sc, bi;
  PICK
  float v[EPW];
  for (int e = 0; e < EPW; ++e) v[e] = fma(sc, (float)((word >> (e * BITS)) & ((1u << BITS) - 1u)), bi);
  dq_store<T, EPW>(out + (size_t)i * EPW, v);
"""


def _pick(n: int) -> str:
    """The branch that finds row r's matrix j among n and loads its word, scale and bias."""
    def load(j: int) -> str:
        return (f"{{ const uint32_t gi = r * (uint32_t)NG + (col * EPW) / GS; word = w{j}[r * (uint32_t)KW + col]; "
                f"sc = TO_FLOAT(s{j}[gi]); bi = TO_FLOAT(b{j}[gi]); }}")
    code = load(n - 1)
    for j in range(n - 2, -1, -1):
        code = f"if (r < (uint32_t)w{j}_shape[0]) {load(j)} else {{ r -= (uint32_t)w{j}_shape[0]; {code} }}"
    return code


def _declare(n: int):
    """The kernel over n stacked matrices (inputs w0, s0, b0, w1, ...)."""
    rows = " + ".join(f"w{j}_shape[0]" for j in range(n))

    def one(bits, dt):  # one matrix's (w, s, b) of an example: 1024 x 4096, groups of 64
        return ((mx.uint32, (1024, 4096 * bits // 32)), (dt, (1024, 64)), (dt, (1024, 64)))

    return portable_kernel(
        name=f"mtl_dequantize_x{n}", input_names=[f"{a}{j}" for j in range(n) for a in ("w", "s", "b")],
        output_names=["out"], body=_BODY.replace("PICK", _pick(n)).replace("ROWS", rows), header=_HEADER,
        examples=[KernelExample(inputs=[a for _ in range(n) for a in one(bits, dt)], outputs=[dt],
                                template=[("T", dt), ("BITS", bits), ("GS", 64)])
                  for dt in (mx.bfloat16, mx.float16, mx.float32) for bits in (4, 8)],
    )


MAX_STACK = 4  # the most matrices one launch dequantizes (a GDN layer's four input projections)
_KERNELS = {n: _declare(n) for n in range(1, MAX_STACK + 1)}


def supported(p: LinearParams, dtype) -> bool:
    return (p.quantized and p.bits in (4, 8) and p.group_size in (32, 64, 128) and p.scales.dtype == dtype
            and p.biases.dtype == dtype and dtype in (mx.bfloat16, mx.float16, mx.float32))


def stackable(ps: list[LinearParams], dtype) -> bool:
    """One launch can dequantize ps into one [sum N, K] matrix: each supported, with one K, bits and group."""
    return (1 <= len(ps) <= MAX_STACK and all(supported(p, dtype) for p in ps)
            and len({(p.weight.shape[1], p.bits, p.group_size) for p in ps}) == 1)


def dequantize(p: LinearParams, dtype) -> mx.array:
    """p's weights as a dense [out, in] matrix of `dtype` (the scales' dtype), on the kernel."""
    return dequantize_stack([p], dtype)


def dequantize_stack(ps: list[LinearParams], dtype) -> mx.array:
    """ps's weights stacked by rows, [sum_j N_j, in] of `dtype`, in one launch (`stackable(ps, dtype)`):
    row slices of it are the matrices, contiguous, so each feeds a GEMM without a copy."""
    p0 = ps[0]
    N, KW = sum(p.weight.shape[0] for p in ps), p0.weight.shape[1]
    total = N * KW
    return _KERNELS[len(ps)](
        gpu_backend(), inputs=[a for p in ps for a in (p.weight, p.scales, p.biases)],
        output_shapes=[(N, KW * 32 // p0.bits)], output_dtypes=[dtype], grid=(total, 1, 1), threadgroup=(256, 1, 1),
        template=[("T", dtype), ("BITS", p0.bits), ("GS", p0.group_size)], init_value=POISON,
    )[0]
