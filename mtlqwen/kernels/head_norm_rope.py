"""Per-head RMSNorm then partial RoPE in one launch: gated attention's q and k preparation (§3.3-3.4).

Why: the attention layer otherwise spends five launches here per step (a copy of q out of the q|gate
projection, RMSNorm q, RoPE q, RMSNorm k, RoPE k), and at batch 1 each custom-kernel launch costs the host
~9 µs to encode (benchmarks/decode_profile.md). The kernel reads each head's first D values with a row
stride, so q is taken straight from the packed projection output [T, H, 2·D] without a copy.
"""

from __future__ import annotations

import mlx.core as mx

from .backend import gpu_backend, kernel_for, register_kernel
from .fused_small import FLOATS, ROW_INV_RMS, SUM_SQ, eps_array
from .norms import rms_norm, rms_norm_ref
from .portable import KernelExample, portable_kernel
from .rope import RopeTables, apply_rope, apply_rope_ref
from .selection import SELECT

# One head-row of D values per TPRN threads, RPG rows per threadgroup. The normalised row is rounded to
# the activation dtype (as the separate norm's output is) and parked in threadgroup memory, because RoPE
# pairs element i with i ± RD/2 of the same row.
_BODY = """
SHARED float part[32];
SHARED float nrm[RPG * D];
const int tid = TID_X;
const int lr = tid / TPRN;
const int lt = tid % TPRN;
const int N = x_shape[0] * H;
const int rw = TGID_X * RPG + lr;
const bool live = rw < N;
const size_t base = (size_t)(live ? rw : 0) * RS;
""" + SUM_SQ + ROW_INV_RMS + """
for (int i = lt; i < D; i += TPRN) {
  nrm[lr * D + i] = TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT(x[base + i]) * inv * TO_FLOAT(w[i])));
}
BARRIER;
if (live) {
  const int ps = pos[rw / H];
  const size_t ob = (size_t)rw * D;
  for (int i = lt; i < D; i += TPRN) {
    float v = nrm[lr * D + i];
    if (i < RD) {
      const int j = i % (RD / 2);
      const float cs = cos_t[(size_t)ps * (RD / 2) + j];
      const float sn = sin_t[(size_t)ps * (RD / 2) + j];
      v = i < RD / 2 ? v * cs - nrm[lr * D + i + RD / 2] * sn : v * cs + nrm[lr * D + i - RD / 2] * sn;
    }
    y[ob + i] = FROM_FLOAT(XT, v);
  }
}
"""

HEAD_NORM_ROPE = portable_kernel(
    name="head_norm_rope",
    input_names=["x", "w", "eps", "pos", "cos_t", "sin_t"],
    output_names=["y"],
    body=_BODY,
    examples=[
        KernelExample([(dt, (3, H, RS)), (dt, (256,)), (mx.float32, (1,)), (mx.int32, (3,)),
                       (mx.float32, (64, 32)), (mx.float32, (64, 32))],
                      [dt], [("XT", dt), ("H", H), ("D", 256), ("RS", RS), ("RD", 64), ("TPRN", 32), ("RPG", 4)])
        for dt, H, RS in ((mx.bfloat16, 16, 512), (mx.float32, 4, 256))
    ],
)

def _heads(x: mx.array, head_dim: int) -> mx.array:
    return x if x.shape[-1] == head_dim else x[..., :head_dim]  # a slice is a graph node even when whole


def head_norm_rope_ref(x: mx.array, w: mx.array, eps: float, positions: mx.array, tables: RopeTables,
                       head_dim: int) -> mx.array:
    """x [T, H, RS] (RS >= head_dim: each head's first head_dim values are used) -> [T, H, head_dim]."""
    return apply_rope_ref(rms_norm_ref(_heads(x, head_dim), w, eps), positions, tables)


@register_kernel("head_norm_rope")
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


def head_norm_rope(x: mx.array, w: mx.array, eps: float, positions: mx.array, tables: RopeTables,
                   head_dim: int) -> mx.array:
    """The fused kernel where it is switched on (`SELECT["head_norm_rope"]`), else the norm and RoPE ops
    one after the other (each a kernel of its own on the GPU)."""
    kern = kernel_for("head_norm_rope") if SELECT["head_norm_rope"] else None
    out = kern(x, w, eps, positions, tables, head_dim) if kern is not None else None
    if out is not None:
        return out
    return apply_rope(rms_norm(_heads(x, head_dim), w, eps), positions, tables)
