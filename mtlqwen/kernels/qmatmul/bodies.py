"""The quantized GEMV's kernel source, as public fragments: the FMA body every back-end runs (gemv.py's
qmv and residual.py's qmv with the residual + norm epilogue both render it), the CUDA tensor-core body,
and the functions that fill a body's placeholders for P projections and an epilogue.

Placeholders: PROJ_SELECT (threadgroup -> projection p and its N), QM_LOAD(c) (the chunk loads,
`with_loads`), ROW_SELECT (the weight / scale / bias pointers of row r), WRITE_OUT (the FMA body's store
of acc[m][r] to output row n), MMA_PTRS / MMA_WRITE (the tensor-core body's).
"""

from __future__ import annotations

import re

import mlx.core as mx
from ..tensor_core import MMA_HEADER  # noqa: F401  (the qmv and qgemm headers add it)

# x kind -> how the kernel reads raw activation bits (bf16 and fp32 are pure bit moves, fp16 converts)
XKIND = {mx.float32: 0, mx.bfloat16: 1, mx.float16: 2}

# Header helpers. The only back-end difference is the bit cast and the half conversion.
HEADER = r"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)  // nvcc / NVRTC; otherwise Metal
#define QM_AS_FLOAT(u) __uint_as_float(u)
#define QM_HALF_BITS(u) __half2float(__ushort_as_half((unsigned short)(u)))
#else
#define QM_AS_FLOAT(u) as_type<float>(u)
#define QM_HALF_BITS(u) float(as_type<half>((ushort)(u)))
#endif
// one element of an activation word: kind 0 fp32 (the whole word), 1 bf16, 2 fp16 (hi selects the half)
INLINE float qm_x(uint32_t w, int hi, int kind) {
  if (kind == 0) return QM_AS_FLOAT(w);
  if (kind == 1) return QM_AS_FLOAT(hi ? (w & 0xffff0000u) : (w << 16));
  return QM_HALF_BITS(hi ? (w >> 16) : (w & 0xffffu));
}
INLINE uint32_t qm_word(uint4 v, int i) { return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w)); }
INLINE float qm_silu(float g) { return g / (1.0f + EXP(-g)); }
"""

# Portable body. Template constants: T (x / y dtype), XK (XKIND), BITS, GS, MT (max x rows, M <= MT),
# R (weight rows per SIMD group), U (16-byte chunks in flight per lane and row), P (projections), EPI
# (0: y_p = x W_p^T for each p; 1: P == 2 and y = silu(x W_0^T) * (x W_1^T)).
# Threadgroup = 4 SIMD groups (128 lanes); SIMD group w of block b owns rows [b*4R + w*R, +R) of one
# projection (EPI 1: R/2 gate rows and the same R/2 up rows). A lane walks the 16-byte chunks c = lane,
# lane+32, ... of its rows: K split across lanes, SIMD_SUM at the end.
FMA_BODY = r"""
  constexpr int CE = 128 / BITS;          // weights per 16-byte chunk (32 or 16), all in one group
  constexpr int EPW = 32 / BITS;          // weights per uint32 word
  constexpr int CPG = GS / CE;            // chunks per group
  constexpr uint32_t MAGIC = (uint32_t)(127 + BITS) << 23;        // float bits of 2^BITS
  constexpr uint32_t QMASK = ((1u << BITS) - 1u) << (23 - BITS);  // q in the top mantissa bits
  constexpr float OFF = (float)(1 << BITS);
  // NP (4-bit only): even weights of a word carry 256+q (MAGIC_NP), odd ones 16+q; the even ones' sum of x
  // (xe) corrects the fold by (256-16)*xe
  constexpr uint32_t MAGIC_NP = (uint32_t)(127 + 8) << 23;
  constexpr int XB = XK == 0 ? 4 : 2;     // activation bytes
  constexpr int XW = EPW * XB / 4;        // activation uint32 words per weight word (2, 4 or 1, 2)
  constexpr int RP = EPI == 1 ? R / 2 : R;  // output rows per SIMD group
  constexpr int RB = 4 * RP;                // output rows per threadgroup
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int NC = K / CE;                  // chunks per row
  const int KW = K / EPW;                 // uint32 words per row
  const int NG = K / GS;                  // groups per row
  const int lane = LANE;
  const int warp = SIMD_ID;

  // which projection and rows this threadgroup owns
  int blk = TGID_X;
  int p = 0;
  PROJ_SELECT
  const int n0 = blk * 4 * RP + warp * RP;

  float acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

  // PF 1: the next U chunks' weights are loaded before this iteration's math (software pipelining), so
  // a SIMD group keeps loads in flight while it computes; PF 0 loads then computes.
  uint4 wv[U][R];
  float sc[U][R];
  float bo[U][R];
  if (PF) {
    QM_LOAD(lane)
  }
  for (int c0 = lane; c0 < NC; c0 += 32 * U) {
    if (!PF) {
      QM_LOAD(c0)
    }
    uint4 cw[U][R];
    float cs[U][R];
    float cb[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) { cw[u][r] = wv[u][r]; cs[u][r] = sc[u][r]; cb[u][r] = bo[u][r]; }
    if (PF && c0 + 32 * U < NC) {
      QM_LOAD(c0 + 32 * U)
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < NC) {
        float dot[MT][R];
        float xs[MT], xe[MT];
        for (int m = 0; m < MT; ++m) {
          xs[m] = 0.0f;
          xe[m] = 0.0f;
          for (int r = 0; r < R; ++r) dot[m][r] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float wf[R][EPW];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t w = qm_word(cw[u][r], j);
            if (NP) {
              // nibbles 2k, 2k+1 (bits 8k, 8k+4) move together to bits 15 and 19 with one shift, and one
              // LOP3 each makes 256+q and 16+q: 1.5 instead of 2 integer ops per weight (the kernel is
              // issue-bound at M=1)
#pragma unroll
              for (int k = 0; k < EPW / 2; ++k) {
                const int sh = 15 - 8 * k;
                const uint32_t t = sh >= 0 ? (w << sh) : (w >> -sh);
                wf[r][2 * k] = QM_AS_FLOAT((t & (0xFu << 15)) | MAGIC_NP);
                wf[r][2 * k + 1] = QM_AS_FLOAT((t & QMASK) | MAGIC);
              }
            } else {
#pragma unroll
              for (int e = 0; e < EPW; ++e) {
                const int sh = e * BITS;   // move q from bits [sh, sh+BITS) to [23-BITS, 23)
                const uint32_t t = sh <= 23 - BITS ? (w << (23 - BITS - sh)) : (w >> (sh - (23 - BITS)));
                wf[r][e] = QM_AS_FLOAT((t & QMASK) | MAGIC);
              }
            }
          }
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            if (m < M) {
              CONST_PTR uint2* xp = (CONST_PTR uint2*)(x + (size_t)m * K + c * CE + j * EPW);
              uint2 xv[(XW + 1) / 2];
#pragma unroll
              for (int i = 0; i < (XW + 1) / 2; ++i) xv[i] = xp[i];
#pragma unroll
              for (int e = 0; e < EPW; ++e) {
                const int wi = (e * XB) / 4;
                const uint32_t xw = (wi & 1) ? xv[wi / 2].y : xv[wi / 2].x;
                const float xf = qm_x(xw, ((e * XB) / 2) & 1, XK);
                xs[m] += xf;
                if (NP && (e & 1) == 0) xe[m] += xf;
#pragma unroll
                for (int r = 0; r < R; ++r) dot[m][r] = fma(xf, wf[r][e], dot[m][r]);
              }
            }
          }
        }
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r)
            acc[m][r] += cs[u][r] * (NP ? dot[m][r] - 240.0f * xe[m] : dot[m][r]) + cb[u][r] * xs[m];
      }
    }
  }

