"""The attention layer's q and k preparation and the in-place KV write in one launch (GPU).

    q = rope(rms_norm(qg[:, :, :D]) * q_norm)          [T, HQ, D]  (read in place from the q|gate projection)
    k = rope(rms_norm(k) * k_norm)                    [T, HK, D]
    k_pool[slot(t)] = k[t];  v_pool[slot(t)] = v[t]   (the new tokens' write slots, as kv_write.py)

Why: these were three launches per attention layer (head_norm_rope for q, for k, then kv_write), and MLX's
host time per launch (~13-20 us on the H200's hosts, benchmarks/decode_profile.md) made the batch-1 step
host-bound. The kernel is rope/kernels.py's head_norm_rope body over the q head-rows followed by the k
head-rows, the k rows also storing into the pools. k is an output too: the first-use self-check compares q
and k with the references, and a caller that cannot take the in-place write (no token) has it.

Ordering: as kv_write.py, the pools are written through their input pointers and `done` is the token every
reader of the pools in the same evaluation takes.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS, ROW_INV_RMS, eps_array
from ..portable import KernelExample, portable_kernel
from ..rope.kernels import PARKED_ROWS, ROTATE_PARKED, park_normed
from ..rope.reference import RopeTables
from ..seqs import SeqLayout

# One head-row of D values per TPRN threads, RPG rows a threadgroup: rows 0..T*HQ-1 are q's, then T*HK k's.
# k and v are read from rows of KTS / VTS elements, each token's HK heads from element KOF / VOF: [T, HK, D]
# arrays (KTS = HK * D, offsets 0), or a packed projection's rows read in place (a slice would be copied).
# HQ = 0: no q rows (a context write: k and the pools only).
_BODY = PARKED_ROWS + """const int T = pos_shape[0];
const int NQ = T * HQ;
const int rw = TGID_X * RPG + lr;
const bool live = rw < NQ + T * HK;
const bool isq = rw < NQ;
const int kr = (live && !isq) ? rw - NQ : 0;
const size_t kt = (size_t)(kr / HK), kh = (size_t)(kr % HK) * D;
const size_t base = !live ? 0 : (isq ? (size_t)rw * RSQ : kt * KTS + KOF + kh);
CONST_PTR XT* src = isq ? qg : kin;
CONST_PTR WT* nw = isq ? qw : kw;
float ss = 0.0f;
for (int i = lt; i < D; i += TPRN) {
  const float xv = TO_FLOAT(src[base + i]);
  ss += xv * xv;
}
""" + ROW_INV_RMS + park_normed("src", "nw") + """
if (live) {
  const int t = isq ? rw / HQ : kr / HK;
  const int ps = pos[t];
  const size_t slot = ((size_t)blocks[t] * BT + (size_t)offsets[t]) * (HK * D) + (size_t)(kr % HK) * D;
  for (int i = lt; i < D; i += TPRN) {
""" + ROTATE_PARKED + """
    const XT r = FROM_FLOAT(XT, v);
    if (isq) {
      q[(size_t)rw * D + i] = r;
    } else {
      k[(size_t)kr * D + i] = r;
      ((DEVICE_PTR TP*)k_pool)[slot + i] = FROM_FLOAT(TP, TO_FLOAT(r));
      ((DEVICE_PTR TP*)v_pool)[slot + i] = FROM_FLOAT(TP, TO_FLOAT(vin[kt * VTS + VOF + kh + i]));
    }
  }
}
if (GID_X == 0) {
  done[0] = 1;
}
"""

INPUTS = ["qg", "kin", "vin", "qw", "kw", "eps", "pos", "cos_t", "sin_t", "k_pool", "v_pool", "blocks", "offsets"]


def _example(dt, tp, T: int, HQ: int, HK: int, D: int, RD: int, wt=None) -> KernelExample:
    """A call at T tokens: qg [T, HQ, 2D], k / v [T, HK, D], norm weights of wt (default dt), pools of 64
    blocks of 128 tokens."""
    wt = wt or dt
    ins = [(dt, (T, HQ, 2 * D)), (dt, (T, HK, D)), (dt, (T, HK, D)), (wt, (D,)), (wt, (D,)), (mx.float32, (1,)),
           (mx.int32, (T,)), (mx.float32, (64, RD // 2)), (mx.float32, (64, RD // 2)),
           (tp, (64, 128, HK, D)), (tp, (64, 128, HK, D)), (mx.int32, (T,)), (mx.int32, (T,))]
    tmpl = [("XT", dt), ("HQ", HQ), ("HK", HK), ("D", D), ("RSQ", 2 * D), ("RD", RD), ("TPRN", 32), ("RPG", 4),
            ("TP", tp), ("BT", 128), ("WT", wt), ("KTS", HK * D), ("KOF", 0), ("VTS", HK * D), ("VOF", 0)]
    return KernelExample(inputs=ins, outputs=[dt, dt, mx.int32], template=tmpl)


def _packed_example(dt, T: int, HQ: int, HK: int, D: int, RD: int) -> KernelExample:
    """The DFlash drafter's calls: q [T, HQ, D] beside its k | v projection [T, 2 * HK * D] read in place
    (HQ = 0: a context write), bf16 pools."""
    W = 2 * HK * D
    ins = [(dt, (T, max(HQ, 1), D)), (dt, (T, W)), (dt, (T, W)), (dt, (D,)), (dt, (D,)), (mx.float32, (1,)),
           (mx.int32, (T,)), (mx.float32, (64, RD // 2)), (mx.float32, (64, RD // 2)),
           (dt, (64, 128, HK, D)), (dt, (64, 128, HK, D)), (mx.int32, (T,)), (mx.int32, (T,))]
    tmpl = [("XT", dt), ("HQ", HQ), ("HK", HK), ("D", D), ("RSQ", D), ("RD", RD), ("TPRN", 32), ("RPG", 4),
            ("TP", dt), ("BT", 128), ("WT", dt), ("KTS", W), ("KOF", 0), ("VTS", W), ("VOF", HK * D)]
    return KernelExample(inputs=ins, outputs=[dt, dt, mx.int32], template=tmpl)


PREP = portable_kernel(
    name="mtl_attn_prep_kv_write",
    input_names=INPUTS,
    output_names=["q", "k", "done"],
    body=_BODY,
    # the 9B and 35B-A3B attention (16 q heads, 4 / 2 KV heads, head_dim 256, rotary 64) and a small one;
    # bf16 activations beside fp32 norm weights too (checkpoints that keep their norms in fp32)
    examples=[_example(dt, tp, T, HQ, HK, D, RD)
              for dt, tp in ((mx.bfloat16, mx.bfloat16), (mx.float32, mx.float32))
              for T, HQ, HK, D, RD in ((1, 16, 4, 256, 64), (1, 16, 2, 256, 64), (3, 4, 2, 64, 32))]
    + [_example(mx.bfloat16, mx.bfloat16, 1, 16, 2, 256, 64, wt=mx.float32)]
    # the z-lab 9B drafter's proposal (8 rows, 32 q / 8 KV heads of 128) and its context write
    + [_packed_example(mx.bfloat16, 8, 32, 8, 128, 128), _packed_example(mx.bfloat16, 16, 0, 8, 128, 128)],
)


def covers(qg: mx.array, k: mx.array, v: mx.array, q_norm: mx.array, k_norm: mx.array, k_pool: mx.array,
           v_pool: mx.array, tables: RopeTables, head_dim: int, k_off: int = 0, v_off: int = 0) -> bool:
    """qg [T, HQ, RSQ >= D] or None (no q; q_norm is then not read), k / v [T, HK, D] or packed rows [T, W]
    holding a token's HK * D values from k_off / v_off, all of one float dtype; norm weights [D] of one float
    dtype (any: fp32 norms beside bf16 activations are common), pools [blocks, BT, HK, D] of one float dtype."""
    if gpu_backend() is None or k.ndim not in (2, 3) or v.ndim != k.ndim or k.dtype not in FLOATS:
        return False
    if qg is not None and (qg.ndim != 3 or qg.dtype != k.dtype or q_norm.dtype != k_norm.dtype
                           or q_norm.shape != (head_dim,) or qg.shape[0] != k.shape[0] or qg.shape[2] < head_dim):
        return False
    if k_norm.dtype not in FLOATS or k_norm.shape != (head_dim,):
        return False
    if k_pool.ndim != 4 or v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype or k_pool.dtype not in FLOATS:
        return False
    T, HK, rd = k.shape[0], k_pool.shape[2], tables.rotary_dim
    if k.ndim == 3:
        rows_ok = k.shape == v.shape == (T, HK, head_dim) and k_off == v_off == 0
    else:
        rows_ok = (k.shape[0] == v.shape[0] == T and 0 <= k_off and 0 <= v_off
                   and k_off + HK * head_dim <= k.shape[1] and v_off + HK * head_dim <= v.shape[1])
    return (T > 0 and rows_ok and k.dtype == v.dtype and k_pool.shape[3] == head_dim
            and head_dim % 32 == 0 and rd % 2 == 0 and rd <= head_dim)


def prep_kv_write(qg, k, v, q_norm, k_norm, eps: float, positions, tables: RopeTables, head_dim: int,
                  k_pool, v_pool, layout: SeqLayout, init_value=None, k_off: int = 0, v_off: int = 0):
    """-> (q [T, HQ, D], k normed [T, HK, D], the write's `done` token [1] int32). k / v as `covers` says;
    qg None: no q (a context write; q comes back as an unwritten [1, 1, D]: a GPU output needs a buffer)."""
    T, HK = positions.shape[0], k_pool.shape[2]
    # without q the kernel reads no qg row nor q_norm: k and k_norm stand in for the inputs
    (HQ, RSQ), qg, q_norm = ((0, head_dim), k, k_norm) if qg is None else (qg.shape[1:], qg, q_norm)
    rpg = 4
    kts, vts = (k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]) if k.ndim == 3 else (k.shape[1], v.shape[1])
    return PREP(
        gpu_backend(),
        inputs=[qg, k, v, q_norm, k_norm, eps_array(eps),
                positions if positions.dtype == mx.int32 else positions.astype(mx.int32), tables.cos, tables.sin,
                k_pool, v_pool, layout.array("write_blocks"), layout.array("write_offsets")],
        output_shapes=[(T, HQ, head_dim) if HQ else (1, 1, head_dim), (T, HK, head_dim), (1,)],
        output_dtypes=[k.dtype, k.dtype, mx.int32],
        grid=(-(-(T * (HQ + HK)) // rpg) * 32 * rpg, 1, 1),
        threadgroup=(32 * rpg, 1, 1),
        template=[("XT", k.dtype), ("HQ", HQ), ("HK", HK), ("D", head_dim), ("RSQ", RSQ), ("RD", tables.rotary_dim),
                  ("TPRN", 32), ("RPG", rpg), ("TP", k_pool.dtype), ("BT", layout.block_tokens), ("WT", k_norm.dtype),
                  ("KTS", kts), ("KOF", k_off), ("VTS", vts), ("VOF", v_off)],
        init_value=init_value,
    )
