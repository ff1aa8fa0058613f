"""The CUDA source of the tensor-core quantized matmul (qgemm.py): its helpers, the kernel body and the
fragments the warpgroup form (wgmma.py) shares, and how a body is written out for P projections, SwiGLU
and the grouped (MoE) forms. The launch's layout and the Python side (configs, split-K, dispatch): qgemm.py."""

from __future__ import annotations

import mlx.core as mx

from .bodies import proj_select, ptr_select

XKIND = {mx.bfloat16: 1, mx.float16: 2}  # the XK template constant: x's dtype as the source names it

HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ unsigned qg_smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
// 16-byte copy global -> shared; src_bytes 0 fills zeros (rows past M)
__device__ __forceinline__ void qg_cp16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(qg_smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void qg_cp8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(qg_smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void qg_cp4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(qg_smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void qg_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void qg_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// a pair of 16-bit values (OFF + q) -> (q * s + b) in the activation type, s2 / b2 the pair-broadcast scale
// and bias; OFF is 128 (bf16) or 1024 (fp16), so OFF + q and the subtraction are exact
template <int XK>
__device__ __forceinline__ uint32_t qg_deq(uint32_t qm, uint32_t s2, uint32_t b2) {
  uint32_t r;
  if constexpr (XK == 1) {
    __nv_bfloat162 q = *reinterpret_cast<__nv_bfloat162*>(&qm);
    const uint32_t off = 0x43004300u;
    q = __hsub2(q, *reinterpret_cast<const __nv_bfloat162*>(&off));
    __nv_bfloat162 w = __hfma2(q, *reinterpret_cast<__nv_bfloat162*>(&s2), *reinterpret_cast<__nv_bfloat162*>(&b2));
    r = *reinterpret_cast<uint32_t*>(&w);
  } else {
    __half2 q = *reinterpret_cast<__half2*>(&qm);
    const uint32_t off = 0x64006400u;
    q = __hsub2(q, *reinterpret_cast<const __half2*>(&off));
    __half2 w = __hfma2(q, *reinterpret_cast<__half2*>(&s2), *reinterpret_cast<__half2*>(&b2));
    r = *reinterpret_cast<uint32_t*>(&w);
  }
  return r;
}
// 8-bit weights under bf16: 128 + q is not exact past q = 127, so the pair goes through fp32
__device__ __forceinline__ uint32_t qg_deq8_bf16(uint32_t w, float s, float b) {
  const float lo = __uint_as_float(0x4B000000u | (w & 0xFFu)) - 8388608.0f;
  const float hi = __uint_as_float(0x4B000000u | ((w >> 16) & 0xFFu)) - 8388608.0f;
  __nv_bfloat162 v = __floats2bfloat162_rn(fmaf(lo, s, b), fmaf(hi, s, b));
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float qg_silu(float g) { return g / (1.0f + __expf(-g)); }
__device__ __forceinline__ float qg_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float qg_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T qg_out(float v);
template <> __device__ __forceinline__ __nv_bfloat16 qg_out<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half qg_out<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ float qg_out<float>(float v) { return v; }
"""

# Fragments both tensor-core bodies (this one and wgmma.py's) share: the k-steps [kt0, kt1) of the block's split
# of K, the tile-row lambda (ROW_OF fills it), the head of the stage loader, one stage's scale / bias loads, and
# the K loop's issue of the next stage (at step i) with the current stage's base.
K_SPLIT = r"""  const int KT = K / 128;
  const int SPLIT = gridDim.z;
  const int kt0 = (int)(((long)KT * blockIdx.z) / SPLIT), kt1 = (int)(((long)KT * (blockIdx.z + 1)) / SPLIT);
  const int nk = kt1 - kt0;
"""
ROW_OF_FN = r"""  auto row_of = [&](int r, const uint32_t*& W, const T*& S, const T*& B) -> int {
    int n;
    ROW_OF
    return min(n, N - 1);                         // rows past N are loaded (clamped) but never stored
  };
"""
STAGE_PTRS = r"""  auto load_stage = [&](int stage, int kt) {
    unsigned char* base = qg_smem + stage * STAGE;
    unsigned char* Ws = base;
    unsigned char* Ss = base + TR * WROWB;
    unsigned char* Bs = Ss + TR * 8;
    unsigned char* Xs = Bs + TR * 8;
    const int k0 = kt * 128;
"""
NEXT_STAGE = r"""    {
      const int nx = i + STAGES - 1;
      if (nx < nk) load_stage(nx % STAGES, kt0 + nx);
      qg_commit();
    }
    const unsigned char* base = qg_smem + (i % STAGES) * STAGE;
    const unsigned char* Ws = base;
"""
SB_LOAD = r"""    for (int r = tid; r < TR; r += NT) {
      const uint32_t* W; const T* S; const T* B;
      const int n = row_of(r, W, S, B);
      const int gi = GS == 128 ? ((k0 / 128) & ~1) : k0 / GS;   // 4- or 8-byte aligned (K % 256 == 0)
      if (SBB == 8) { qg_cp8(Ss + r * 8, S + (size_t)n * NG + gi); qg_cp8(Bs + r * 8, B + (size_t)n * NG + gi); }
      else { qg_cp4(Ss + r * 8, S + (size_t)n * NG + gi); qg_cp4(Bs + r * 8, B + (size_t)n * NG + gi); }
    }
"""


# the block's first output column (blocks walk the P projections' concatenated columns; PROJ_SELECT sets p)
BLOCK_COLS = r"""  int blk = blockIdx.x;
  int p = 0;
  PROJ_SELECT
  const int n0 = blk * NOUT;
"""


def shared_fragments(body: str) -> str:
    """`body` with BLOCK_COLS, K_SPLIT, ROW_OF_FN, STAGE_PTRS, SB_LOAD and NEXT_STAGE (each on a line of its
    own) written out; PROJ_SELECT and ROW_OF stay for the caller."""
    for name, text in (("BLOCK_COLS", BLOCK_COLS), ("K_SPLIT", K_SPLIT), ("ROW_OF_FN", ROW_OF_FN),
                       ("STAGE_PTRS", STAGE_PTRS), ("SB_LOAD", SB_LOAD), ("NEXT_STAGE", NEXT_STAGE)):
        body = body.replace(name + "\n", text)
    return body


# Template constants: T (x dtype), XK, BITS, GS, RT, TT, WN, WM, STAGES, P (projections), EPI, PART (1: fp32
# partials of a split K, one slab per grid z), YT (output element type: float when PART).
_BODY = r"""
  constexpr int NT = 32 * WN * WM;              // threads
  constexpr int TR = 16 * RT * WN;              // weight rows in the block's tile
  constexpr int MB = 8 * TT * WM;               // tokens in the block's tile
  constexpr int WROWB = 16 * BITS;              // bytes of one row's packed words per k-step
  constexpr int SBB = GS == 32 ? 8 : 4;         // bytes of one row's scales (or biases) loaded per k-step
  constexpr int STAGE = TR * (WROWB + 16) + MB * 256;
  constexpr int NOUT = EPI == 1 ? 16 * WN : TR; // output rows of the block
  extern __shared__ __align__(16) unsigned char qg_smem[];

  const int M = M_ROWS;
  const int K = x_shape[1];
  const int NG = K / GS;
  const int KW = K * BITS / 32;                 // uint32 words per weight row
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wn = warp % WN, wm = warp / WN;
  const int g = lane >> 2, t = lane & 3;

  // which projection and output rows this block owns
BLOCK_COLS
  const int m0 = blockIdx.y * MB;
  GROUP_SELECT
K_SPLIT
  // tile row r -> (pointers, global row) ; EPI 1: warp wn's 32 tile rows are 16 gate rows then 16 up rows
ROW_OF_FN
STAGE_PTRS
    constexpr int CPR = WROWB / 16;               // 16-byte chunks per row
    for (int c = tid; c < TR * CPR; c += NT) {
      const int r = c / CPR, j = c % CPR;
      const uint32_t* W; const T* S; const T* B;
      const int n = row_of(r, W, S, B);
      qg_cp16(Ws + r * WROWB + j * 16, W + (size_t)n * KW + (size_t)k0 * BITS / 32 + j * 4, 16);
    }
SB_LOAD
    for (int c = tid; c < MB * 16; c += NT) {
      const int r = c / 16, ch = c % 16;
      const int m = m0 + r;
      // chunk ch = 4*tt + jj lands in slot (4*jj + tt) ^ 4*(r & 1): conflict-free 16-byte reads below
      const int slot = ((ch & 3) * 4 + (ch >> 2)) ^ ((r & 1) * 4);
      X_LOAD
    }
  };

  float acc[RT][TT][4];
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < TT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, kt0 + s);
    qg_commit();
  }
  for (int i = 0; i < nk; ++i) {
    qg_wait<STAGES - 2>();
    __syncthreads();
NEXT_STAGE
    const unsigned short* Ss = (const unsigned short*)(base + TR * WROWB);
    const unsigned short* Bs = (const unsigned short*)(base + TR * WROWB + TR * 8);
    const unsigned char* Xs = base + TR * WROWB + TR * 16;
    const int kt = kt0 + i;
    // this lane's group inside the k-step (its 32 columns never straddle a group: GS >= 32)
    const int hi = GS == 32 ? t : (GS == 64 ? t / 2 : ((kt & 1) ? 1 : 0));

    // A operands: raw words and scale / bias pairs of rows g and g + 8 of each 16-row tile
    uint32_t wa[RT][BITS], wb[RT][BITS];
    uint32_t sa[RT], sb[RT], ba[RT], bb[RT];
    float fsa[RT], fsb[RT], fba[RT], fbb[RT];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      const int ra = (wn * RT + rt) * 16 + g, rb = ra + 8;
#pragma unroll
      for (int q = 0; q < BITS / 4; ++q) {
        const uint4 va = *(const uint4*)(Ws + ra * WROWB + t * (16 * BITS / 4) + q * 16);
        const uint4 vb = *(const uint4*)(Ws + rb * WROWB + t * (16 * BITS / 4) + q * 16);
        wa[rt][4 * q] = va.x; wa[rt][4 * q + 1] = va.y; wa[rt][4 * q + 2] = va.z; wa[rt][4 * q + 3] = va.w;
        wb[rt][4 * q] = vb.x; wb[rt][4 * q + 1] = vb.y; wb[rt][4 * q + 2] = vb.z; wb[rt][4 * q + 3] = vb.w;
      }
      const uint32_t s_a = Ss[ra * 4 + hi], s_b = Ss[rb * 4 + hi], b_a = Bs[ra * 4 + hi], b_b = Bs[rb * 4 + hi];
      sa[rt] = s_a | (s_a << 16); sb[rt] = s_b | (s_b << 16);
      ba[rt] = b_a | (b_a << 16); bb[rt] = b_b | (b_b << 16);
      if (BITS == 8 && XK == 1) {
        fsa[rt] = __uint_as_float(s_a << 16); fsb[rt] = __uint_as_float(s_b << 16);
        fba[rt] = __uint_as_float(b_a << 16); fbb[rt] = __uint_as_float(b_b << 16);
      }
    }

#pragma unroll
    for (int j = 0; j < 4; ++j) {                 // the lane's 8-column chunk j of its 32 columns
      uint32_t a[RT][2][4];                       // [tile][h][a0..a3]
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (BITS == 4) {
            // word j holds columns 8j..8j+7; shifts 8h and 8h+4 give the pairs (e_2h, e_2h+4), (e_2h+1, e_2h+5)
            const uint32_t MAG = XK == 1 ? 0x43004300u : 0x64006400u;
            const int sh = 8 * h;
            a[rt][h][0] = qg_deq<XK>(((wa[rt][j] >> sh) & 0x000F000Fu) | MAG, sa[rt], ba[rt]);
            a[rt][h][1] = qg_deq<XK>(((wb[rt][j] >> sh) & 0x000F000Fu) | MAG, sb[rt], bb[rt]);
            a[rt][h][2] = qg_deq<XK>(((wa[rt][j] >> (sh + 4)) & 0x000F000Fu) | MAG, sa[rt], ba[rt]);
            a[rt][h][3] = qg_deq<XK>(((wb[rt][j] >> (sh + 4)) & 0x000F000Fu) | MAG, sb[rt], bb[rt]);
          } else {
            // words 2j (h 0) and 2j+1 (h 1) hold 4 columns each: pairs (e0, e2) and (e1, e3)
            const uint32_t wA = wa[rt][2 * j + h], wB = wb[rt][2 * j + h];
            if constexpr (XK == 1) {
              a[rt][h][0] = qg_deq8_bf16(wA, fsa[rt], fba[rt]);
              a[rt][h][1] = qg_deq8_bf16(wB, fsb[rt], fbb[rt]);
              a[rt][h][2] = qg_deq8_bf16(wA >> 8, fsa[rt], fba[rt]);
              a[rt][h][3] = qg_deq8_bf16(wB >> 8, fsb[rt], fbb[rt]);
            } else {
              a[rt][h][0] = qg_deq<XK>((wA & 0x00FF00FFu) | 0x64006400u, sa[rt], ba[rt]);
              a[rt][h][1] = qg_deq<XK>((wB & 0x00FF00FFu) | 0x64006400u, sb[rt], bb[rt]);
              a[rt][h][2] = qg_deq<XK>(((wA >> 8) & 0x00FF00FFu) | 0x64006400u, sa[rt], ba[rt]);
              a[rt][h][3] = qg_deq<XK>(((wB >> 8) & 0x00FF00FFu) | 0x64006400u, sb[rt], bb[rt]);
            }
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < TT; ++nt) {
        const int row = (wm * TT + nt) * 8 + g;
        const uint4 xv = *(const uint4*)(Xs + row * 256 + (((j * 4 + t) ^ ((row & 1) * 4)) * 16));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t b0, b1;
          if constexpr (BITS == 4) {   // (x_2h, x_2h+4), (x_2h+1, x_2h+5)
            const uint32_t lo = h ? xv.y : xv.x, hi2 = h ? xv.w : xv.z;
            b0 = __byte_perm(lo, hi2, 0x5410); b1 = __byte_perm(lo, hi2, 0x7632);
          } else {           // (x_4h, x_4h+2), (x_4h+1, x_4h+3)
            const uint32_t lo = h ? xv.z : xv.x, hi2 = h ? xv.w : xv.y;
            b0 = __byte_perm(lo, hi2, 0x5410); b1 = __byte_perm(lo, hi2, 0x7632);
          }
#pragma unroll
          for (int rt = 0; rt < RT; ++rt)
            qm_mma<XK>(acc[rt][nt], a[rt][h][0], a[rt][h][1], a[rt][h][2], a[rt][h][3], b0, b1);
        }
      }
    }
  }
  qg_wait<0>();

  // epilogue: c0 / c1 = (row g, tokens 2t, 2t+1), c2 / c3 = (row g + 8, same tokens)
