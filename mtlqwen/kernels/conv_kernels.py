"""Causal depthwise conv1d + SiLU over the packed GDN qkv channels, with the K-1 row conv state
(qwen35-architecture.md §2.2), as one portable kernel.

Grid rows (the flat grid is [rows, CHP]) 0..T-1 are output tokens; rows T..T+B(K-1)-1 write the new
states, so one launch produces both outputs. A token finds its sequence by binary search over query_start_loc (B is small), and rows
before the sequence start come from its pool row. Old state values pass through x's dtype, as in the
reference (it concatenates `pool.astype(x.dtype)` with x).
"""

from __future__ import annotations

import mlx.core as mx

from .backend import gpu_backend, register_kernel
from .portable import KernelExample, portable_kernel
from .seqs import SeqLayout

TG = 256  # threads along the channels

_BODY = """
const int NSEQ = qsl_shape[0] - 1;
const int c = GID_X % CHP;  // channel (CHP = CH padded to the threadgroup width)
const int u = GID_X / CHP;  // output token, or a state row past T
const int T = qsl[NSEQ];
constexpr int KS = K - 1;
if (c < CH) {
  if (u < T) {
    int lo = 0, hi = NSEQ - 1;  // the sequence of packed row u: last lo with qsl[lo] <= u
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (qsl[mid] <= u) lo = mid; else hi = mid - 1;
    }
    const int st = qsl[lo];
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


def _examples() -> list[KernelExample]:
    out = []
    for xt, pt, T, B, CH, S in ((mx.bfloat16, mx.bfloat16, 8, 2, 8192, 4), (mx.float32, mx.float32, 9, 3, 416, 5)):
        out.append(KernelExample(
            [(xt, (T, CH)), (xt, (CH, 4)), (pt, (S, 3, CH)), (mx.int32, (B + 1,)), (mx.int32, (B,))],
            [xt, pt],
            [("XT", xt), ("PT", pt), ("CH", CH), ("CHP", -(-CH // TG) * TG), ("K", 4)],
        ))
    return out


CONV = portable_kernel(
    name="causal_conv1d_silu",
    input_names=["x", "w", "pool", "qsl", "rows"],
    output_names=["y", "state"],
    body=_BODY,
    examples=_examples(),
)


def run_conv(x, w, conv_pool, layout: SeqLayout, init_value=None):
    """x [T, C], w [C, K], conv_pool [S, K-1, C] -> (silu(conv) [T, C], new states [B, K-1, C])."""
    backend = gpu_backend()
    T, CH = x.shape
    K = w.shape[1]
    B = layout.num_seqs
    ok = (mx.float32, mx.float16, mx.bfloat16)
    if backend is None or T == 0 or B == 0 or K < 2 or x.dtype not in ok or conv_pool.dtype not in ok:
        return None
    w = w.astype(x.dtype) if w.dtype not in ok else w
    chp = -(-CH // TG) * TG
    return CONV(
        backend,
        inputs=[x, w, conv_pool, layout.array("query_start_loc"), layout.array("state_rows")],
        output_shapes=[(T, CH), (B, K - 1, CH)],
        output_dtypes=[x.dtype, conv_pool.dtype],
        grid=(chp * (T + B * (K - 1)), 1, 1),
        threadgroup=(TG, 1, 1),
        template=[("XT", x.dtype), ("PT", conv_pool.dtype), ("CH", CH), ("CHP", chp), ("K", K)],
        init_value=init_value,
    )


@register_kernel("causal_conv1d")
def causal_conv1d_kernel(x, w, conv_pool, layout: SeqLayout):
    return run_conv(x, w, conv_pool, layout)
