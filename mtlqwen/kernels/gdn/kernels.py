"""Gated DeltaNet kernels (docs/qwen35.md §2.4-2.8), written once in portable tokens.

Two kernels over a packed batch; both take the raw conv outputs q, k [T, Hk, dk], v [T, Hv, dv],
the gate inputs a, b [T, Hv], A_log, dt_bias [Hv] and the fp32 state pool [S, Hv, dv, dk], and fuse
the gates, the L2 norms and the q scale. Each dv row of a state evolves independently, so a
threadgroup owns (sequence, value head, block of dv rows) and keeps its rows in registers.

- `gdn_recurrent`: the token-by-token recurrence (§2.7) for decode and verification. TPR lanes share
  a row (dk/TPR elements each); optionally writes the state after every token (candidate states).
- `gdn_recurrent_staged` (staged.py): the same with a block of tokens read ahead (selection row
  `gdn_recurrent_stage`).
- `gdn_chunk`: the chunked scan (§2.8) for prefill, C tokens a chunk (32 on CUDA; 16 on Metal, whose
  32 KB threadgroup memory cannot hold two 32x128 fp32 tiles), carrying the incoming state.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS
from ..portable import portable_kernel
from ..selection import SELECT
from ..seqs import SeqLayout
from .pieces import (GATES, INPLACE_STORE, INPUT_NAMES, PROLOGUE, SHARED_LIMIT, declare_variants, recurrent_examples,
                     reduce_row, store_state, tpr_for)
from .staged import staged_kernel

CHUNK_TPR = 4  # lanes per state row in the chunk kernel (threadgroup = C * CHUNK_TPR)
_CHUNK_TOKENS = {"cuda": 32, "metal": 16}  # tokens a chunk: two C x dk fp32 tiles in the back-end's threadgroup memory


def _chunk_fits(backend: str, dk: int) -> int:
    """The chunk size the chunk kernel runs with for this dk on this back-end, or 0 if it cannot."""
    c, limit = _CHUNK_TOKENS[backend], SHARED_LIMIT[backend]
    smem = 4 * (2 * c * dk + 3 * c * (c + 1) + 3 * c)
    return c if dk % 16 == 0 and smem <= limit else 0


_RECURRENT = (
    (PROLOGUE
    + """
for (int t = t0; t < t1; ++t) {
  // L2-normalise k and q over dk (eps on the sum, §2.5); every row group does it for itself
  float kn[NE];
  float qn[NE];
  float kss = 0.0f, qss = 0.0f;
  const size_t kb = (size_t)t * QS + hk * DK;
  for (int e = 0; e < NE; ++e) {
    const int c = ((e / 4) * TPR + p) * 4 + e % 4;
    kn[e] = TO_FLOAT(k[kb + KO + c]);
    qn[e] = TO_FLOAT(q[kb + c]);
    kss += kn[e] * kn[e];
    qss += qn[e] * qn[e];
  }
  RED_KSS
  RED_QSS
  const float kinv = RSQRT(kss + 1e-6f);
  const float qinv = RSQRT(qss + 1e-6f) * q_scale;
""" + GATES + """  float pred = 0.0f;
  for (int e = 0; e < NE; ++e) {
    kn[e] *= kinv;
    s[e] *= decay;
    pred += s[e] * kn[e];
  }
  RED_PRED
  const float vv = live ? TO_FLOAT(v[(size_t)t * VS + VO + hv * DV + row]) : 0.0f;
  const float delta = beta * (vv - pred);
  float out = 0.0f;
  for (int e = 0; e < NE; ++e) {
    s[e] += delta * kn[e];
    out += s[e] * qn[e];
  }
  RED_OUT
  if (live && p == 0) o[((size_t)t * HV + hv) * DV + row] = FROM_FLOAT(InT, out * qinv);
  CAND_STORE
}
FINAL_STORE
""").replace("RED_KSS", reduce_row("kss"))
    .replace("RED_QSS", reduce_row("qss"))
    .replace("RED_PRED", reduce_row("pred"))
    .replace("RED_OUT", reduce_row("out"))
)
RECURRENT, RECURRENT_INPLACE, RECURRENT_CAND = declare_variants(
    "gdn_recurrent", INPUT_NAMES, _RECURRENT, lambda cand, inplace: recurrent_examples(cand, None, inplace))

# Chunked scan (§2.8) in this layout (S rows r, columns c over dk), for a chunk of C tokens i, j:
#   A[i,j] = b_i e^{g_i-g_j} k_i.k_j (j<i),  X_i = b_i (v_i - e^{g_i} S k_i),  (I + A) V' = X
#   o_i = e^{g_i} S q_i + sum_{j<=i} e^{g_i-g_j} (q_i.k_j) V'_j,  S <- e^{g_L} S + sum_j e^{g_L-g_j} V'_j k_j^T
# (g = in-chunk cumsum of the log decays). Thread row r doubles as token j = r of the chunk (BV == C).
_CHUNK = (
    PROLOGUE
    + """
