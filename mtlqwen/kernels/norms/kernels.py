"""Row kernels: RMSNorm, the GDN gated RMSNorm and the fused residual add + RMSNorm (references in
reference.py). The row fragments (ROW_HEAD, SUM_SQ, ROW_INV_RMS) are shared with rope/kernels.py (head_norm_rope).

All of them are memory-bound; one launch each, fp32 arithmetic, each element read from device memory
once (the second pass over a row hits the cache). Row counts come from `x_shape` so a kernel is
compiled once per (dtype, width), not per token count.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, portable_kernel

FLOATS = (mx.float32, mx.float16, mx.bfloat16)

# Row layout: RPG rows per threadgroup, TPRN threads per row (32: one SIMD group; > 32: several,
# combined through threadgroup memory).
ROW_HEAD = """
SHARED float part[32];
const int tid = TID_X;
const int lr = tid / TPRN;
const int lt = tid % TPRN;
const int N = x_shape[0];
const int rw = TGID_X * RPG + lr;
const bool live = rw < N;
const size_t base = (size_t)(live ? rw : 0) * D;
"""

# shared with rope/kernels.py (head_norm_rope): reduce the row's sum of squares `ss` (TPRN threads a row) to `inv`
ROW_INV_RMS = """
ss = SIMD_SUM(ss);
if (TPRN > 32) {
  if (LANE == 0) part[SIMD_ID] = ss;
  BARRIER;
  ss = 0.0f;
  for (int j = 0; j < TPRN / 32; ++j) ss += part[lr * (TPRN / 32) + j];
}
const float inv = RSQRT(ss / (float)D + eps[0]);
"""

# the row's sum of squares over this thread's columns (RMS and gated norms)
SUM_SQ = """
float ss = 0.0f;
for (int i = lt; i < D; i += TPRN) {
  const float xv = TO_FLOAT(x[base + i]);
  ss += xv * xv;
}
"""

_RMS = ROW_HEAD + SUM_SQ + ROW_INV_RMS + """
if (live) {
  for (int i = lt; i < D; i += TPRN) y[base + i] = FROM_FLOAT(XT, TO_FLOAT(x[base + i]) * inv * TO_FLOAT(w[i]));
}
"""

# HF order (§2.9): normalise, cast to the activation dtype, times w, times silu(z), cast
_GATED = ROW_HEAD + SUM_SQ + ROW_INV_RMS + """
if (live) {
  for (int i = lt; i < D; i += TPRN) {
    const float yv = TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT(x[base + i]) * inv)) * TO_FLOAT(w[i]);
    const float zv = TO_FLOAT(z[base + i]);
    y[base + i] = FROM_FLOAT(XT, yv * (zv / (1.0f + EXP(-zv))));
  }
}
"""

# h + delta is rounded to the activation dtype first (it is the new residual stream), then normed. The row's
# loads all go first (NPT per thread, held in registers): a loop that stored between its loads ran them one
# latency at a time (the compiler must assume the output may alias the inputs), ~16 us a launch at B=8.
_ADD_RMS = ROW_HEAD + """
constexpr int NPT = (D + TPRN - 1) / TPRN;
float hv[NPT];
float wv[NPT];
#pragma unroll
for (int j = 0; j < NPT; ++j) {
  const int i = lt + j * TPRN;
  const bool in = live && i < D;
  hv[j] = in ? TO_FLOAT(x[base + i]) + TO_FLOAT(dlt[base + i]) : 0.0f;
  wv[j] = in ? TO_FLOAT(w[i]) : 0.0f;
}
float ss = 0.0f;
#pragma unroll
for (int j = 0; j < NPT; ++j) {
  hv[j] = TO_FLOAT(FROM_FLOAT(XT, hv[j]));
  ss += hv[j] * hv[j];
}
""" + ROW_INV_RMS + """
if (live) {
  #pragma unroll
  for (int j = 0; j < NPT; ++j) {
    const int i = lt + j * TPRN;
    if (i < D) {
      hsum[base + i] = FROM_FLOAT(XT, hv[j]);
      y[base + i] = FROM_FLOAT(XT, hv[j] * inv * wv[j]);
    }
  }
}
"""

def _row_examples(n_in: int, n_out: int) -> list[KernelExample]:
    """Qwen3.5-9B hidden rows in bf16 (several SIMD groups a row) and short fp32 rows (one each)."""
    out = []
    for dt, D, tpr, rpg in ((mx.bfloat16, 4096, 256, 1), (mx.float32, 48, 32, 4)):
        ins = [(dt, (5, D))] * n_in + [(dt, (D,)), (mx.float32, (1,))]
        out.append(KernelExample(ins, [dt] * n_out, [("XT", dt), ("D", D), ("TPRN", tpr), ("RPG", rpg)]))
    return out


RMS = portable_kernel(name="rms_norm", input_names=["x", "w", "eps"], output_names=["y"], body=_RMS,
                      examples=_row_examples(1, 1))
GATED = portable_kernel(name="gated_rms_norm", input_names=["x", "z", "w", "eps"], output_names=["y"],
                        body=_GATED, examples=_row_examples(2, 1))
ADD_RMS = portable_kernel(name="add_rms_norm", input_names=["x", "dlt", "w", "eps"],
                          output_names=["hsum", "y"], body=_ADD_RMS, examples=_row_examples(2, 2))
_EPS_ARRAYS: dict[float, mx.array] = {}


def eps_array(eps: float) -> mx.array:
    """eps as a one-element fp32 array, one per value (a kernel input that is never rebuilt)."""
    if eps not in _EPS_ARRAYS:
        _EPS_ARRAYS[eps] = mx.array([eps], dtype=mx.float32)
    return _EPS_ARRAYS[eps]


def _rows(kern, xs: list, w, eps: float, n_out: int, init_value=None):
    """Launch a row kernel over x [..., D] (and same-shape companions); outputs get x's shape."""
    backend = gpu_backend()
    x = xs[0]
    D = x.shape[-1]
    if backend is None or x.size == 0 or x.dtype not in FLOATS or any(t.shape != x.shape for t in xs):
        return None
    N = x.size // D
    tpr, rpg = (256, 1) if D >= 1024 else (32, 4)
    out = kern(
        backend,
        inputs=[t.reshape(N, D) for t in xs] + [w, eps_array(eps)],
        output_shapes=[(N, D)] * n_out,
        output_dtypes=[x.dtype] * n_out,
        grid=(-(-N // rpg) * tpr * rpg, 1, 1),
        threadgroup=(tpr * rpg, 1, 1),
        template=[("XT", x.dtype), ("D", D), ("TPRN", tpr), ("RPG", rpg)],
        init_value=init_value,
    )
    return [o.reshape(x.shape) for o in out]


def rms_norm_kernel(x, w, eps, init_value=None):
    out = _rows(RMS, [x], w, eps, 1, init_value)
    return None if out is None else out[0]


def gated_rms_norm_kernel(x, z, w, eps, init_value=None):
    out = _rows(GATED, [x, z], w, eps, 1, init_value)
    return None if out is None else out[0]


def add_rms_norm_kernel(h, delta, w, eps, init_value=None):
    out = _rows(ADD_RMS, [h, delta.astype(h.dtype)], w, eps, 2, init_value)
    return None if out is None else (out[0], out[1])