#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = SIMD_SUM(acc[m][r]);

  if (lane == 0) {
    for (int m = 0; m < MT && m < M; ++m) {
      for (int r = 0; r < RP; ++r) {
        const int n = n0 + r;
        WRITE_OUT
      }
    }
  }
"""


# CUDA variant on tensor cores (mma.sync m16n8k16, fp32 accumulate), 4-bit only, bf16/fp16 x, M <= 8.
# A tile is 16 weight rows (EPI 1: 8 gate rows over 8 up rows); a threadgroup owns RT tiles and its SIMD
# groups split the K groups of GS columns: UG groups per pass, NW passes apart (CG 0) or consecutive (CG 1).
# A quad of lanes (t = lane & 3) covers one group of rows g = lane >> 2 and g+8, so each mma's k-reduction
# stays inside one quantization group. Weights become 16-bit pairs (OFF+q) with one LOP3 per two weights;
# x (token g of the B fragment) is loaded per lane for the same columns and paired with PRMT, once for the
# RT tiles (x is read from L2 by every threadgroup: more tiles, fewer reads per weight byte). A second mma
# against ones gives sum(x) per group for the fold y += s*C + (b - OFF*s)*sum(x).
MMA_BODY = r"""
  constexpr int WPT = GS / 32;            // weight words per lane per row and group
  constexpr uint32_t MAGIC2 = XK == 1 ? 0x43004300u : 0x64006400u;  // bf16 128+q / fp16 1024+q pairs
  constexpr uint32_t ONES2 = XK == 1 ? 0x3F803F80u : 0x3C003C00u;
  constexpr float OFF = XK == 1 ? 128.0f : 1024.0f;
  constexpr int RB = EPI == 1 ? 8 : 16;   // output rows of a tile
  constexpr int RBT = RB * RT;            // output rows of the threadgroup
  constexpr int GSTEP = CG ? 1 : NW;      // group distance between a pass's UG groups
  __shared__ float red[NW][32][4 * RT];
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int NG = K / GS;
  const int KW = K / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  int blk = blockIdx.x;
  int p = 0;
  PROJ_SELECT
  const int n0 = blk * RBT;
  int rowA[RT], rowB[RT];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    rowA[rt] = min(n0 + rt * RB + g, N - 1);
    rowB[rt] = EPI == 1 ? rowA[rt] : min(n0 + rt * RB + g + 8, N - 1);
  }
  MMA_PTRS
  const bool xon = g < M;
  const uint32_t* xrow = (const uint32_t*)(x + (size_t)(xon ? g : 0) * K);
  float acc[RT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) acc[rt][0] = acc[rt][1] = acc[rt][2] = acc[rt][3] = 0.f;
  for (int gi0 = warp * (CG ? UG : 1); gi0 < NG; gi0 += NW * UG) {
    uint32_t wa[UG][RT][WPT], wb[UG][RT][WPT];
    uint4 xv[UG][WPT];
    float sa[UG][RT], sb[UG][RT], ba[UG][RT], bb[UG][RT];
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      const int gi = min(gi0 + GSTEP * u, NG - 1);
      const int w0i = gi * (GS / 8) + t * WPT;       // first word of this lane in the group
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
        for (int i = 0; i < WPT; ++i) {
          wa[u][rt][i] = WA[(size_t)rowA[rt] * KW + w0i + i];
          wb[u][rt][i] = WB[(size_t)rowB[rt] * KW + w0i + i];
        }
      }
