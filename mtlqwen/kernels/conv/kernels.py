"""Causal depthwise conv1d + SiLU over the packed GDN qkv channels, with the K-1 row conv state
(docs/qwen35.md §2.2), as one portable kernel.

Grid rows (the flat grid is [rows, CHP]) 0..T-1 are output tokens; rows T..T+B(K-1)-1 write the new
states, so one launch produces both outputs. A token finds its sequence by binary search over query_start_loc (B is small), and rows
before the sequence start come from its pool row. Old state values pass through x's dtype, as in the
reference (it concatenates `pool.astype(x.dtype)` with x).
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, portable_kernel
from ..selection import SELECT
from ..seqs import SeqLayout

TG = 256  # threads along the channels

# shared by both kernels: token rows u < T find their sequence lo (binary search over query_start_loc)
SEQ_OF_ROW = """\
const int T = qsl[NSEQ];
constexpr int KS = K - 1;
if (c < CH) {
  if (u < T) {
    int lo = 0, hi = NSEQ - 1;  // the sequence of packed row u: last lo with qsl[lo] <= u
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (qsl[mid] <= u) lo = mid; else hi = mid - 1;
    }
"""

_BODY = """
const int NSEQ = qsl_shape[0] - 1;
const int c = GID_X % CHP;  // channel (CHP = CH padded to the threadgroup width)
const int u = GID_X / CHP;  // output token, or a state row past T
""" + SEQ_OF_ROW + """    const int st = qsl[lo];
    const size_t prow = (size_t)rows[lo] * KS;
    float acc = 0.0f;
    for (int j = 0; j < K; ++j) {
      const int srcr = u - KS + j;  // packed row; before `st` it is state row KS + (srcr - st)
      const float xv = srcr >= st ? TO_FLOAT(x[(size_t)srcr * CH + c])
                                  : TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT(pool[(prow + KS + srcr - st) * CH + c])));
      acc += TO_FLOAT(w[c * K + j]) * xv;
    }
    y[(size_t)u * CH + c] = FROM_FLOAT(XT, acc / (1.0f + EXP(-acc)));
  } else if (u < T + NSEQ * KS) {
    // new state row i of sequence sq = row L + i of concat(old state, x[seq]) (L = its new tokens)
    const int sq = (u - T) / KS;
    const int i = (u - T) % KS;
    const int st = qsl[sq];
    const int idx = qsl[sq + 1] - st + i;
    const float xv = idx >= KS ? TO_FLOAT(x[(size_t)(st + idx - KS) * CH + c])
                               : TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT(pool[((size_t)rows[sq] * KS + idx) * CH + c])));
    state[((size_t)sq * KS + i) * CH + c] = FROM_FLOAT(PT, xv);
  }
}
"""


# In-place variant: the new states go straight into the pool rows (rows[seq]) instead of a `state` output
# for the caller's scatter (which on the GPU copies the pool: MLX keeps kernel inputs alive). A pool row is
# both read (old state) and written (new state), so exactly one thread touches each (sequence, channel)
# element of it: grid row T + sq is sequence sq's thread, which reads the old state into registers,
# computes the outputs of the sequence's first min(L, K-1) tokens (the only ones whose window reaches into
# the old state), then writes the new state. Token rows u < T compute the other tokens, from x alone. Two
# sequences of a batch never share a pool row (a slot runs one sequence; padding owns a scratch slot).
# `done` is the one-element output of the in-place GDN / KV kernels; readers are ordered by data
# dependencies only, so the caller must make every later reader of the pool depend on this launch.
_INPLACE_BODY = """
const int NSEQ = qsl_shape[0] - 1;
const int c = GID_X % CHP;
const int u = GID_X / CHP;  // output token, or T + the sequence whose state this thread carries
""" + SEQ_OF_ROW + """    if (u - qsl[lo] >= KS) {  // the window lies in the new tokens: no pool read
      float acc = 0.0f;
      for (int j = 0; j < K; ++j) acc += TO_FLOAT(w[c * K + j]) * TO_FLOAT(x[(size_t)(u - KS + j) * CH + c]);
      y[(size_t)u * CH + c] = FROM_FLOAT(XT, acc / (1.0f + EXP(-acc)));
    }
  } else if (u < T + NSEQ) {
    const int sq = u - T;
    const int st = qsl[sq];
    const int L = qsl[sq + 1] - st;
    DEVICE_PTR PT* prow = (DEVICE_PTR PT*)pool + (size_t)rows[sq] * KS * CH + c;
    float old[KS];  // through x's dtype, as the reference concatenates pool.astype(x.dtype) with x
    for (int i = 0; i < KS; ++i) old[i] = TO_FLOAT(FROM_FLOAT(XT, TO_FLOAT(prow[(size_t)i * CH])));
    for (int j = 0; j < KS && j < L; ++j) {  // row j + m of concat(old state, x[seq]) is tap m of token j
      float acc = 0.0f;
      for (int m = 0; m < K; ++m) {
        const float xv = j + m < KS ? old[j + m] : TO_FLOAT(x[(size_t)(st + j + m - KS) * CH + c]);
        acc += TO_FLOAT(w[c * K + m]) * xv;
      }
      y[(size_t)(st + j) * CH + c] = FROM_FLOAT(XT, acc / (1.0f + EXP(-acc)));
    }
    for (int i = 0; i < KS; ++i) {  // new state row i = row L + i of concat(old state, x[seq])
      const float xv = L + i < KS ? old[L + i] : TO_FLOAT(x[(size_t)(st + L + i - KS) * CH + c]);
      prow[(size_t)i * CH] = FROM_FLOAT(PT, xv);
    }
  }
}
if (GID_X == 0) done[0] = 1;
"""


def _examples(inplace: bool = False) -> list[KernelExample]:
    out = []
    for xt, pt, T, B, CH, S, K in ((mx.bfloat16, mx.bfloat16, 8, 2, 8192, 4, 4), (mx.float32, mx.float32, 9, 3, 416, 5, 4),
                                   (mx.bfloat16, mx.float32, 5, 2, 300, 3, 2)):
        if K != 4 and not inplace:
            continue
        out.append(KernelExample(
            [(xt, (T, CH)), (xt, (CH, K)), (pt, (S, K - 1, CH)), (mx.int32, (B + 1,)), (mx.int32, (B,))],
            [xt, mx.int32 if inplace else pt],
            [("XT", xt), ("PT", pt), ("CH", CH), ("CHP", -(-CH // TG) * TG), ("K", K)],
        ))
    return out


CONV = portable_kernel(
    name="causal_conv1d_silu",
    input_names=["x", "w", "pool", "qsl", "rows"],
    output_names=["y", "state"],
    body=_BODY,
    examples=_examples(),
)
CONV_INPLACE = portable_kernel(
    name="causal_conv1d_silu_inplace",
    input_names=["x", "w", "pool", "qsl", "rows"],
    output_names=["y", "done"],
    body=_INPLACE_BODY,
    examples=_examples(inplace=True),
)


def run_conv(x, w, conv_pool, layout: SeqLayout, init_value=None, inplace=False):
    """x [T, C], w [C, K], conv_pool [S, K-1, C] -> (silu(conv) [T, C], new states [B, K-1, C]), or with
    inplace (silu(conv), done [1] int32) after writing the new states into conv_pool's rows."""
    backend = gpu_backend()
    T, CH = x.shape
    K = w.shape[1]
    B = layout.num_seqs
    ok = (mx.float32, mx.float16, mx.bfloat16)
    if backend is None or T == 0 or B == 0 or K < 2 or x.dtype not in ok or conv_pool.dtype not in ok:
        return None
    w = w.astype(x.dtype) if w.dtype not in ok else w
    chp = -(-CH // TG) * TG
    rows = T + B if inplace else T + B * (K - 1)  # grid rows past the tokens: per sequence / per state row
    return (CONV_INPLACE if inplace else CONV)(
        backend,
        inputs=[x, w, conv_pool, layout.array("query_start_loc"), layout.array("state_rows")],
        output_shapes=[(T, CH), (1,) if inplace else (B, K - 1, CH)],
        output_dtypes=[x.dtype, mx.int32 if inplace else conv_pool.dtype],
        grid=(chp * rows, 1, 1),
        threadgroup=(TG, 1, 1),
        template=[("XT", x.dtype), ("PT", conv_pool.dtype), ("CH", CH), ("CHP", chp), ("K", K)],
        init_value=init_value,
    )


def causal_conv1d_kernel(x, w, conv_pool, layout: SeqLayout, write_state=False):
    """-> (y, new states) or, with write_state and SELECT["conv_state_inplace"], (y, None): the new
    states were written into conv_pool's rows (None: not covered)."""
    inplace = bool(write_state and SELECT["conv_state_inplace"])
    out = run_conv(x, w, conv_pool, layout, inplace=inplace)
    return None if out is None else (out[0], None if inplace else out[1])
