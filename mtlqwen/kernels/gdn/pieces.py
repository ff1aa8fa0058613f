"""Text the GDN kernels share (kernels.py, normed.py, staged.py): the thread -> state-row mapping and the state
load, the gates, the stores of a thread's state slice, the inputs every variant takes, the recurrent and chunk
kernels' example instantiations."""

from __future__ import annotations

import mlx.core as mx

from ..portable import KernelExample, portable_kernel

SHARED_LIMIT = {"cuda": 48 * 1024, "metal": 32 * 1024}  # static threadgroup memory a kernel may declare
STAGE_EXAMPLE = 8  # the block TB the staged kernels' examples compile with


def tpr_for(dk: int) -> int:
    """Lanes per state row in the recurrent kernels: the most that keeps whole float4 chunks per lane."""
    for t in (8, 4, 2, 1):
        if dk % (4 * t) == 0:
            return t
    return 0


def reduce_row(var: str) -> str:
    """Sum `var` over the TPR consecutive lanes that share a state row."""
    return f"for (int _m = TPR / 2; _m > 0; _m >>= 1) {var} += SIMD_SHUFFLE_XOR({var}, _m);"


# Every kernel: thread -> (row r of the block, part p of the row); element e of a thread is
# column COL(e) = ((e/4)*TPR + p)*4 + e%4, i.e. float4 chunk (e/4)*TPR + p.
PROLOGUE = """
constexpr int NE = DK / TPR;
constexpr int NQ = NE / 4;
const int tid = TID_X;
const int r = tid / TPR;
const int p = tid % TPR;
const int hv = TGID_Y;
const int seq = TGID_Z;
const int hk = hv / (HV / HK);  // value head j reads key head j // r (§2.6)
const int row = TGID_X * BV + r;
const bool live = row < DV;
const int t0 = qsl[seq];
const int t1 = qsl[seq + 1];
const float neg_a = -EXP(TO_FLOAT(A_log[hv]));
const float dtb = TO_FLOAT(dt_bias[hv]);
const float q_scale = RSQRT((float)DK);
float s[NE];  // this thread's slice of state row `row`, fp32
if (live) {
  CONST_PTR float4* src4 = (CONST_PTR float4*)(state_pool + (((size_t)rows[seq] * HV + hv) * DV + row) * DK);
  for (int m = 0; m < NQ; ++m) {
    const float4 x4 = src4[m * TPR + p];
    s[4 * m] = x4.x; s[4 * m + 1] = x4.y; s[4 * m + 2] = x4.z; s[4 * m + 3] = x4.w;
  }
} else {
  for (int e = 0; e < NE; ++e) s[e] = 0.0f;
}
"""


def store_state(dst: str, index: str) -> str:
    """Write this thread's slice of the state row to `dst` at state index `index` ([..., DV, DK])."""
    return f"""
if (live) {{
  DEVICE_PTR float4* dst4 = (DEVICE_PTR float4*)({dst} + (((size_t)({index}) * HV + hv) * DV + row) * DK);
  for (int m = 0; m < NQ; ++m) dst4[m * TPR + p] = MAKE_FLOAT4(s[4 * m], s[4 * m + 1], s[4 * m + 2], s[4 * m + 3]);
}}"""


# token t's decay and beta
GATES = """  // gates in fp32 (§2.4): softplus as max(x,0) + log1p(exp(-|x|)), like logaddexp(x, 0)
  const float xa = TO_FLOAT(a[t * HV + hv]) + dtb;
  const float decay = EXP(neg_a * (FMAX(xa, 0.0f) + LOG1P(EXP(-FABS(xa)))));
  const float beta = 1.0f / (1.0f + EXP(-TO_FLOAT(b[t * HV + hv])));
"""

# In-place variant: the final state goes straight into the pool rows it was read from (each threadgroup
# owns its rows, read in the prologue, written here), so no scatter has to copy the pool; `done` is the
# output MLX needs. Only where nothing else reads that pool in the same evaluation (GDNMixer's plain path).
INPLACE_STORE = store_state("((DEVICE_PTR float*)state_pool)", "rows[seq]") + """
if (TGID_X == 0 && TGID_Y == 0 && TGID_Z == 0 && TID_X == 0) done[0] = 1;"""

