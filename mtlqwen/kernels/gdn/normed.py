"""The GDN recurrence with the gated RMSNorm of its output fused in (decode and short segments only).

Why: at batch 1 a decode step is host-bound, and each custom-kernel launch costs ~10 us of host time
(benchmarks/decode_profile.md). The GDN layer's plain path ran the recurrence, then `gated_rms_norm` over
each value head's dv outputs; here one launch does both:
    o_normed[t, hv, :] = rms_norm(o[t, hv, :]) * norm_w * silu(z[t, hv, :])
with the roundings of the two ops it replaces (norms/reference.py: gated_rms_norm_ref): o rounded to the activation
dtype, normalised in fp32, rounded, times w, times silu(z), rounded.

Design: the norm needs all dv outputs of a head, but `gdn_recurrent` spreads a head over dv / BV
threadgroups (BV = 128 / TPR rows each). Two ways to bring a head together:
  - one threadgroup per (sequence, value head), BV >= DV rows, and a threadgroup reduction of the
    squares per token (two barriers a token);
  - keep the blocks, park the unnormalised o, count finished blocks with an atomic and let the last
    block of a head normalise it (as qmatmul/residual.py does with the portability layer's DEVICE_FENCE /
    ATOMIC_ADD_U32): a counter that stays zero between launches, a parked copy of o, and a serial
    epilogue in one threadgroup per head -- more traffic and latency than a head-sized threadgroup.
We take the first. What limits it is registers, not the 1024-thread cap: without __launch_bounds__ (MLX
writes the CUDA signature) a block must fit the SM's 65536 registers at whatever count the compiler chose,
and `gdn_recurrent` at dk = 128 takes 95 registers at TPR = 8 and 122 at TPR = 4 (ptxas -v, sm_90, CUDA
13.0), so BV = DV = 128 at TPR = 8 (1024 threads) could not launch. Hence at most MAX_THREADS = 512
threads (up to 128 registers each) and at most MAX_NE = 32 state elements a thread, and each token's raw
k and q staged once in threadgroup memory (every row of the head reads the same key head) instead of
NE-element copies per thread: 84-91 registers at dk = dv = 128, TPR = 4 (a first version reading k and q
from device memory took exactly 128). The prediction is (S k) / |k| and the output (S q) / |q|: the
reference's products in another order, so fp32 rounding differs in the last bits. Shapes it does not
cover return None, and the op then runs the two kernels one after the other.

Only the token-by-token recurrence: a segment longer than SELECT["gdn_chunk_min_t"] goes to the chunk
kernel and the separate norm (prefill is not host-bound).
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS, eps_array
from ..portable import KernelExample
from ..selection import SELECT
from ..seqs import SeqLayout
from .pieces import (GATES, INPUT_NAMES, PROLOGUE, SHARED_LIMIT, STAGE_EXAMPLE, declare_variants, reduce_row,
                     stage_block, with_block)

MAX_THREADS = 512  # threads a threadgroup: 128 registers each on NVIDIA (see the module docstring)
MAX_NE = 32  # state elements a thread (dk / TPR): TPR = 2 at dk = 128 took 255 registers in gdn_recurrent

# One token's step, shared by both bodies: decay and beta defined, KQ its raw k | q row, VV its v at this
# thread's row, ZV_EARLY / ZV_LATE where z is read, PART the partial sums of squares it reduces through.
_STEP = """  // one pass over k: decay the state, |k|^2, and S k (divided by |k| below)
  float kss = 0.0f, pred = 0.0f;
  for (int e = 0; e < NE; ++e) {
    const float kv = KQ[((e / 4) * TPR + p) * 4 + e % 4];
    kss += kv * kv;
    s[e] *= decay;
    pred += s[e] * kv;
  }
  RED_KSS
  RED_PRED
  const float kinv = RSQRT(kss + 1e-6f);
  const float vv = VV;
  const float dkn = beta * (vv - pred * kinv) * kinv;  // delta / |k|: S += delta * k / |k|
  float out = 0.0f, qss = 0.0f;
  for (int e = 0; e < NE; ++e) {
    const int c = ((e / 4) * TPR + p) * 4 + e % 4;
    s[e] += dkn * KQ[c];
    const float qv = KQ[DK + c];
    out += s[e] * qv;
    qss += qv * qv;
  }
  RED_OUT
  RED_QSS
  // o as the unfused op returns it (activation dtype), then its head's mean square over DV rows
  const float ov = TO_FLOAT(FROM_FLOAT(InT, out * RSQRT(qss + 1e-6f) * q_scale));
  float ss = SIMD_SUM((live && p == 0) ? ov * ov : 0.0f);
  ZV_EARLY
  if (LANE == 0) PART[SIMD_ID] = ss;
  BARRIER;
  ss = 0.0f;
  for (int j = 0; j < NSG; ++j) ss += PART[j];
  if (live && p == 0) {
    // norms.gated_rms_norm_ref's order: normalise, round, times w, times silu(z), round
    const size_t oi = ((size_t)t * HV + hv) * DV + row;
    const float yv = TO_FLOAT(FROM_FLOAT(InT, ov * RSQRT(ss / (float)DV + eps_v))) * nw;
    ZV_LATE
    o[oi] = FROM_FLOAT(InT, yv * (zv / (1.0f + EXP(-zv))));
  }
  CAND_STORE