#pragma unroll
      for (int i = 0; i < WPT; ++i)
        xv[u][i] = xon ? ((const uint4*)(xrow + (size_t)(w0i + i) * 4))[0] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        sa[u][rt] = pl_to_float(SA[(size_t)rowA[rt] * NG + gi]); ba[u][rt] = pl_to_float(BA[(size_t)rowA[rt] * NG + gi]);
        sb[u][rt] = pl_to_float(SB[(size_t)rowB[rt] * NG + gi]); bb[u][rt] = pl_to_float(BB[(size_t)rowB[rt] * NG + gi]);
      }
    }
#pragma unroll
    for (int u = 0; u < UG; ++u) {
      if (gi0 + GSTEP * u < NG) {
        float cg[RT][4], cx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) cg[rt][0] = cg[rt][1] = cg[rt][2] = cg[rt][3] = 0.f;
#pragma unroll
        for (int i = 0; i < WPT; ++i) {
          const uint32_t xw[4] = {xv[u][i].x, xv[u][i].y, xv[u][i].z, xv[u][i].w};
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const uint32_t b0r = __byte_perm(xw[jj], xw[jj + 2], 0x5410);
            const uint32_t b1r = __byte_perm(xw[jj], xw[jj + 2], 0x7632);
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
              const uint32_t a0 = ((wa[u][rt][i] >> (8 * jj)) & 0x000F000Fu) | MAGIC2;
              const uint32_t a1 = ((wb[u][rt][i] >> (8 * jj)) & 0x000F000Fu) | MAGIC2;
              const uint32_t a2 = ((wa[u][rt][i] >> (8 * jj + 4)) & 0x000F000Fu) | MAGIC2;
              const uint32_t a3 = ((wb[u][rt][i] >> (8 * jj + 4)) & 0x000F000Fu) | MAGIC2;
              qm_mma<XK>(cg[rt], a0, a1, a2, a3, b0r, b1r);
            }
            qm_mma<XK>(cx, ONES2, ONES2, ONES2, ONES2, b0r, b1r);
          }
        }
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          acc[rt][0] += sa[u][rt] * cg[rt][0] + (ba[u][rt] - OFF * sa[u][rt]) * cx[0];
          acc[rt][1] += sa[u][rt] * cg[rt][1] + (ba[u][rt] - OFF * sa[u][rt]) * cx[1];
          acc[rt][2] += sb[u][rt] * cg[rt][2] + (bb[u][rt] - OFF * sb[u][rt]) * cx[2];
          acc[rt][3] += sb[u][rt] * cg[rt][3] + (bb[u][rt] - OFF * sb[u][rt]) * cx[3];
        }
      }
    }
  }
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int c = 0; c < 4; ++c) red[warp][lane][4 * rt + c] = acc[rt][c];
  __syncthreads();
  if (warp < RT) {  // SIMD group rt sums tile rt over the SIMD groups and writes it
    const int rt = warp;
    float v[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) s += red[w][lane][4 * rt + c];
      v[c] = s;
    }
    const int na = n0 + rt * RB + g;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int m = 2 * t + c;
      if (m < M && na < N) {
        MMA_WRITE
      }
    }
  }