INPUT_NAMES = ["q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool", "qsl", "rows"]


def stage_block(dst: str) -> str:
    """The staged bodies' block loop (normed.py, staged.py), opened: blocks of up to TB tokens of the segment
    [t0, t1), nb of them; the NT threads read the block's raw k | q of the key head into threadgroup memory
    (token jt's at dst[jt * 2 * DK], k then q) and its decays and betas into the caller's gds[TB], gbs[TB]. The
    caller reads the rest, closes with a barrier, steps, and closes the loop."""
    return ("""
for (int tb = t0; tb < t1; tb += TB) {
  const int nb = (t1 - tb < TB) ? t1 - tb : TB;
  for (int c = tid; c < nb * 2 * DK; c += NT) {
    const int jt = c / (2 * DK);
    const int cc = c - jt * (2 * DK);
    const size_t kb = (size_t)(tb + jt) * QS + hk * DK;
    DST[c] = TO_FLOAT(cc < DK ? k[kb + KO + cc] : q[kb + cc - DK]);
  }
  for (int jg = tid; jg < nb; jg += NT) {
    const int t = tb + jg;
""" + GATES + """    gds[jg] = decay;
    gbs[jg] = beta;
  }
""").replace("DST", dst)


def recurrent_examples(cand: bool, chunk: int | None, inplace: bool = False) -> list[KernelExample]:
    """Qwen3.5-9B in bf16, and a small fp32 shape with r = 3, dk != dv, a tiny (constant) gate vector."""
    out = []
    for dt, T, B, Hk, Hv, dk, dv in ((mx.bfloat16, 8, 2, 16, 32, 128, 128), (mx.float32, 7, 2, 2, 6, 32, 48)):
        tpr = 4 if chunk else tpr_for(dk)
        shapes = [(T, Hk, dk), (T, Hk, dk), (T, Hv, dv), (T, Hv), (T, Hv), (Hv,), (Hv,), (3, Hv, dv, dk), (B + 1,), (B,)]
        dts = [dt, dt, dt, dt, dt, mx.float32, dt, mx.float32, mx.int32, mx.int32]
        tmpl = [("InT", dt), ("HK", Hk), ("HV", Hv), ("DK", dk), ("DV", dv), ("TPR", tpr)]
        tmpl += [("BV", chunk or 128 // tpr)] + ([("C", chunk)] if chunk else [])
        tmpl += [("QS", Hk * dk), ("KO", 0), ("VS", Hv * dv), ("VO", 0)]
        outs = [dt, mx.int32 if inplace else mx.float32] + ([mx.float32] if cand else [])
        out.append(KernelExample(list(zip(dts, shapes)), outs, tmpl))
    return out


def declare_variants(name: str, input_names: list[str], body: str, examples) -> tuple:
    """The three kernels of a body with CAND_STORE / FINAL_STORE in it: `name` returns the final states,
    `name`_inplace writes them into the pool rows it read (and `done`), `name`_cand returns every token's state
    too. examples(cand, inplace) -> that kernel's KernelExamples. Returns (states, in place, candidates)."""
    final = store_state("state_out", "seq")
    states = portable_kernel(name=name, input_names=input_names, output_names=["o", "state_out"],
                             body=body.replace("CAND_STORE", "").replace("FINAL_STORE", final),
                             examples=examples(False, False))
    inplace = portable_kernel(name=f"{name}_inplace", input_names=input_names, output_names=["o", "done"],
                              body=body.replace("CAND_STORE", "").replace("FINAL_STORE", INPLACE_STORE),
                              examples=examples(False, True))
    cand = portable_kernel(name=f"{name}_cand", input_names=input_names, output_names=["o", "state_out", "all_states"],
                           body=body.replace("CAND_STORE", store_state("all_states", "t")).replace("FINAL_STORE", final),
                           examples=examples(True, False))
    return states, inplace, cand


def with_block(examples: list[KernelExample], tb: int) -> list[KernelExample]:
    """A staged kernel's examples: its unstaged twin's with the block TB."""
    return [KernelExample(e.inputs, e.outputs, e.template + [("TB", tb)]) for e in examples]

