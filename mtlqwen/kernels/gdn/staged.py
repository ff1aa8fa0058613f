"""The GDN recurrence with a block of tokens staged in threadgroup memory (segments of 2+ tokens).

Why: `gdn_recurrent` (kernels.py) reads each token's k and q pieces, gates and v from device memory inside its
token loop, so every token waits about one device-read latency whatever its arithmetic: 4,096 tokens at one
sequence take 2.2 ms a layer, ~0.54 us a token (benchmarks/kernels_gdn.md). Here a threadgroup reads a block of
TB tokens at once (one latency a block), normalises each token's k and q once (a SIMD group a vector, where every
row of gdn_recurrent reduced them again), and steps through the block with shared reads and no barrier.

Same geometry and outputs as gdn_recurrent: a threadgroup owns (sequence, value head, BV rows), TPR lanes a row.
The prediction is S (k / |k|) and the output S (q q_scale / |q|), as the reference; the norms' sums run in
another order (fp32, last bits). Selection row `gdn_recurrent_stage` (TB; 0 = off).
"""

from __future__ import annotations

from ..selection import SELECT
from .pieces import (INPUT_NAMES, PROLOGUE, SHARED_LIMIT, STAGE_EXAMPLE, declare_variants, recurrent_examples,
                     reduce_row, stage_block, with_block)

_BODY = (
    PROLOGUE
    + """
constexpr int NT = BV * TPR;
constexpr int NSG = NT / 32;
SHARED float4 kq4[TB * DK / 2];  // the block's k / |k| | q q_scale / |q|, token j's at j * DK / 2 (float4s)
SHARED float vs[TB * BV];        // the block's v at this threadgroup's rows
SHARED float gds[TB];            // decays
SHARED float gbs[TB];            // betas
TG_PTR float* kqf = (TG_PTR float*)kq4;
""" + stage_block("kqf") + """  for (int c = tid; c < nb * BV; c += NT) {
    const int jt = c / BV;
    const int rg = TGID_X * BV + (c - jt * BV);
    vs[c] = rg < DV ? TO_FLOAT(v[(size_t)(tb + jt) * VS + VO + hv * DV + rg]) : 0.0f;
  }
  BARRIER;
  // L2-normalise (eps on the sum, §2.5) each of the block's 2 nb vectors once: vector u is k (even) or q (odd)
  for (int u = SIMD_ID; u < 2 * nb; u += NSG) {
    float ss = 0.0f;
    for (int c = LANE; c < DK; c += 32) ss += kqf[u * DK + c] * kqf[u * DK + c];
    ss = SIMD_SUM(ss);
    const float inv = RSQRT(ss + 1e-6f) * ((u & 1) ? q_scale : 1.0f);
    for (int c = LANE; c < DK; c += 32) kqf[u * DK + c] *= inv;
  }
  BARRIER;
  for (int jt = 0; jt < nb; ++jt) {
    const int t = tb + jt;
    const float decay = gds[jt];
    float pred = 0.0f;
    for (int m = 0; m < NQ; ++m) {
      const float4 k4 = kq4[jt * (DK / 2) + m * TPR + p];
      s[4 * m] *= decay; s[4 * m + 1] *= decay; s[4 * m + 2] *= decay; s[4 * m + 3] *= decay;
      pred += s[4 * m] * k4.x + s[4 * m + 1] * k4.y + s[4 * m + 2] * k4.z + s[4 * m + 3] * k4.w;
    }
    RED_PRED
    const float delta = gbs[jt] * ((live ? vs[jt * BV + r] : 0.0f) - pred);
    float out = 0.0f;
    for (int m = 0; m < NQ; ++m) {
      const float4 k4 = kq4[jt * (DK / 2) + m * TPR + p];
      const float4 q4 = kq4[jt * (DK / 2) + DK / 4 + m * TPR + p];
      s[4 * m] += delta * k4.x; s[4 * m + 1] += delta * k4.y; s[4 * m + 2] += delta * k4.z; s[4 * m + 3] += delta * k4.w;
      out += s[4 * m] * q4.x + s[4 * m + 1] * q4.y + s[4 * m + 2] * q4.z + s[4 * m + 3] * q4.w;
    }
    RED_OUT
    if (live && p == 0) o[((size_t)t * HV + hv) * DV + row] = FROM_FLOAT(InT, out);
    CAND_STORE
  }
  BARRIER;  // the next block overwrites the tiles
}
FINAL_STORE
"""
).replace("RED_PRED", reduce_row("pred")).replace("RED_OUT", reduce_row("out"))

STAGED, STAGED_INPLACE, STAGED_CAND = declare_variants(
    "gdn_recurrent_staged", INPUT_NAMES, _BODY,
    lambda cand, inplace: with_block(recurrent_examples(cand, None, inplace), STAGE_EXAMPLE))


def staged_kernel(backend: str, dk: int, bv: int, longest: int, candidates: bool, inplace: bool):
    """(the staged twin of the recurrent kernel a call would launch, its TB) where SELECT["gdn_recurrent_stage"]
    is on, a segment has 2+ tokens (decode keeps gdn_recurrent: nothing to read ahead) and the block fits the
    back-end's threadgroup memory; else None."""
    tb = SELECT["gdn_recurrent_stage"]
    if tb < 1 or longest < 2 or 4 * (tb * (2 * dk + bv + 2)) > SHARED_LIMIT[backend]:
        return None
    return (STAGED_INPLACE if inplace else STAGED_CAND if candidates else STAGED), tb
