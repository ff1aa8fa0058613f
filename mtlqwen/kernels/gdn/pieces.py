"""Text the GDN kernels share (kernels.py, normed.py, staged.py): the thread -> state-row mapping and the state
load, the gates, the stores of a thread's state slice, the inputs every variant takes."""

from __future__ import annotations

SHARED_LIMIT = {"cuda": 48 * 1024, "metal": 32 * 1024}  # static threadgroup memory a kernel may declare


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
    [t0, t1), nb of them, and the block's raw k | q of the key head read into threadgroup memory by the NT threads:
    token jt's at dst[jt * 2 * DK], k then q. The caller reads the rest, closes with a barrier, steps, and closes
    the loop."""
    return """
for (int tb = t0; tb < t1; tb += TB) {
  const int nb = (t1 - tb < TB) ? t1 - tb : TB;
  for (int c = tid; c < nb * 2 * DK; c += NT) {
    const int jt = c / (2 * DK);
    const int cc = c - jt * (2 * DK);
    const size_t kb = (size_t)(tb + jt) * QS + hk * DK;
    DST[c] = TO_FLOAT(cc < DK ? k[kb + KO + cc] : q[kb + cc - DK]);
  }
""".replace("DST", dst)

