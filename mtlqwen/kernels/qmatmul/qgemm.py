"""Tensor-core quantized matmul for 9..1024 rows (CUDA): y = x W^T over MLX affine 4/8-bit weights, the
packed weights unpacked in registers and never written back dequantized.

Layout of one launch. A threadblock owns TR = 16*RT*WN weight rows and MB = 8*TT*WM activation rows (tokens);
warp (wn, wm) owns RT 16-row tiles and TT 8-token tiles and computes C^T = W x^T with mma.sync m16n8k16
(weights as the A operand, tokens as B, fp32 accumulators). The K loop walks 128-column steps through a
STAGES-deep cp.async pipeline in shared memory: the weight rows' packed words, their scales and biases, and
the x tile. A lane (g = lane/4, t = lane%4) takes 32 consecutive columns of its rows (one 16-byte chunk of
4-bit words) and the same 32 columns of x; inside them the k order is permuted so that one mask-and-OR
turns a word into bf16/fp16 pairs (OFF + q) -- the mma sums over k, so the x pairs are permuted alike.
Dequantization is exact up to one rounding: w = (OFF + q - OFF) * s + b in bf16x2 / half2 (fma), as MLX's
dequantize rounds s*q + b once.

Split-K (grid z) fills the SMs when N/TR * M/MB blocks are too few: each split writes fp32 partials
[S, M, N'] that one MLX sum reduces (deterministic, no atomics), or the reduce launch of splitk.py. Fused forms: P projections of one x in one
launch (blocks walk the concatenated rows), and SwiGLU (EPI 1, RT 2: tile 0 reads gate rows, tile 1 the same
up rows, silu(gate) * up in the epilogue). Grouped form (moe/grouped.py, the MoE prefill): the same body over
stacked experts' weights [E, N, .], each MB-row activation tile reading its expert from `tile_expert`.

CUDA only: on Metal the quantized matmul of these sizes is MLX's own `quantized_matmul` (selection.py).
The reference twin is `linear_ref` (MLX's quantized_matmul), which the CPU runs.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, PortableKernel
from ..selection import SELECT
from . import splitk
from .bodies import MMA_HEADER, proj_select, ptr_select
from .params import LinearParams

POISON: float | None = None  # tests set NaN: every output element must then be written by the kernel
_XKIND = {mx.bfloat16: 1, mx.float16: 2}
KSTEP = 128  # columns per pipeline stage
NUM_SMS = 132  # H200; split-K aims at a few waves of blocks over them

_HEADER = r"""
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


def shared_fragments(body: str) -> str:
    """`body` with K_SPLIT, ROW_OF_FN, STAGE_PTRS, SB_LOAD and NEXT_STAGE (each on a line of its own) written
    out; ROW_OF stays for the caller."""
    for name, text in (("K_SPLIT", K_SPLIT), ("ROW_OF_FN", ROW_OF_FN), ("STAGE_PTRS", STAGE_PTRS),
                       ("SB_LOAD", SB_LOAD), ("NEXT_STAGE", NEXT_STAGE)):
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
  int blk = blockIdx.x;
  int p = 0;
  PROJ_SELECT
  const int n0 = blk * NOUT;
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


def _group_select(P: int, epi: int) -> str:
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


def _body(P: int, epi: int, grouped: int = 0) -> str:
    """The kernel body for P projections (epi 1: SwiGLU of two); `grouped` 1: weights stacked [E, N, .] and
    each activation tile's expert read from `tile_expert` (moe/grouped.py); 2: besides, the M = len(src_row)
    activation rows read from x's rows src_row."""
    yptr = f"YT* Y = {ptr_select('y', 1 if epi else P)};"
    sel = proj_select(P, epi, tile="NOUT")
    if grouped:  # N is dimension 1 of the stacked weights
        sel = sel.replace("_shape[0];", "_shape[1];")
    return (shared_fragments(_BODY).replace("PROJ_SELECT", sel).replace("YPTR_SELECT", yptr)
            .replace("ROW_OF", _row_of(P, epi)).replace("GROUP_SELECT", _group_select(P, epi) if grouped else "")
            .replace("M_ROWS", "src_row_shape[0]" if grouped == 2 else "x_shape[0]")
            .replace("X_LOAD", _X_LOAD_GATHER if grouped == 2 else _X_LOAD))