#pragma unroll
  for (int nt = 0; nt < TT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int m = m0 + (wm * TT + nt) * 8 + 2 * t + c;
      if (m >= M) continue;
      if constexpr (EPI == 1) {
        const int n = n0 + wn * 16 + g;
        if constexpr (PART == 1) {
          float* Y = (float*)y0 + ((size_t)blockIdx.z * M + m) * (2 * N);
          if (n < N) { Y[n] = acc[0][nt][c]; Y[N + n] = acc[1][nt][c]; }
          if (n + 8 < N) { Y[n + 8] = acc[0][nt][c + 2]; Y[N + n + 8] = acc[1][nt][c + 2]; }
        } else {
          if (n < N) y0[(size_t)m * N + n] = qg_out<YT>(qg_silu(acc[0][nt][c]) * acc[1][nt][c]);
          if (n + 8 < N) y0[(size_t)m * N + n + 8] = qg_out<YT>(qg_silu(acc[0][nt][c + 2]) * acc[1][nt][c + 2]);
        }
      } else {
        YPTR_SELECT
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          const int n = n0 + (wn * RT + rt) * 16 + g;
          YT* Yr = Y + ((size_t)blockIdx.z * M + m) * N;
          if (n < N) Yr[n] = qg_out<YT>(acc[rt][nt][c]);
          if (n + 8 < N) Yr[n + 8] = qg_out<YT>(acc[rt][nt][c + 2]);
        }
      }
    }
  }
