"""A block's last projection with the residual add and the next RMSNorm in its epilogue (decode sizes).

    delta = x @ W^T            (rounded to the activation dtype, as `linear` returns it)
    h'    = h + delta          (rounded: the new residual stream)
    y     = rms_norm(h') * w   (the next sub-block's input)

Why: the decoder calls `add_rms_norm` twice per layer right after a projection; as its own kernel that is
64 launches per Qwen3.5-9B step, each ~9 us of MLX host time (benchmarks/decode_profile.md), when batch-1
decode was host-bound. The norm needs every output column of the projection, so the qmv threadgroups
count themselves out on a per-call-site counter: the last one to finish reads all deltas and does the
add + norm for the M rows (4096 columns each; a few us for one threadgroup instead of a launch).

The counter is a uint32 array (first element) per projection, zero between launches: the last threadgroup
resets it. So one launch per projection may be in flight at a time -- true for the model's layers, which
run in order (a layer's output feeds the next) -- and the same projection must not appear in two
independent branches of one evaluated graph.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS, eps_array
from ..portable import KernelExample, portable_kernel
from ..selection import SELECT, qmv_config
from . import gemv
from .bodies import HEADER, MMA_HEADER, XKIND, fma_body, mma_body
from .params import LinearParams

# After the qmv body: dlt [M, N] holds this threadgroup's columns. Writers fence, then one thread counts the
# threadgroup in; the NBLK-th arrival owns the epilogue (h + dlt -> hsum, rms_norm(hsum) * nw -> y).
# Each thread owns EPT columns of a row, taken EC at a time. EC == EPT: one pass, every load of the row in
# flight at once and held in registers through the norm (a loop that stored between its loads ran them one
# latency at a time, possible aliasing, ~30 us a launch). EC < EPT: a pass for the sum of squares and a
# second that reloads (L2 hits) and stores, EC loads in flight each: fewer registers, because the whole
# kernel is allocated the epilogue's count (M=1, 4-bit: 107 registers at EC = EPT = 32 against the plain
# qmv's 64, half its resident SIMD groups; 55 at EC = 8, ptxas -v for sm_90).
_EPILOGUE = r"""
  SHARED float qr_part[TGS / 32];
  SHARED int qr_last;
  DEVICE_FENCE;
  BARRIER;
  if (TID_X == 0) qr_last = (int)(ATOMIC_ADD_U32(cnt, 1u) == (uint32_t)(NBLK - 1));
  BARRIER;
  if (qr_last) {
    DEVICE_FENCE;
    const int tid = TID_X;
    for (int m = 0; m < M; ++m) {
      const size_t base = (size_t)m * N;
      float ep_h[EC];
      float ep_w[EC];
      float ss = 0.0f;
#pragma unroll 1
      for (int c0 = 0; c0 < EPT; c0 += EC) {
#pragma unroll
        for (int j = 0; j < EC; ++j) {
          const int i = tid + TGS * (c0 + j);
          ep_h[j] = i < N ? H_PLUS_DELTA : 0.0f;
          if (EC == EPT) ep_w[j] = i < N ? TO_FLOAT(nw[i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < EC; ++j) {
          ep_h[j] = TO_FLOAT(FROM_FLOAT(T, ep_h[j]));  // the new residual stream, rounded as stored
          ss += ep_h[j] * ep_h[j];
        }
      }
      ss = SIMD_SUM(ss);
      if (LANE == 0) qr_part[SIMD_ID] = ss;
      BARRIER;
      float qr_tot = 0.0f;
      for (int w = 0; w < TGS / 32; ++w) qr_tot += qr_part[w];
      const float inv = RSQRT(qr_tot / (float)N + eps[0]);
#pragma unroll 1
      for (int c0 = 0; c0 < EPT; c0 += EC) {
        if (EC < EPT) {  // the chunk again (one chunk: ep_h and ep_w still hold the row)
#pragma unroll
          for (int j = 0; j < EC; ++j) {
            const int i = tid + TGS * (c0 + j);
            ep_h[j] = i < N ? TO_FLOAT(FROM_FLOAT(T, H_PLUS_DELTA)) : 0.0f;
            ep_w[j] = i < N ? TO_FLOAT(nw[i]) : 0.0f;
          }
        }
#pragma unroll
        for (int j = 0; j < EC; ++j) {
          const int i = tid + TGS * (c0 + j);
          if (i < N) {
            hsum[base + i] = FROM_FLOAT(T, ep_h[j]);
            y[base + i] = FROM_FLOAT(T, ep_h[j] * inv * ep_w[j]);
          }
        }
      }
      BARRIER;  // qr_part is reused by the next row
    }
    if (tid == 0) ATOMIC_STORE_U32(cnt, 0u);
  }
"""

# column i of row m's residual plus the projection's delta (read back from L2: other threadgroups wrote it)
_EPILOGUE = _EPILOGUE.replace("H_PLUS_DELTA", "(TO_FLOAT(h[base + i]) + TO_FLOAT(LOAD_L2(dlt + base + i)))")


def epilogue(threads: int) -> str:
    """The epilogue for threadgroups of `threads` lanes (a multiple of 32): each owns EPT = ceil(N / threads)
    columns of a row."""
    return _EPILOGUE.replace("TGS", str(threads))


EPILOGUE = epilogue(128)  # the FMA qmv's (and the MoE down projection's) 128-lane threadgroups

_BODY = fma_body(1, 0, store="if (n < N) dlt[(size_t)m * N + n] = FROM_FLOAT(T, acc[m][r]);") + EPILOGUE


def epilogue_chunk(ept: int) -> int:
    """EC: SELECT["qmv_residual_chunk"] where it divides the EPT columns a thread owns, else EPT (one pass)."""
    ec = SELECT["qmv_residual_chunk"]
    return ec if 0 < ec < ept and ept % ec == 0 else ept


def _example(dt, bits: int, ec: int | None = None) -> KernelExample:
    """A Qwen3.5-9B down_proj (12288 -> 4096, g64) for the compile checks; EC columns a pass (default: all
    of a thread's EPT in one)."""
    K, N = 12288, 4096
    ec = ec or N // 128
    ins = [(dt, (2, K)), (mx.uint32, (N, K * bits // 32)), (dt, (N, K // 64)), (dt, (N, K // 64)),
           (dt, (2, N)), (dt, (N,)), (mx.float32, (1,)), (mx.uint32, (8,))]
    tmpl = [("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", 64), ("MT", 2), ("R", 4), ("U", 2),
            ("P", 1), ("EPI", 0), ("PF", 1), ("NP", bits == 4), ("NBLK", N // 16), ("EPT", N // 128), ("EC", ec)]
    return KernelExample(inputs=ins, outputs=[dt] * 3, template=tmpl)


QMV_ADD_RMS = portable_kernel(
    name="mtl_qmv_add_rms", input_names=["x", "w0", "s0", "b0", "h", "nw", "eps", "cnt"],
    output_names=["dlt", "hsum", "y"], body=_BODY, header=HEADER,
    examples=[_example(dt, bits) for dt in (mx.bfloat16, mx.float32) for bits in (4, 8)] + [_example(mx.bfloat16, 4, 8)],
)

def _mma_example(dt, cfg: tuple[int, int, int]) -> KernelExample:
    """The down_proj example under the tensor-core body's template (8 rows, 256 lanes a threadgroup)."""
    K, N = 12288, 4096
    ex = _example(dt, 4)
    ins = [(dt, (8, K))] + ex.inputs[1:4] + [(dt, (8, N))] + ex.inputs[5:]
    rt, ug, cg = cfg
    tmpl = [("T", dt), ("XK", XKIND[dt]), ("GS", 64), ("UG", ug), ("NW", 8), ("P", 1), ("EPI", 0), ("RT", rt),
            ("CG", cg), ("NBLK", N // (16 * rt)), ("EPT", N // 256), ("EC", N // 256)]
    return KernelExample(inputs=ins, outputs=[dt] * 3, template=tmpl)


# The tensor-core qmv (CUDA, 4-bit, 16-bit x, decode rows from qmv_mma_min_rows) with the same epilogue over
# its 256-lane threadgroups; on other back-ends the portable body is the FMA kernel's (check_metal's).
QMV_MMA_ADD_RMS = portable_kernel(
    name="mtl_qmv_mma_add_rms", input_names=QMV_ADD_RMS.input_names, output_names=QMV_ADD_RMS.output_names,
    body=_BODY, cuda_body=mma_body(1, 0, out="dlt") + epilogue(256), header=HEADER + MMA_HEADER,
    examples=QMV_ADD_RMS.examples[:1],
    cuda_examples=[_mma_example(dt, c) for dt in (mx.bfloat16, mx.float16) for c in ((2, 2, 0), (1, 4, 0))],
)

MAX_EPT = 64  # residual elements per thread held in registers by the epilogue (hidden size <= 8192)
_COUNTERS: dict[int, mx.array] = {}


def arrival_counter(p: LinearParams) -> mx.array:
    """The call site's arrival counter, keyed by the weight's identity. A key reused after a model is freed
    finds a counter at zero (every finished launch resets it), so reuse is harmless."""
    key = id(p.weight)
    if key not in _COUNTERS:
        # 8 elements (only the first is used): Metal passes arrays under 8 elements in constant memory
        _COUNTERS[key] = mx.zeros((8,), dtype=mx.uint32)
        mx.eval(_COUNTERS[key])
    return _COUNTERS[key]


def covers(x: mx.array, p: LinearParams, h: mx.array) -> bool:
    """The FMA qmv's shapes, a residual of the output's shape and dtype."""
    M = x.shape[0] if x.ndim == 2 else 0
    return (SELECT["qmv_residual_norm"] == 1 and gpu_backend() is not None and x.ndim == 2 and gemv.fma_serves(M)
            and h.shape == (M, p.out_features) and h.dtype == x.dtype and x.dtype in FLOATS
            and p.out_features <= 128 * MAX_EPT
            and gemv.qmv_supported(x, [p]))


def mma_covers(x: mx.array, p: LinearParams, h: mx.array) -> bool:
    """The tensor-core qmv's rows (CUDA, 4-bit, 16-bit x) under SELECT["qmv_mma_residual_norm"]; else
    the caller runs the projection and `add_rms_norm` apart."""
    M = x.shape[0] if x.ndim == 2 else 0
    return (SELECT["qmv_residual_norm"] == 1 and SELECT["qmv_mma_residual_norm"] == 1 and gpu_backend() == "cuda"
            and x.ndim == 2 and 0 < SELECT["qmv_mma_min_rows"] <= M <= SELECT["qmv_max_rows"] and p.bits == 4
            and x.dtype in (mx.bfloat16, mx.float16) and h.shape == (M, p.out_features) and h.dtype == x.dtype
            and p.out_features <= 256 * MAX_EPT and gemv.qmv_supported(x, [p]))


def linear_add_rms_norm_kernel(x: mx.array, p: LinearParams, h: mx.array, w: mx.array, eps: float):
    """-> (h + x W^T, rms_norm(h + x W^T) * w), both [M, N], or None where neither form covers x."""
    if covers(x, p, h):
        return qmv_add_rms(x, p, h, w, eps)
    return qmv_mma_add_rms(x, p, h, w, eps) if mma_covers(x, p, h) else None


def qmv_mma_add_rms(x: mx.array, p: LinearParams, h: mx.array, w: mx.array, eps: float,
                    cfg: tuple[int, int, int] | None = None) -> tuple[mx.array, mx.array]:
    """The tensor-core launch: x [M <= 8, K] 16-bit, 4-bit p, h [M, N] of x's dtype; cfg (RT, UG, CG):
    gemv.mma_config's by default."""
    M, K = x.shape
    N = p.out_features
    cfg = cfg or gemv.mma_config(M, K, N, p.group_size, 0)
    nblk = gemv.mma_blocks([p], 0, cfg[0])
    ept = -(-N // 256)
    _, hsum, y = QMV_MMA_ADD_RMS(
        "cuda",
        inputs=[x, p.weight, p.scales, p.biases, h, w, eps_array(eps), arrival_counter(p)],
        output_shapes=[(M, N)] * 3,
        output_dtypes=[x.dtype] * 3,
        grid=(nblk * 256, 1, 1),
        threadgroup=(256, 1, 1),
        template=gemv.mma_template(x, p, 1, 0, cfg) + [("NBLK", nblk), ("EPT", ept), ("EC", epilogue_chunk(ept))],
        init_value=gemv.POISON,
    )
    return hsum, y


def qmv_add_rms(x: mx.array, p: LinearParams, h: mx.array, w: mx.array, eps: float,
                pf: int | None = None) -> tuple[mx.array, mx.array]:
    """The launch itself: x [M <= 8, K], h [M, N] of x's dtype (tests call it past `covers`' policy);
    pf: the weight-prefetch variant (default: the selection table's)."""
    M, K = x.shape
    N = p.out_features
    R, U = qmv_config(gemv.row_bucket(M), K, p.bits, N=N)
    nblk = -(-N // (4 * R))
    ept = -(-N // 128)
    _, hsum, y = QMV_ADD_RMS(
        gpu_backend(),
        inputs=gemv.fma_inputs(x, [p]) + [h, w, eps_array(eps), arrival_counter(p)],
        output_shapes=[(M, N)] * 3,
        output_dtypes=[x.dtype] * 3,
        grid=(nblk * 128, 1, 1),
        threadgroup=(128, 1, 1),
        template=gemv.fma_template(x, p, R, U, 1, 0, pf) + [("NBLK", nblk), ("EPT", ept), ("EC", epilogue_chunk(ept))],
        init_value=gemv.POISON,
    )
    return hsum, y
