"""The MoE block's combine step in one launch (prefill sizes): each token's k expert rows weighted and summed,
plus the shared expert's weighted row.

    out[t] = sum_j w[t, j] * y[dest[t*k + j]]  (+ w[t, k] * s[t])        [T, H]

y [R, H] holds the experts' down outputs in the path's own row order (the grouped buffer, or sorted pair
order), dest [T*k] int32 is each (token, slot) pair's row of y, w [T, k (+1)] fp32 the routing weights (the
shared expert's gate last), s [T, H] the shared expert's output. Rounding as the reference (combine_ref):
each weight and each product in the activation dtype, the sum over k in fp32 rounded once, then the
shared term's rounded product added and rounded.

Why: as plain MLX ops this was a gather of T*k rows (108 us at a 1024-token 35B-A3B step on the H200,
0.6 TB/s: `benchmarks/moe.md`), a broadcast multiply, a reduction over k, and a multiply and an add for the
shared expert: five launches a layer and three passes over [T, k, H]. One thread per output element
reads its k rows once.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS
from ..portable import KernelExample, portable_kernel

_TG = 256  # threads a threadgroup: 256 columns of one token

_BODY = """
const int c = TGID_X * TG + TID_X;
const int t = TGID_Y;
if (c < H) {
  float acc = 0.0f;
  for (int j = 0; j < K; ++j) {
    const float wj = TO_FLOAT(FROM_FLOAT(XT, w[(size_t)t * KS + j]));
    const size_t row = (size_t)dest[(size_t)t * K + j];
    acc += TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT(y[row * H + c]) * wj));
  }
  float r = TO_FLOAT(FROM_FLOAT(XT, acc));
SHARED_TERM
  out[(size_t)t * H + c] = FROM_FLOAT(XT, r);
}
"""
_SHARED = """  const float ws = TO_FLOAT(FROM_FLOAT(XT, w[(size_t)t * KS + K]));
  r = r + TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT(s[(size_t)t * H + c]) * ws));"""


def _example(dt, sh: bool) -> KernelExample:
    """The 35B-A3B geometry (H 2048, top-8 with the shared expert's gate) at 9 tokens, a 100-row buffer."""
    T, H, K = 9, 2048, 8
    ks = K + 1 if sh else K
    ins = [(dt, (100, H)), (mx.int32, (T * K,)), (mx.float32, (T, ks))] + ([(dt, (T, H))] if sh else [])
    return KernelExample(inputs=ins, outputs=[dt], template=[("XT", dt), ("H", H), ("K", K), ("KS", ks), ("TG", _TG)])


COMBINE = {sh: portable_kernel(
    name=f"mtl_moe_combine_s{int(sh)}",
    input_names=["y", "dest", "w"] + (["s"] if sh else []),
    output_names=["out"],
    body=_BODY.replace("SHARED_TERM", _SHARED if sh else ""),
    examples=[_example(dt, sh) for dt in (mx.bfloat16, mx.float32)],
) for sh in (False, True)}


def covers(y: mx.array, dest: mx.array, weights: mx.array, k: int, shared_y: mx.array | None) -> bool:
    """y [R, H] of a float dtype, dest [T*k] int32, weights [T, k or k+1] fp32, shared_y [T, H] like y
    (then weights has k+1 columns); T within the grid's y limit."""
    if gpu_backend() is None or y.ndim != 2 or y.dtype not in FLOATS or dest.dtype != mx.int32 or dest.ndim != 1:
        return False
    if weights.ndim != 2 or weights.dtype != mx.float32 or k < 1:
        return False
    T = weights.shape[0]
    if not 0 < T < 65536 or dest.shape[0] != T * k:
        return False
    if shared_y is None:
        return weights.shape[1] >= k
    return weights.shape[1] == k + 1 and shared_y.shape == (T, y.shape[1]) and shared_y.dtype == y.dtype


def combine(y: mx.array, dest: mx.array, weights: mx.array, k: int, shared_y: mx.array | None = None,
            init_value=None) -> mx.array:
    """-> out [T, H] in y's dtype (see the module docstring)."""
    T, H = weights.shape[0], y.shape[1]
    sh = shared_y is not None
    return COMBINE[sh](
        gpu_backend(),
        inputs=[y, dest, weights] + ([shared_y] if sh else []),
        output_shapes=[(T, H)],
        output_dtypes=[y.dtype],
        grid=(-(-H // _TG) * _TG, T, 1),
        threadgroup=(_TG, 1, 1),
        template=[("XT", y.dtype), ("H", H), ("K", k), ("KS", weights.shape[1]), ("TG", _TG)],
        init_value=init_value,
    )[0]