"""




def mma_ptrs(P: int, epi: int) -> str:
    """Row g of the tile reads (WA, SA, BA), row g+8 reads (WB, SB, BB): gate / up under SwiGLU."""
    if epi == 1:
        return ("const uint32_t* WA = w0; const uint32_t* WB = w1; const T* SA = s0; const T* SB = s1;"
                " const T* BA = b0; const T* BB = b1;")
    w, sc, b = (ptr_select(c, P) for c in "wsb")
    return (f"const uint32_t* WA = {w}; const uint32_t* WB = WA; const T* SA = {sc}; const T* SB = SA;"
            f" const T* BA = {b}; const T* BB = BA;")


def mma_write(P: int, epi: int, out: str | None = None) -> str:
    """Stores of a tile's row g (and g+8); `out` names the one output of P = 1 (default y0)."""
    if epi == 1:
        return "y0[(size_t)m * N + na] = pl_from_float<T>(qm_silu(v[c]) * v[c + 2]);"
    y = out if out is not None else ptr_select("y", P)
    return (f"T* Y = {y}; Y[(size_t)m * N + na] = pl_from_float<T>(v[c]);\n"
            "        if (na + 8 < N) Y[(size_t)m * N + na + 8] = pl_from_float<T>(v[c + 2]);")


def proj_select(P: int, epi: int, tile: str = "RB") -> str:
    """Code that maps the threadgroup to (p, blk within p) and binds N; `tile` names the constant holding
    the output rows of one threadgroup."""
    if epi == 1:
        return "  const int N = w0_shape[0];\n"
    lines = [f"  const int N{i} = w{i}_shape[0];" for i in range(P)]
    for i in range(P - 1):
        lines.append(f"  if (p == {i} && blk >= (N{i} + {tile} - 1) / {tile}) {{ blk -= (N{i} + {tile} - 1) / {tile}; p = {i + 1}; }}")
    sel = " : ".join(f"(p == {i} ? N{i}" for i in range(P - 1))
    lines.append(f"  const int N = {sel + ' : ' if P > 1 else ''}N{P - 1}{')' * (P - 1)};")
    return "\n".join(lines) + "\n"


