"""Partial RoPE from tables, and per-head RMSNorm then partial RoPE in one launch (gated attention's q and
k preparation, §3.3-3.4), written once in portable tokens.

Why the fused kernel: the attention layer otherwise spends five launches here per step (a copy of q out of
the q|gate projection, RMSNorm q, RoPE q, RMSNorm k, RoPE k), and at batch 1 each custom-kernel launch
costs the host ~9 µs to encode (benchmarks/decode_profile.md). It reads each head's first D values with a
row stride, so q is taken straight from the packed projection output [T, H, 2·D] without a copy.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS, ROW_INV_RMS, SUM_SQ, eps_array
from ..portable import KernelExample, portable_kernel
from .reference import RopeTables

_ROPE = """
const size_t idx = GID_X;
const size_t total = (size_t)x_shape[0] * H * D;
if (idx < total) {
  const int d = idx % D;
  if (d >= RD) {
    y[idx] = x[idx];
  } else {
    const int ps = pos[idx / ((size_t)H * D)];
    const int i = d % (RD / 2);
    const float cs = cos_t[(size_t)ps * (RD / 2) + i];
    const float sn = sin_t[(size_t)ps * (RD / 2) + i];
    const float xv = TO_FLOAT(x[idx]);
    const float res = d < RD / 2 ? xv * cs - TO_FLOAT(x[idx + RD / 2]) * sn : xv * cs + TO_FLOAT(x[idx - RD / 2]) * sn;
    y[idx] = FROM_FLOAT(XT, res);
  }
}
"""


ROPE = portable_kernel(
    name="rope_tables",
    input_names=["x", "pos", "cos_t", "sin_t"],
    output_names=["y"],
    body=_ROPE,
    examples=[KernelExample([(dt, (3, H, 256)), (mx.int32, (3,)), (mx.float32, (64, 32)), (mx.float32, (64, 32))],
                            [dt], [("XT", dt), ("H", H), ("D", 256), ("RD", 64)])
              for dt, H in ((mx.bfloat16, 16), (mx.float32, 3))],
)


def rope_kernel(x, positions, tables: RopeTables, init_value=None):
    """x [T, H, D], positions [T] -> the first rotary_dim dims of each head rotated (NeoX halves)."""
    backend = gpu_backend()
    if backend is None or x.ndim != 3 or x.size == 0 or x.dtype not in FLOATS:
        return None
    T, H, D = x.shape
    rd = tables.rotary_dim
    if rd % 2 or rd > D:
        return None
    total = T * H * D
    return ROPE(
        backend,
        inputs=[x, positions.astype(mx.int32), tables.cos, tables.sin],
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
        grid=(-(-total // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        template=[("XT", x.dtype), ("H", H), ("D", D), ("RD", rd)],
        init_value=init_value,
    )[0]


def park_normed(x: str, w: str) -> str:
    """Row lr's normalised values (x[base + i] * inv * w[i], rounded to XT) into threadgroup memory nrm."""
    return f"""for (int i = lt; i < D; i += TPRN) {{
  nrm[lr * D + i] = TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT({x}[base + i]) * inv * TO_FLOAT({w}[i])));
}}
BARRIER;"""


# element i of the parked row at position ps, rotated (NeoX halves of the first RD dims) -> v
ROTATE_PARKED = """    float v = nrm[lr * D + i];
    if (i < RD) {
      const int j = i % (RD / 2);
      const float cs = cos_t[(size_t)ps * (RD / 2) + j];
      const float sn = sin_t[(size_t)ps * (RD / 2) + j];
      v = i < RD / 2 ? v * cs - nrm[lr * D + i + RD / 2] * sn : v * cs + nrm[lr * D + i - RD / 2] * sn;
    }"""


# One head-row of D values per TPRN threads, RPG rows per threadgroup. The normalised row is rounded to
# the activation dtype (as the separate norm's output is) and parked in threadgroup memory, because RoPE
# pairs element i with i ± RD/2 of the same row.
# threadgroup memory and thread -> (row lr of the group, lane lt of the row) for RPG parked rows of D
PARKED_ROWS = """
SHARED float part[32];
SHARED float nrm[RPG * D];
const int tid = TID_X;
const int lr = tid / TPRN;
const int lt = tid % TPRN;
"""

_HEAD_NORM_ROPE = PARKED_ROWS + """const int N = x_shape[0] * H;
const int rw = TGID_X * RPG + lr;
const bool live = rw < N;
const size_t base = (size_t)(live ? rw : 0) * RS;
""" + SUM_SQ + ROW_INV_RMS + """
""" + park_normed("x", "w") + """
if (live) {
  const int ps = pos[rw / H];
  const size_t ob = (size_t)rw * D;
  for (int i = lt; i < D; i += TPRN) {
""" + ROTATE_PARKED + """
    y[ob + i] = FROM_FLOAT(XT, v);
  }
}
"""

HEAD_NORM_ROPE = portable_kernel(
    name="head_norm_rope",
    input_names=["x", "w", "eps", "pos", "cos_t", "sin_t"],
    output_names=["y"],
    body=_HEAD_NORM_ROPE,
    examples=[
        KernelExample([(dt, (3, H, RS)), (dt, (256,)), (mx.float32, (1,)), (mx.int32, (3,)),
                       (mx.float32, (64, 32)), (mx.float32, (64, 32))],
                      [dt], [("XT", dt), ("H", H), ("D", 256), ("RS", RS), ("RD", 64), ("TPRN", 32), ("RPG", 4)])
        for dt, H, RS in ((mx.bfloat16, 16, 512), (mx.float32, 4, 256))
    ],
)

def head_norm_rope_kernel(x, w, eps, positions, tables: RopeTables, head_dim: int, init_value=None):
    backend = gpu_backend()
    if backend is None or x.ndim != 3 or x.size == 0 or x.dtype not in FLOATS:
        return None
    T, H, RS = x.shape
    rd = tables.rotary_dim
    if rd % 2 or rd > head_dim or head_dim > RS or head_dim % 32:
        return None
    rpg = 4
    return HEAD_NORM_ROPE(
        backend,
        inputs=[x, w, eps_array(eps), positions.astype(mx.int32), tables.cos, tables.sin],
        output_shapes=[(T, H, head_dim)],
        output_dtypes=[x.dtype],
        grid=(-(-(T * H) // rpg) * 32 * rpg, 1, 1),
        threadgroup=(32 * rpg, 1, 1),
        template=[("XT", x.dtype), ("H", H), ("D", head_dim), ("RS", RS), ("RD", rd), ("TPRN", 32), ("RPG", rpg)],
        init_value=init_value,
    )[0]