"""


def _reduced(body: str) -> str:
    return (body.replace("RED_KSS", reduce_row("kss")).replace("RED_PRED", reduce_row("pred"))
            .replace("RED_OUT", reduce_row("out")).replace("RED_QSS", reduce_row("qss")))


# Threadgroup = BV * TPR threads (a multiple of 32) over the head's DV rows (rows >= DV: not live).
# s: this thread's slice of its state row (prologue); part: one partial sum of squares per SIMD group,
# rewritten only after the next token's first barrier.
_BODY = _reduced(
    PROLOGUE
    + """
constexpr int NSG = (BV * TPR) / 32;
SHARED float part[32];    // one partial sum of squares per SIMD group
SHARED float kq[2 * DK];  // this token's raw k | q of the key head: every row of the group reads them
const float eps_v = eps[0];
const float nw = live ? TO_FLOAT(norm_w[row]) : 0.0f;
for (int t = t0; t < t1; ++t) {
  const size_t kb = (size_t)t * QS + hk * DK;
  for (int c = tid; c < 2 * DK; c += BV * TPR) kq[c] = TO_FLOAT(c < DK ? k[kb + KO + c] : q[kb + c - DK]);
  BARRIER;  // also: every thread is past the previous token's reads of kq and part
""" + GATES + _STEP.replace("KQ", "kq").replace("VV", "live ? TO_FLOAT(v[(size_t)t * VS + VO + hv * DV + row]) : 0.0f")
    .replace("ZV_EARLY", "").replace("ZV_LATE", "const float zv = TO_FLOAT(z[oi]);").replace("PART", "part")
    + "}\nFINAL_STORE\n"
)

# The same with TB tokens staged a block: each token of the body above waits on its own device reads (k | q,
# then the gates, v and z) between barriers, so a segment's steps run at device-read latency. Here the whole
# threadgroup reads a block's k | q, v and z rows and gates into threadgroup memory at once, one barrier, then
# steps through it on shared reads; part alternates by token parity, so a token has one barrier.
_STAGED_BODY = _reduced(
    PROLOGUE
    + """
constexpr int NSG = (BV * TPR) / 32;
constexpr int NT = BV * TPR;
SHARED float part[2][32];      // by token parity: token t + 1 writes while no thread reads token t - 1's
SHARED float kqs[TB][2 * DK];  // the block's raw k | q of the key head
SHARED float vzs[TB][2 * BV];  // the block's v | z of the head's rows
SHARED float gds[TB];          // the block's decays
SHARED float gbs[TB];          // and betas
const float eps_v = eps[0];
const float nw = live ? TO_FLOAT(norm_w[row]) : 0.0f;
""" + stage_block("((TG_PTR float*)kqs)") + """  for (int c = tid; c < nb * DV; c += NT) {
    const int jt = c / DV;
    const int rr = c - jt * DV;
    const size_t tt = (size_t)(tb + jt);
    vzs[jt][rr] = TO_FLOAT(v[tt * VS + VO + hv * DV + rr]);
    vzs[jt][BV + rr] = TO_FLOAT(z[(tt * HV + hv) * DV + rr]);
  }
  // every thread is past the previous block's shared reads: its last token read them before its barrier
  BARRIER;
  for (int jt = 0; jt < nb; ++jt) {
    const int t = tb + jt;
    const float decay = gds[jt];
    const float beta = gbs[jt];
""" + _STEP.replace("KQ", "kqs[jt]").replace("VV", "live ? vzs[jt][row] : 0.0f")
    .replace("ZV_EARLY", "const float zv = live ? vzs[jt][BV + row] : 0.0f;").replace("ZV_LATE", "")
    .replace("PART", "part[t & 1]")
    + "  }\n}\nFINAL_STORE\n"
)

_IN_NORMED = INPUT_NAMES + ["z", "norm_w", "eps"]


def fused_tpr(dk: int, dv: int) -> int:
    """Lanes per state row: the most (<= 8) that keeps whole float4 chunks a lane, the head within
    MAX_THREADS threads and at most MAX_NE state elements a thread; 0 when none does."""
    for t in (8, 4, 2, 1):
        if dk % (4 * t) == 0 and dv * t <= MAX_THREADS and dk // t <= MAX_NE:
            return t
    return 0


def _geometry(dk: int, dv: int) -> tuple[int, int]:
    """(TPR, BV): BV rows cover DV, padded so the threadgroup is whole SIMD groups."""
    tpr = fused_tpr(dk, dv)
    nt = -(-dv * tpr // 32) * 32 if tpr else 0
    return tpr, (nt // tpr if tpr else 0)


def _examples(inplace: bool) -> list[KernelExample]:
    """Qwen3.5-9B's GDN in bf16 with an fp32 norm weight, and a small fp32 shape with r = 3, dk != dv,
    a padded last SIMD group (dv * TPR = 48 * 8) and constant-space gate vectors."""
    out = []
    for dt, wdt, T, B, Hk, Hv, dk, dv in ((mx.bfloat16, mx.float32, 8, 2, 16, 32, 128, 128),
                                          (mx.float32, mx.float32, 7, 2, 2, 6, 32, 48)):
        tpr, bv = _geometry(dk, dv)
        C = 2 * Hk * dk + Hv * dv
        shapes = [(T, C), (T, C), (T, C), (T, Hv), (T, Hv), (Hv,), (Hv,), (3, Hv, dv, dk), (B + 1,), (B,),
                  (T, Hv * dv), (dv,), (1,)]
        dts = [dt] * 5 + [mx.float32, dt, mx.float32, mx.int32, mx.int32, dt, wdt, mx.float32]
        tmpl = [("InT", dt), ("HK", Hk), ("HV", Hv), ("DK", dk), ("DV", dv), ("TPR", tpr), ("BV", bv),
                ("QS", C), ("KO", Hk * dk), ("VS", C), ("VO", 2 * Hk * dk)]
        out.append(KernelExample(list(zip(dts, shapes)), [dt, mx.int32 if inplace else mx.float32], tmpl))
    return out


def _variant_examples(cand: bool, inplace: bool) -> list[KernelExample]:
    if cand:  # one more output: every token's state
        return [KernelExample(e.inputs, e.outputs + [mx.float32], e.template) for e in _examples(False)]
    return _examples(inplace)


# The candidates kernel is a verification's GDN layer: the normed output and the state after every token (the
# candidates commit reads them), as `gdn_recurrent_cand` then `gated_rms_norm` return them; the pool is only read.
NORMED, NORMED_INPLACE, NORMED_CAND = declare_variants("gdn_recurrent_normed", _IN_NORMED, _BODY, _variant_examples)
NORMED_STAGED, NORMED_STAGED_INPLACE, NORMED_STAGED_CAND = declare_variants(
    "gdn_recurrent_normed_staged", _IN_NORMED, _STAGED_BODY,
    lambda cand, inplace: with_block(_variant_examples(cand, inplace), STAGE_EXAMPLE))


def stage_tokens(backend: str, dk: int, bv: int, longest: int) -> int:
    """Tokens the staged body reads a block (SELECT["gdn_normed_stage"]: one instantiation whatever the segments),
    or 0 for the unstaged body: the row off, decode (one token a sequence: nothing to read ahead), or a block whose
    staging would not fit the back-end's threadgroup memory."""
    tb = SELECT["gdn_normed_stage"]
    if tb < 1 or longest < 2:
        return 0
    return tb if 4 * (tb * (2 * dk + 2 * bv + 2) + 64) <= SHARED_LIMIT[backend] else 0


def run_gdn_normed(y, z, norm_w, eps: float, a, b, A_log, dt_bias, state_pool, layout: SeqLayout,
                   heads: tuple[int, int, int, int], inplace: bool = False, init_value=None, candidates: bool = False):
    """y [T, 2*Hk*dk + Hv*dv] (the conv output, q | k | v channels, read where they lie), z [T, Hv*dv]
    (any shape of that size), norm_w [dv] -> (o_normed [T, Hv*dv] in y's dtype, new states [B, Hv, dv, dk]
    fp32), or with inplace (o_normed, done [1]) after writing the states into state_pool's rows, or with
    candidates (o_normed, new states, the state after every token [T, Hv, dv, dk] fp32). None when not
    covered: a segment longer than SELECT["gdn_chunk_min_t"] or a nonzero SELECT["gdn_normed_max_t"], a head shape
    past the register budget, dtypes."""
    backend = gpu_backend()
    Hk, dk, Hv, dv = heads
    T, B = y.shape[0], layout.num_seqs
    tpr, bv = _geometry(dk, dv)
    if (backend is None or T == 0 or B == 0 or not tpr or Hv % Hk or state_pool.dtype != mx.float32
            or y.ndim != 2 or y.shape[1] != 2 * Hk * dk + Hv * dv or y.dtype not in FLOATS
            or z.size != T * Hv * dv or z.dtype not in FLOATS or norm_w.shape != (dv,)):
        return None
    longest = max(layout.q_len(i) for i in range(B))
    cap = SELECT["gdn_normed_max_t"]
    if longest > SELECT["gdn_chunk_min_t"] or 0 < cap < longest or (inplace and candidates):
        return None
    a, b, A_log, dt_bias, norm_w = (x if x.dtype in FLOATS else x.astype(mx.float32)
                                    for x in (a, b, A_log, dt_bias, norm_w))
    C = y.shape[1]
    tmpl = [("InT", y.dtype), ("HK", Hk), ("HV", Hv), ("DK", dk), ("DV", dv), ("TPR", tpr), ("BV", bv),
            ("QS", C), ("KO", Hk * dk), ("VS", C), ("VO", 2 * Hk * dk)]
    tb = stage_tokens(backend, dk, bv, longest)
    if tb:
        tmpl.append(("TB", tb))
        kern = NORMED_STAGED_INPLACE if inplace else NORMED_STAGED_CAND if candidates else NORMED_STAGED
    else:
        kern = NORMED_INPLACE if inplace else NORMED_CAND if candidates else NORMED
    return kern(
        backend,
        inputs=[y, y, y, a, b, A_log, dt_bias, state_pool, layout.array("query_start_loc"),
                layout.array("state_rows"), z if z.shape == (T, Hv * dv) else z.reshape(T, Hv * dv), norm_w,
                eps_array(eps)],
        output_shapes=[(T, Hv * dv), (1,) if inplace else (B, Hv, dv, dk)] + ([(T, Hv, dv, dk)] if candidates else []),
        output_dtypes=[y.dtype, mx.int32 if inplace else mx.float32] + ([mx.float32] if candidates else []),
        grid=(bv * tpr, Hv, B),
        threadgroup=(bv * tpr, 1, 1),
        template=tmpl,
        init_value=init_value,
    )


def gated_delta_packed_normed_kernel(y, z, norm_w, eps, a, b, A_log, dt_bias, state_pool, layout: SeqLayout,
                                     heads, write_state=False):
    """-> (o_normed, new states) or, with write_state and SELECT["gdn_state_inplace"], (o_normed, None):
    the states were written into the pool in place."""
    inplace = bool(write_state and SELECT["gdn_state_inplace"])
    out = run_gdn_normed(y, z, norm_w, eps, a, b, A_log, dt_bias, state_pool, layout, heads, inplace=inplace)
    return None if out is None else (out[0], None if inplace else out[1])


def gated_delta_packed_candidates_normed_kernel(y, z, norm_w, eps, a, b, A_log, dt_bias, state_pool,
                                                layout: SeqLayout, heads):
    """-> (o_normed, new states, all states) in one launch, or None where not covered."""
    out = run_gdn_normed(y, z, norm_w, eps, a, b, A_log, dt_bias, state_pool, layout, heads, candidates=True)
    return None if out is None else tuple(out)