def ptr_select(prefix: str, P: int) -> str:
    if P == 1:
        return f"{prefix}0"
    return " : ".join(f"(p == {i} ? {prefix}{i}" for i in range(P - 1)) + f" : {prefix}{P - 1}" + ")" * (P - 1)


def row_select(P: int, epi: int) -> str:
    if epi == 1:  # first R/2 rows from the gate projection, the next R/2 from up (same output rows)
        return ("const bool up = r >= RP; const int row = min(n0 + (up ? r - RP : r), N - 1);\n"
                "        CONST_PTR uint32_t* W = up ? w1 : w0; CONST_PTR T* S = up ? s1 : s0;"
                " CONST_PTR T* B = up ? b1 : b0;")
    return (f"const int row = min(n0 + r, N - 1);\n        CONST_PTR uint32_t* W = {ptr_select('w', P)};"
            f" CONST_PTR T* S = {ptr_select('s', P)}; CONST_PTR T* B = {ptr_select('b', P)};")


def write_out(P: int, epi: int) -> str:
    if epi == 1:
        return ("if (n < N) y0[(size_t)m * N + n] = FROM_FLOAT(T, qm_silu(acc[m][r]) * acc[m][r + RP]);")
    return (f"if (n < N) {{ DEVICE_PTR T* Y = {ptr_select('y', P)}; "
            "Y[(size_t)m * N + n] = FROM_FLOAT(T, acc[m][r]); }")


# Loads of U chunks from chunk index C0 (lane's first chunk) for the R rows, into wv / sc / bo.
LOAD = r"""{
      const int qm_c0 = C0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = min(qm_c0 + 32 * u, NC - 1);   // clamped: out-of-range chunks are loaded but skipped
#pragma unroll
        for (int r = 0; r < R; ++r) {
          ROW_SELECT
          wv[u][r] = ((CONST_PTR uint4*)(W + (size_t)row * LD_KW))[LD_C];
          const float s = TO_FLOAT(S[(size_t)row * LD_NG + LD_C / CPG]);
          sc[u][r] = s;
          bo[u][r] = TO_FLOAT(B[(size_t)row * LD_NG + LD_C / CPG]) - OFF * s;
        }
      }
    }"""


def with_loads(body: str, row_words: str = "KW", row_groups: str = "NG", chunk: str = "c") -> str:
    """Expand QM_LOAD(expr) into the chunk loads (before ROW_SELECT is substituted). By default chunk c
    of a row of KW words / NG groups; the MoE down projection (moe/kernels.py) reads chunk `chunk` of a
    row of `row_words` / `row_groups` instead (one expert's row of the concatenated K)."""
    load = LOAD.replace("LD_KW", row_words).replace("LD_NG", row_groups).replace("LD_C", chunk)
    return re.sub(r"QM_LOAD\(([^\n]*?)\)\n", lambda m: load.replace("C0", m.group(1)) + "\n", body)


def fma_body(P: int, epi: int, store: str | None = None) -> str:
    """The FMA qmv body for P projections (epi 1: SwiGLU of two); `store` replaces the default output
    write (residual.py parks the projection there for its epilogue)."""
    return (with_loads(FMA_BODY).replace("PROJ_SELECT", proj_select(P, epi))
            .replace("ROW_SELECT", row_select(P, epi))
            .replace("WRITE_OUT", write_out(P, epi) if store is None else store))


def mma_body(P: int, epi: int, out: str | None = None) -> str:
    """The tensor-core (CUDA) qmv body for P projections (epi 1: SwiGLU of two); `out`: mma_write's."""
    return (MMA_BODY.replace("PROJ_SELECT", proj_select(P, epi, "RBT")).replace("MMA_WRITE", mma_write(P, epi, out))
            .replace("MMA_PTRS", mma_ptrs(P, epi)))