// normalised k, and normalised scaled q, of the chunk [token][dk / 4]: float4 so each thread reads its
// 4-column pieces of a row in one shared-memory load (the 4 lanes of a row read 64 contiguous bytes)
SHARED float4 Ks4[C * DK / 4];
SHARED float4 Qs4[C * DK / 4];
SHARED float As[C * (C + 1)];   // A [i][j]; after the solve: e^{g_i} S q_i [i][row]
SHARED float Ms[C * (C + 1)];   // e^{g_i-g_j} q_i.k_j [i][j], j <= i
SHARED float Xs[C * (C + 1)];   // v, then X, then V' [token][row]
SHARED float gs[C];
SHARED float bs[C];
SHARED float gam[C];
float kj[NE];  // normalised k of token j = r, this thread's columns
for (int c0 = t0; c0 < t1; c0 += C) {
  const int n = (t1 - c0 < C) ? (t1 - c0) : C;
  {
    // 1. token r: normalise k and q, gates, v for the block's rows (zeros past the segment: no-ops)
    const bool tv = r < n;
    const size_t kb = (size_t)(c0 + (tv ? r : 0)) * QS + hk * DK;
    float qv[NE];
    float kss = 0.0f, qss = 0.0f;
    for (int e = 0; e < NE; ++e) {
      const int c = ((e / 4) * TPR + p) * 4 + e % 4;
      kj[e] = tv ? TO_FLOAT(k[kb + KO + c]) : 0.0f;
      qv[e] = tv ? TO_FLOAT(q[kb + c]) : 0.0f;
      kss += kj[e] * kj[e];
      qss += qv[e] * qv[e];
    }
    RED_KSS
    RED_QSS
    const float kinv = RSQRT(kss + 1e-6f);
    const float qinv = RSQRT(qss + 1e-6f) * q_scale;
    for (int e = 0; e < NE; ++e) kj[e] *= kinv;
    for (int m = 0; m < NQ; ++m) {
      Ks4[r * (DK / 4) + m * TPR + p] = MAKE_FLOAT4(kj[4 * m], kj[4 * m + 1], kj[4 * m + 2], kj[4 * m + 3]);
      Qs4[r * (DK / 4) + m * TPR + p] = MAKE_FLOAT4(qv[4 * m] * qinv, qv[4 * m + 1] * qinv, qv[4 * m + 2] * qinv,
                                                    qv[4 * m + 3] * qinv);
    }
    if (p == 0) {
      const int tt = c0 + (tv ? r : 0);
      const float xa = TO_FLOAT(a[tt * HV + hv]) + dtb;
      gs[r] = tv ? neg_a * (FMAX(xa, 0.0f) + LOG1P(EXP(-FABS(xa)))) : 0.0f;
      bs[r] = tv ? 1.0f / (1.0f + EXP(-TO_FLOAT(b[tt * HV + hv]))) : 0.0f;
    }
    for (int cc = p; cc < C; cc += TPR) {
      const int vr = TGID_X * BV + cc;
      Xs[r * (C + 1) + cc] = (tv && vr < DV) ? TO_FLOAT(v[(size_t)(c0 + r) * VS + VO + hv * DV + vr]) : 0.0f;
    }
  }
  BARRIER;
  if (tid < C) {
    float acc = 0.0f;
    for (int j = 0; j <= tid; ++j) acc += gs[j];
    gam[tid] = acc;
  }
  BARRIER;
  // 2. k_i.k_r -> A[i][r], and X[i][r] from k_i.S_r (unrolled: iterations are independent)
#pragma unroll 4
  for (int i = 0; i < C; ++i) {
    float kk = 0.0f, ks = 0.0f;
    for (int m = 0; m < NQ; ++m) {
      const float4 k4 = Ks4[i * (DK / 4) + m * TPR + p];
      kk += k4.x * kj[4 * m]; kk += k4.y * kj[4 * m + 1]; kk += k4.z * kj[4 * m + 2]; kk += k4.w * kj[4 * m + 3];
      ks += k4.x * s[4 * m]; ks += k4.y * s[4 * m + 1]; ks += k4.z * s[4 * m + 2]; ks += k4.w * s[4 * m + 3];
    }
    RED_KK
    RED_KS
    if (p == 0) {
      const float gi = gam[i];
      As[i * (C + 1) + r] = (r < i) ? bs[i] * EXP(gi - gam[r]) * kk : 0.0f;
      Xs[i * (C + 1) + r] = bs[i] * (Xs[i * (C + 1) + r] - EXP(gi) * ks);
    }
  }
  BARRIER;
  // 3. forward substitution (I + A) V' = X; column r (state row r) per thread, kept in registers
  if (p == 0) {
    float vc[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float acc = Xs[i * (C + 1) + r];
#pragma unroll
      for (int j = 0; j < i; ++j) acc -= As[i * (C + 1) + j] * vc[j];
      vc[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < C; ++i) Xs[i * (C + 1) + r] = vc[i];
  }
  BARRIER;
  // 4. q_i.k_r -> M[i][r] (j = r <= i), and the inter-chunk output e^{g_i} q_i.S_r -> As[i][r]
#pragma unroll 4
  for (int i = 0; i < C; ++i) {
    float qk = 0.0f, qs = 0.0f;
    for (int m = 0; m < NQ; ++m) {
      const float4 q4 = Qs4[i * (DK / 4) + m * TPR + p];
      qk += q4.x * kj[4 * m]; qk += q4.y * kj[4 * m + 1]; qk += q4.z * kj[4 * m + 2]; qk += q4.w * kj[4 * m + 3];
      qs += q4.x * s[4 * m]; qs += q4.y * s[4 * m + 1]; qs += q4.z * s[4 * m + 2]; qs += q4.w * s[4 * m + 3];
    }
    RED_QK
    RED_QS
    if (p == 0) {
      const float gi = gam[i];
      Ms[i * (C + 1) + r] = (r <= i) ? EXP(gi - gam[r]) * qk : 0.0f;
      As[i * (C + 1) + r] = EXP(gi) * qs;
    }
  }
  BARRIER;
  // 5. outputs of tokens i = p (mod TPR) for row r
  for (int i = p; i < n; i += TPR) {
    float acc = As[i * (C + 1) + r];
    for (int j = 0; j <= i; ++j) acc += Ms[i * (C + 1) + j] * Xs[j * (C + 1) + r];
    if (live) o[((size_t)(c0 + i) * HV + hv) * DV + row] = FROM_FLOAT(InT, acc);
  }
  // 6. carry the state to the end of the chunk
  const float gl = gam[C - 1];
  const float dl = EXP(gl);
  for (int e = 0; e < NE; ++e) s[e] *= dl;
#pragma unroll 4
  for (int j = 0; j < n; ++j) {
    const float w = EXP(gl - gam[j]) * Xs[j * (C + 1) + r];
    for (int m = 0; m < NQ; ++m) {
      const float4 k4 = Ks4[j * (DK / 4) + m * TPR + p];
      s[4 * m] += w * k4.x; s[4 * m + 1] += w * k4.y; s[4 * m + 2] += w * k4.z; s[4 * m + 3] += w * k4.w;
    }
  }
  BARRIER;  // the next chunk overwrites the tiles
}
FINAL_STORE
"""
)
for _v in ("kss", "qss", "kk", "ks", "qk", "qs"):
    _CHUNK = _CHUNK.replace(f"RED_{_v.upper()}", reduce_row(_v))

CHUNK = portable_kernel(
    name="gdn_chunk",
    input_names=INPUT_NAMES,
    output_names=["o", "state_out"],
    body=_CHUNK.replace("FINAL_STORE", store_state("state_out", "seq")),
    examples=recurrent_examples(False, 16),
)
CHUNK_INPLACE = portable_kernel(
    name="gdn_chunk_inplace",
    input_names=INPUT_NAMES,
    output_names=["o", "done"],
    body=_CHUNK.replace("FINAL_STORE", INPLACE_STORE),
    examples=recurrent_examples(False, 16, inplace=True),
)


def run_gdn(q, k, v, a, b, A_log, dt_bias, state_pool, layout: SeqLayout, *, candidates=False, chunk=None,
            init_value=None, tpr=None, heads=None, inplace=False):
    """Launch one GDN kernel over the packed batch. Returns (o, states[, all_states]) or None if the
    shapes are not covered. `chunk` forces (True) or forbids (False) the chunk kernel; tests poison the
    outputs through `init_value`; benchmarks try other lanes-per-row splits of the recurrence (`tpr`).
    heads=(Hk, dk, Hv, dv): q = k = v = the conv output [T, 2*Hk*dk + Hv*dv] (q | k | v channels), read
    where it lies -- slicing it instead would make MLX copy each slice to a contiguous array first.
    inplace: the new states are written into state_pool's rows; returns (o, done) (not with candidates)."""
    backend = gpu_backend()
    if heads is None:
        T, Hk, dk = q.shape
        Hv, dv = v.shape[1], v.shape[2]
        strides = [("QS", Hk * dk), ("KO", 0), ("VS", Hv * dv), ("VO", 0)]
    else:
        Hk, dk, Hv, dv = heads
        T = q.shape[0]
        if q.ndim != 2 or q.shape[1] != 2 * Hk * dk + Hv * dv:
            return None
        strides = [("QS", q.shape[1]), ("KO", Hk * dk), ("VS", q.shape[1]), ("VO", 2 * Hk * dk)]
    B = layout.num_seqs
    if backend is None or T == 0 or B == 0 or state_pool.dtype != mx.float32 or Hv % Hk:
        return None
    if v.dtype not in FLOATS or tpr_for(dk) == 0:
        return None
    dt = v.dtype
    q, k = (x if x.dtype == dt else x.astype(dt) for x in (q, k))
    a, b, A_log, dt_bias = (x if x.dtype in FLOATS else x.astype(mx.float32) for x in (a, b, A_log, dt_bias))
    longest = max(layout.q_len(i) for i in range(B))
    C = _chunk_fits(backend, dk)
    use_chunk = (longest > SELECT["gdn_chunk_min_t"] if chunk is None else chunk) and C and not candidates
    if (chunk and not use_chunk) or (inplace and candidates):
        return None
    tpr = tpr or (CHUNK_TPR if use_chunk else tpr_for(dk))
    if dk % (4 * tpr) or tpr > (8 if use_chunk else 32):
        return None
    bv = C if use_chunk else 128 // tpr
    if inplace:
        kern = CHUNK_INPLACE if use_chunk else RECURRENT_INPLACE
    else:
        kern = CHUNK if use_chunk else (RECURRENT_CAND if candidates else RECURRENT)
    tmpl = [("InT", dt), ("HK", Hk), ("HV", Hv), ("DK", dk), ("DV", dv), ("TPR", tpr), ("BV", bv)] + ([("C", C)] if use_chunk else [])
    tmpl += strides
    staged = None if use_chunk else staged_kernel(backend, dk, bv, longest, candidates, inplace)
    if staged is not None:  # the recurrence with a block of tokens read ahead (staged.py)
        kern = staged[0]
        tmpl.append(("TB", staged[1]))
    nt = bv * tpr
    nblk = -(-dv // bv)
    shapes = [(T, Hv, dv), (1,) if inplace else (B, Hv, dv, dk)] + ([(T, Hv, dv, dk)] if candidates else [])
    dtypes = [dt, mx.int32 if inplace else mx.float32] + ([mx.float32] if candidates else [])
    return kern(
        backend,
        inputs=[q, k, v, a, b, A_log, dt_bias, state_pool, layout.array("query_start_loc"),
                layout.array("state_rows")],
        output_shapes=shapes,
        output_dtypes=dtypes,
        grid=(nt * nblk, Hv, B),
        threadgroup=(nt, 1, 1),
        template=tmpl,
        init_value=init_value,
    )


def gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state_pool, layout: SeqLayout):
    out = run_gdn(q, k, v, a, b, A_log, dt_bias, state_pool, layout)
    return None if out is None else (out[0], out[1])


def gated_delta_packed_kernel(y, a, b, A_log, dt_bias, state_pool, layout: SeqLayout, heads, write_state=False):
    """-> (o, new states) or, with write_state (and SELECT allows it), (o, None): states written in place."""
    inplace = bool(write_state and SELECT["gdn_state_inplace"])
    out = run_gdn(y, y, y, a, b, A_log, dt_bias, state_pool, layout, heads=heads, inplace=inplace)
    return None if out is None else (out[0], None if inplace else out[1])


def gated_delta_candidates_kernel(q, k, v, a, b, A_log, dt_bias, state_pool, layout: SeqLayout):
    out = run_gdn(q, k, v, a, b, A_log, dt_bias, state_pool, layout, candidates=True)
    return None if out is None else tuple(out)


def gated_delta_packed_candidates_kernel(y, a, b, A_log, dt_bias, state_pool, layout: SeqLayout, heads):
    out = run_gdn(y, y, y, a, b, A_log, dt_bias, state_pool, layout, heads=heads, candidates=True)
    return None if out is None else tuple(out)