"""


def _row_of(P: int, epi: int) -> str:
    if epi == 1:  # warp w's 32 tile rows: its 16 gate rows, then the same 16 up rows
        return ("const int w_ = r / 32, i_ = r % 32; const bool up = i_ >= 16;\n"
                "    W = up ? w1 : w0; S = up ? s1 : s0; B = up ? b1 : b0; n = n0 + w_ * 16 + (i_ & 15);")
    return f"W = {ptr_select('w', P)}; S = {ptr_select('s', P)}; B = {ptr_select('b', P)}; n = n0 + r;"


def group_select(P: int, epi: int) -> str:
    """Grouped (expert-segmented) launches: tile blockIdx.y's expert moves the weight, scale and bias
    pointers to that expert's [N, .] slab of the stacked [E, N, .] arrays; unused tiles (-1) exit, their
    output rows left unwritten (callers read only the rows of real pairs)."""
    ns = ["N"] * P if epi == 1 else [f"N{i}" for i in range(P)]
    moves = " ".join(f"w{i} += (size_t)ge * {n} * KW; s{i} += (size_t)ge * {n} * NG; b{i} += (size_t)ge * {n} * NG;"
                     for i, n in enumerate(ns))
    return f"const int ge = tile_expert[blockIdx.y];\n  if (ge < 0) return;\n  {moves}"


_X_LOAD = "qg_cp16(Xs + r * 256 + slot * 16, x + (size_t)min(m, M - 1) * K + k0 + ch * 8, m < M ? 16 : 0);"
# grouped 2: activation row m is x's row src_row[m] (-1: zeros), so the gathered buffer is never written
_X_LOAD_GATHER = ("const int xr = m < M ? src_row[m] : -1;\n"
                  "      qg_cp16(Xs + r * 256 + slot * 16, x + (size_t)max(xr, 0) * K + k0 + ch * 8, xr >= 0 ? 16 : 0);")


def body(P: int, epi: int, grouped: int = 0) -> str:
    """The kernel body for P projections (epi 1: SwiGLU of two); `grouped` 1: weights stacked [E, N, .] and
    each activation tile's expert read from `tile_expert` (moe/grouped.py); 2: besides, the M = len(src_row)
    activation rows read from x's rows src_row."""
    yptr = f"YT* Y = {ptr_select('y', 1 if epi else P)};"
    sel = proj_select(P, epi, tile="NOUT")
    if grouped:  # N is dimension 1 of the stacked weights
        sel = sel.replace("_shape[0];", "_shape[1];")
    return (shared_fragments(_BODY).replace("PROJ_SELECT", sel).replace("YPTR_SELECT", yptr)
            .replace("ROW_OF", _row_of(P, epi)).replace("GROUP_SELECT", group_select(P, epi) if grouped else "")
            .replace("M_ROWS", "src_row_shape[0]" if grouped == 2 else "x_shape[0]")
            .replace("X_LOAD", _X_LOAD_GATHER if grouped == 2 else _X_LOAD))


def stage_bytes(bits: int, RT: int, TT: int, WN: int, WM: int) -> int:
    TR, MB = 16 * RT * WN, 8 * TT * WM
    return TR * (16 * bits + 16) + MB * 256