def stage_bytes(bits: int, RT: int, TT: int, WN: int, WM: int) -> int:
    TR, MB = 16 * RT * WN, 8 * TT * WM
    return TR * (16 * bits + 16) + MB * 256


# kernels are built per (P, epi, shared-memory size): MLX's cuda_kernel fixes the dynamic shared memory
# when the kernel object is made
_KERNELS: dict = {}


def _kernel(P: int, epi: int, smem: int, grouped: int = 0) -> PortableKernel:
    key = (P, epi, smem, grouped)
    if key not in _KERNELS:
        ins = (["x"] + [f"{a}{i}" for i in range(P) for a in ("w", "s", "b")]
               + ["tile_expert", "src_row"][:grouped])
        outs = ["y0"] if epi == 1 else [f"y{i}" for i in range(P)]
        body = _body(P, epi, grouped)
        _KERNELS[key] = PortableKernel(
            name=f"mtl_qgemm{f'_grouped{grouped}' if grouped else ''}_p{P}_e{epi}_s{smem}", input_names=ins,
            output_names=outs, body=body,
            cuda_body=body, header=_HEADER + MMA_HEADER, shared_memory=smem)
    return _KERNELS[key]


def config(M: int, N: int, K: int, bits: int, epi: int) -> tuple[int, int, int, int, int, int]:
    """(RT, TT, WN, WM, STAGES, SPLIT) for a launch; chosen from the H200 sweep (benchmarks/qgemm.md)."""

    RT = 2 if epi == 1 else SELECT["qgemm_rt"]
    # tokens per block and pipeline depth: the best of the device-time sweep at 16 / 32 / 64 / 128+ rows
    if M <= 16:
        TT, WM, ST = 2, 1, 2
    elif M <= 32:
        TT, WM, ST = 4, 1, 2
    else:
        TT, WM, ST = 8, 1, 3
    WN = 4
    TR = 16 * RT * WN
    nout = 16 * WN if epi == 1 else TR
    blocks = -(-N // nout) * -(-M // (8 * TT * WM))
    return RT, TT, WN, WM, ST, split_k(blocks, K, SELECT["qgemm_split_waves"] * NUM_SMS)


def split_k(blocks: int, K: int, target: int) -> int:
    """The split of K (a power of two) that brings `blocks` up to at most `target` blocks, each split keeping
    at least 4 k-steps."""
    KT, split = K // KSTEP, 1
    while blocks * split * 2 <= target and KT // (split * 2) >= 4:
        split *= 2
    return split


def supported(x: mx.array, ps: list[LinearParams]) -> bool:
    p0 = ps[0]
    if not (x.ndim == 2 and x.dtype in _XKIND and x.shape[0] >= 1):
        return False
    K = x.shape[1]
    return all(
        p.quantized and p.bits in (4, 8) and p.group_size in (32, 64, 128) and p.bits == p0.bits
        and p.group_size == p0.group_size and p.in_features == K and p.scales.dtype == x.dtype
        and p.biases.dtype == x.dtype
        for p in ps
    ) and K % 256 == 0


def qgemm(x: mx.array, ps: list[LinearParams], epi: int = 0, cfg: tuple | None = None) -> list[mx.array]:
    """x [M, K] -> [y_p [M, N_p]] (epi 0) or [silu(x W_0^T) * (x W_1^T)] (epi 1), on tensor cores.
    `cfg` = (RT, TT, WN, WM, STAGES, SPLIT) overrides the table (benchmarks sweep it)."""
    M, K = x.shape
    p0 = ps[0]
    N0 = p0.out_features
    RT, TT, WN, WM, ST, split = cfg if cfg is not None else config(M, N0, K, p0.bits, epi)
    if epi == 1:
        assert RT == 2, "SwiGLU tiles pair 16 gate rows with 16 up rows"
    TR, MB = 16 * RT * WN, 8 * TT * WM
    nout = 16 * WN if epi == 1 else TR
    nbn = sum(-(-p.out_features // nout) for p in ([p0] if epi == 1 else ps))
    nbm = -(-M // MB)
    smem = ST * stage_bytes(p0.bits, RT, TT, WN, WM)
    yt = mx.float32 if split > 1 else x.dtype
    if epi == 1:
        shapes = [(split, M, 2 * N0)] if split > 1 else [(M, N0)]
    else:
        shapes = [(split, M, p.out_features) if split > 1 else (M, p.out_features) for p in ps]
    kern = _kernel(len(ps), epi, smem)
    outs = kern(
        "cuda",
        inputs=[x] + [a for p in ps for a in (p.weight, p.scales, p.biases)],
        output_shapes=shapes, output_dtypes=[yt] * len(shapes),
        grid=(nbn * 32 * WN * WM, nbm, split), threadgroup=(32 * WN * WM, 1, 1),
        template=[("T", x.dtype), ("XK", _XKIND[x.dtype]), ("BITS", p0.bits), ("GS", p0.group_size),
                  ("RT", RT), ("TT", TT), ("WN", WN), ("WM", WM), ("STAGES", ST), ("P", len(ps)),
                  ("EPI", epi), ("PART", int(split > 1)), ("YT", yt)],
        init_value=POISON,
    )
    return finish(list(outs), split, epi, x.dtype, N0)


def finish(outs: list[mx.array], split: int, epi: int, dtype, N0: int) -> list[mx.array]:
    """A launch's outputs -> the call's: split-K partials [S, M, N'] reduced (and SwiGLU applied) in `dtype`."""
    if split == 1:
        return outs
    if SELECT["qgemm_reduce_kernel"] and splitk.covers(outs, epi):  # one launch for every output
        return splitk.reduce("cuda", outs, epi, dtype, init_value=POISON)
    if epi == 1:
        s = mx.sum(outs[0], axis=0)
        g, u = s[:, :N0], s[:, N0:]
        return [(g * mx.sigmoid(g) * u).astype(dtype)]
    return [mx.sum(o, axis=0).astype(dtype) for o in outs]


def examples() -> list[tuple[PortableKernel, KernelExample]]:
    """Instantiations for check_cuda: every template the table launches for one projection (three row
    classes x 4/8-bit, bf16, fp16 at 64 rows), three projections, and SwiGLU at two row classes."""
    combos = ([(1, 0, mx.bfloat16, bits, M) for bits in (4, 8) for M in (16, 32, 64)]
              + [(1, 0, mx.float16, bits, 64) for bits in (4, 8)] + [(3, 0, mx.bfloat16, 4, 64)]
              + [(2, 1, mx.bfloat16, bits, M) for bits in (4, 8) for M in (16, 64)])
    out = []
    for P, epi, dt, bits, M in combos:
        RT, TT, WN, WM, ST, split = config(M, 4096, 4096, bits, epi)
        kern = _kernel(P, epi, ST * stage_bytes(bits, RT, TT, WN, WM))
        yt = mx.float32 if split > 1 else dt
        wq = [(mx.uint32, (4096, 4096 * bits // 32)), (dt, (4096, 4096 // 64)), (dt, (4096, 4096 // 64))]
        ex = KernelExample(
            inputs=[(dt, (M, 4096))] + wq * P, outputs=[yt] * (1 if epi else P),
            template=[("T", dt), ("XK", _XKIND[dt]), ("BITS", bits), ("GS", 64), ("RT", RT), ("TT", TT),
                      ("WN", WN), ("WM", WM), ("STAGES", ST), ("P", P), ("EPI", epi), ("PART", int(split > 1)),
                      ("YT", yt)])
        out.append((kern, ex))
    return out


def available() -> bool:
    return gpu_backend() == "cuda"
