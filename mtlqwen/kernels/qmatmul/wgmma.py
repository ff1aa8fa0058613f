"""qgemm on Hopper's warpgroup MMA (sm_90a `wgmma.mma_async`): y = x W^T over MLX affine 4-bit weights for
9..128 rows, the packed weights unpacked in registers as in qgemm.py, which this replaces on CUDA devices of
compute capability 9 from SELECT "qgemm_wgmma_min_rows" rows.

Why: qgemm's mma.sync runs at half of Hopper's tensor rate and builds every activation fragment itself (a
shared-memory load and two byte permutes per 8 tokens and 16 columns, repeated by each of the block's warps).
Here the tensor cores read the activation tile from shared memory themselves (a matrix descriptor), and each
lane only unpacks its weight fragments. Measured, that alone gained nothing: both forms wait on their loads
(benchmarks/qgemm.md). What gained 8-19% at 64 rows is two warpgroups a block sharing one x tile, so a stage
carries twice the weight bytes for the same activation bytes.

Layout of one launch: a block is WG warpgroups (4 warps, 128 threads each) and owns TR = 64 * RT * WG weight
rows and NB tokens (16, 32 or 64: the wgmma's N). Warp w of warpgroup q holds rows 16w..16w+15 of each of
its RT 64-row groups (group q * RT + rt of the block), in the m16n8k16 A-fragment layout wgmma takes from
registers: lane (g = lane/4, t = lane%4) holds columns 2t, 2t+1,
2t+8, 2t+9 of each 16-column step for rows g and g+8, that is byte t of each packed 4-bit word (nibbles 2t,
2t+1), turned into a bf16/fp16 pair by one byte permute, one multiply and one mask-and-OR, then dequantized
exactly as qgemm does (one rounding). The K loop walks 128-column steps through a STAGES-deep cp.async
pipeline: the weight rows' packed words (rows padded to 80 bytes, so 8 rows' 16-byte loads hit distinct
banks), their scales and biases, and the x tile stored as wgmma's "core matrices" (8 tokens x 16 bytes,
contiguous, no swizzle): chunk c of token r at c * NB * 16 + r * 16, so a 16-column step is the two chunks
2kk, 2kk+1 (leading-dimension offset NB * 16 bytes, stride between 8-token groups 128 bytes).

Each 16-column step: unpack the A fragments, `wgmma.fence`, one wgmma per row group, commit; NBUF fragment
buffers let the next steps unpack while up to NBUF - 1 earlier ones run (wait_group NBUF - 1). Each k-step
drains its wgmmas before the barrier after which its stage takes new loads. The cp.async writes reach the
async proxy the tensor cores read through `fence.proxy.async` before that barrier.

Split-K, the P-projection and SwiGLU forms and the outputs are qgemm's (same partial layout, same reduce).
The reference twin is `linear_ref` (MLX's quantized_matmul), which the CPU runs.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, PortableKernel
from ..selection import SELECT
from . import qgemm, qgemm_source
from .bodies import proj_select, ptr_select
from .params import LinearParams

NBS = (16, 32, 64)  # tokens per block (the wgmma's N)


def _mma_fn(nb: int) -> str:
    """wg_mma_n{nb}<XK>(d, a0..a3, desc): d[nb/2] += A (registers) x B (shared memory, K-major)."""
    nd = nb // 2
    ds = ", ".join(f"%{i}" for i in range(nd))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))

    def asm(ty: str) -> str:
        return (f'asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n'
                f'wgmma.mma_async.sync.aligned.m64n{nb}k16.f32.{ty}.{ty} {{{ds}}}, '
                f'{{%{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}}}, %{nd + 4}, p, 1, 1, 0;\\n}}\\n"\n'
                f'      : {outs}\n      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));')
    return (f"template <int XK>\n__device__ __forceinline__ void wg_mma_n{nb}(float (&d)[{nd}], uint32_t a0, "
            f"uint32_t a1, uint32_t a2, uint32_t a3, uint64_t desc) {{\n"
            f"  if constexpr (XK == 1) {{\n    {asm('bf16')}\n  }} else {{\n    {asm('f16')}\n  }}\n}}\n"
            f"__device__ __forceinline__ void wg_hold_n{nb}(float (&d)[{nd}]) {{\n"
            f"#pragma unroll\n  for (int i = 0; i < {nd}; ++i) asm volatile(\"\" : \"+f\"(d[i])::\"memory\");\n}}\n")


_HEADER = qgemm_source.HEADER + r"""
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// the cp.async writes (generic proxy) made visible to the tensor cores' reads (async proxy)
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// shared-memory matrix descriptor, no swizzle: start, leading-dimension (K) and stride-dimension (N) byte offsets
__device__ __forceinline__ uint64_t wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
// byte t of a packed 4-bit word (columns 2t, 2t+1) -> the pair (OFF + q_2t, OFF + q_2t+1) as 16-bit halves
__device__ __forceinline__ uint32_t wg_pair(uint32_t w, uint32_t sel_t, uint32_t mag) {
  const uint32_t b = __byte_perm(w, 0u, sel_t);
  return ((b * 0x1001u) & 0x000F000Fu) | mag;     // b + (b << 12): q_2t+1 lands in bits 16..19
}
""" + "".join(_mma_fn(nb) for nb in NBS)

# Template constants: T, XK, GS, RT (64-row groups a warpgroup, 1 or 2), WG (warpgroups a block: they share the
# x tile), NB, STAGES, NBUF (A-fragment buffers: wgmma groups in flight), P, EPI, PART, YT (as qgemm.py)
_BODY = r"""
  constexpr int NT = 128 * WG;
  constexpr int TR = 64 * RT * WG;              // weight rows of the block
  constexpr int WROWB = 80;                     // bytes a row's 64 packed bytes take per stage (padded)
  constexpr int SBB = GS == 32 ? 8 : 4;         // bytes of one row's scales (or biases) per k-step
  constexpr int STAGE = TR * (WROWB + 16) + NB * 256;
  constexpr int NOUT = EPI == 1 ? 64 * WG : TR;
  constexpr int ND = NB / 2;                    // accumulators a thread holds per row group
  extern __shared__ __align__(128) unsigned char qg_smem[];

  const int M = x_shape[0];
  const int K = x_shape[1];
  const int NG = K / GS;
  const int KW = K / 8;                         // uint32 words per weight row
  const int tid = threadIdx.x;
  const int lane = tid & 31, wn = (tid >> 5) & 3, wgi = tid >> 7;
  const int g = lane >> 2, t = lane & 3;

BLOCK_COLS
  const int m0 = blockIdx.y * NB;
K_SPLIT
  // tile row r -> (pointers, global row); EPI 1: group 0 (rows 0..63) gate, group 1 the same up rows
ROW_OF_FN
STAGE_PTRS
    for (int c = tid; c < TR * 4; c += NT) {
      const int r = c >> 2, j = c & 3;
      const uint32_t* W; const T* S; const T* B;
      const int n = row_of(r, W, S, B);
      qg_cp16(Ws + r * WROWB + j * 16, W + (size_t)n * KW + (size_t)(k0 >> 3) + j * 4, 16);
    }
SB_LOAD
    for (int c = tid; c < NB * 16; c += NT) {    // consecutive threads, consecutive tokens: conflict-free
      const int r = c % NB, ch = c / NB;
      const int m = m0 + r;
      qg_cp16(Xs + ch * (NB * 16) + r * 16, x + (size_t)min(m, M - 1) * K + k0 + ch * 8, m < M ? 16 : 0);
    }
  };

  float acc[RT][ND];
#pragma unroll
  for (int i = 0; i < RT; ++i)
#pragma unroll
    for (int j = 0; j < ND; ++j) acc[i][j] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, kt0 + s);
    qg_commit();
  }
  const uint32_t sel_t = 0x4440u | (uint32_t)t;
  const uint32_t MAG = XK == 1 ? 0x43004300u : 0x64006400u;
  for (int i = 0; i < nk; ++i) {
    qg_wait<STAGES - 2>();
    wg_proxy_fence();
    __syncthreads();
NEXT_STAGE
    const unsigned char* Ss = base + TR * WROWB;
    const unsigned char* Bs = Ss + TR * 8;
    const unsigned xs = qg_smem_addr(Bs + TR * 8);
    const int kt = kt0 + i;

    // scale / bias words of rows g and g + 8 of each row group: 16-bit values of the k-step's groups
    uint32_t sw[RT][2][2], bw[RT][2][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = (wgi * RT + rt) * 64 + wn * 16 + g + 8 * h;
        if constexpr (SBB == 8) {
          const uint2 s2 = *(const uint2*)(Ss + r * 8), b2 = *(const uint2*)(Bs + r * 8);
          sw[rt][h][0] = s2.x; sw[rt][h][1] = s2.y; bw[rt][h][0] = b2.x; bw[rt][h][1] = b2.y;
        } else {
          sw[rt][h][0] = *(const uint32_t*)(Ss + r * 8); bw[rt][h][0] = *(const uint32_t*)(Bs + r * 8);
          sw[rt][h][1] = sw[rt][h][0]; bw[rt][h][1] = bw[rt][h][0];
        }
      }

    uint32_t af[NBUF][RT][4];                     // A fragments of the last NBUF 16-column steps
#pragma unroll
    for (int u = 0; u < 4; ++u) {                 // 32 columns: words 4u..4u+3 of each row
      uint4 wv[RT][2];
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wv[rt][h] = *(const uint4*)(Ws + ((wgi * RT + rt) * 64 + wn * 16 + g + 8 * h) * WROWB + u * 16);
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) {
        const int kk = 2 * u + hk;                // the 16-column step: chunks 2kk (words 4u + 2hk) and 2kk + 1
        // this step's group among the k-step's loaded scales
        const int gr = GS == 32 ? kk / 2 : (GS == 64 ? kk / 4 : (kt & 1));
        const uint32_t hsel = (gr & 1) ? 0x3232u : 0x1010u;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {           // h 0: row g (a0, a2), h 1: row g + 8 (a1, a3)
            const uint32_t s2 = __byte_perm(sw[rt][h][gr >> 1], 0u, hsel);
            const uint32_t b2 = __byte_perm(bw[rt][h][gr >> 1], 0u, hsel);
            const uint32_t lo = hk ? wv[rt][h].z : wv[rt][h].x, hi = hk ? wv[rt][h].w : wv[rt][h].y;
            af[kk % NBUF][rt][h] = qg_deq<XK>(wg_pair(lo, sel_t, MAG), s2, b2);
            af[kk % NBUF][rt][h + 2] = qg_deq<XK>(wg_pair(hi, sel_t, MAG), s2, b2);
          }
        }
        wg_fence();
        const uint64_t desc = wg_desc(xs + (unsigned)(2 * kk * NB * 16), LBO, SBO);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          wg_hold_nNB(acc[rt]);
          wg_mma_nNB<XK>(acc[rt], af[kk % NBUF][rt][0], af[kk % NBUF][rt][1], af[kk % NBUF][rt][2],
                         af[kk % NBUF][rt][3], desc);
          wg_hold_nNB(acc[rt]);
        }
        wg_commit();
        wg_wait<NBUF - 1>();                      // the buffer the next step writes is free
      }
    }
    // drained before the next k-step's barrier frees this stage for loads (keeping wgmmas in flight across
    // the loop's back edge makes ptxas serialize them all)
    wg_wait<0>();
  }
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) wg_hold_nNB(acc[rt]);
  qg_wait<0>();

  // epilogue: acc[rt][4j + c], c0 / c1 = (row g, tokens 8j + 2t, + 1), c2 / c3 = (row g + 8, same tokens)
#pragma unroll
  for (int j = 0; j < NB / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int m = m0 + 8 * j + 2 * t + c;
      if (m >= M) continue;
      if constexpr (EPI == 1) {
        const int n = n0 + wgi * 64 + wn * 16 + g;
        if constexpr (PART == 1) {
          float* Y = (float*)y0 + ((size_t)blockIdx.z * M + m) * (2 * N);
          if (n < N) { Y[n] = acc[0][4 * j + c]; Y[N + n] = acc[1][4 * j + c]; }
          if (n + 8 < N) { Y[n + 8] = acc[0][4 * j + c + 2]; Y[N + n + 8] = acc[1][4 * j + c + 2]; }
        } else {
          if (n < N) y0[(size_t)m * N + n] = qg_out<YT>(qg_silu(acc[0][4 * j + c]) * acc[1][4 * j + c]);
          if (n + 8 < N) y0[(size_t)m * N + n + 8] = qg_out<YT>(qg_silu(acc[0][4 * j + c + 2]) * acc[1][4 * j + c + 2]);
        }
      } else {
        YPTR_SELECT
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          const int n = n0 + (wgi * RT + rt) * 64 + wn * 16 + g;
          YT* Yr = Y + ((size_t)blockIdx.z * M + m) * N;
          if (n < N) Yr[n] = qg_out<YT>(acc[rt][4 * j + c]);
          if (n + 8 < N) Yr[n + 8] = qg_out<YT>(acc[rt][4 * j + c + 2]);
        }
      }
    }
  }
"""


def _row_of(P: int, epi: int) -> str:
    if epi == 1:
        return ("const bool up = (r >> 6) & 1;\n"  # warpgroup q's rows 128q.. gate, 128q+64.. up
                "    W = up ? w1 : w0; S = up ? s1 : s0; B = up ? b1 : b0; n = n0 + (r >> 7) * 64 + (r & 63);")
    return f"W = {ptr_select('w', P)}; S = {ptr_select('s', P)}; B = {ptr_select('b', P)}; n = n0 + r;"


def _body(P: int, epi: int, nb: int) -> str:
    lbo, sbo = f"{nb * 16}u", "128u"  # the x tile's next 8 columns (K), its next 8 tokens (N)
    yptr = f"YT* Y = {ptr_select('y', 1 if epi else P)};"
    return (qgemm_source.shared_fragments(_BODY).replace("PROJ_SELECT", proj_select(P, epi, tile="NOUT"))
            .replace("YPTR_SELECT", yptr)
            .replace("ROW_OF", _row_of(P, epi)).replace("wg_hold_nNB", f"wg_hold_n{nb}")
            .replace("wg_mma_nNB", f"wg_mma_n{nb}").replace("LBO", lbo).replace("SBO", sbo))


def stage_bytes(groups: int, NB: int) -> int:
    """One pipeline stage for `groups` 64-row groups a block (RT x WG) and NB tokens."""
    return 64 * groups * (80 + 16) + NB * 256


_KERNELS: dict = {}


def _kernel(P: int, epi: int, nb: int, smem: int) -> PortableKernel:
    key = (P, epi, nb, smem)
    if key not in _KERNELS:
        ins = ["x"] + [f"{a}{i}" for i in range(P) for a in ("w", "s", "b")]
        outs = ["y0"] if epi == 1 else [f"y{i}" for i in range(P)]
        body = _body(P, epi, nb)
        _KERNELS[key] = PortableKernel(
            name=f"mtl_wgmma_p{P}_e{epi}_n{nb}_s{smem}", input_names=ins,
            output_names=outs, body=body, cuda_body=body, header=_HEADER, shared_memory=smem)
    return _KERNELS[key]


def config(M: int, N: int, K: int, epi: int) -> tuple[int, int, int, int, int, int]:
    """(RT, NB, STAGES, SPLIT, NBUF, WG): the smallest token tile that holds M (up to 64; more rows take
    several), two 64-row groups a warpgroup. From the H200 sweep (benchmarks/qgemm.md): at 64 tokens two
    warpgroups a block sharing the x tile, three stages, and split-K only up to about half the SMs' worth of
    blocks (a split's partials and its reduce launch cost more than the blocks it adds); at 16 / 32 tokens one
    warpgroup, two stages, splits up to qgemm_split_waves waves."""
    NB = next((nb for nb in NBS if M <= nb), NBS[-1])
    RT = 2
    WG, ST, target = (2, 3, qgemm.NUM_SMS // 2) if NB == 64 else (1, 2, SELECT["qgemm_split_waves"] * qgemm.NUM_SMS)
    blocks = -(-N // _nout(RT, WG, epi)) * -(-M // NB)
    return RT, NB, ST, qgemm.split_k(blocks, K, target), 2, WG


def _nout(RT: int, WG: int, epi: int) -> int:
    """Output rows of a block: SwiGLU pairs each warpgroup's gate group with its up group."""
    return 64 * WG if epi == 1 else 64 * RT * WG


def _template(dt, gs: int, cfg: tuple, P: int, epi: int) -> list:
    RT, NB, ST, split, NBUF, WG = cfg
    return [("T", dt), ("XK", qgemm_source.XKIND[dt]), ("GS", gs), ("RT", RT), ("WG", WG), ("NB", NB), ("STAGES", ST),
            ("NBUF", NBUF), ("P", P), ("EPI", epi), ("PART", int(split > 1)),
            ("YT", mx.float32 if split > 1 else dt)]


def takes(x: mx.array, ps: list[LinearParams]) -> bool:
    """x has at least SELECT["qgemm_wgmma_min_rows"] rows (0: never), the device is a Hopper (CUDA, compute
    capability 9) and every projection is 4-bit."""
    m = SELECT["qgemm_wgmma_min_rows"]
    return (0 < m <= x.shape[0] and available() and all(p.quantized and p.bits == 4 for p in ps)
            and qgemm.supported(x, ps))


def qgemm_wg(x: mx.array, ps: list[LinearParams], epi: int = 0, cfg: tuple | None = None) -> list[mx.array]:
    """x [M, K] -> [y_p [M, N_p]] (epi 0) or [silu(x W_0^T) * (x W_1^T)] (epi 1), as qgemm.qgemm.
    `cfg` = (RT, NB, STAGES, SPLIT, NBUF, WG) overrides the table (benchmarks sweep it)."""
    M, K = x.shape
    p0 = ps[0]
    N0 = p0.out_features
    cfg = cfg if cfg is not None else config(M, N0, K, epi)
    RT, NB, ST, split, NBUF, WG = cfg
    if epi == 1 and RT != 2:
        raise ValueError(f"SwiGLU pairs the gate group with the up group: RT must be 2, not {RT}")
    nout = _nout(RT, WG, epi)
    nbn = sum(-(-p.out_features // nout) for p in ([p0] if epi == 1 else ps))
    nbm = -(-M // NB)
    smem = ST * stage_bytes(RT * WG, NB)
    yt = mx.float32 if split > 1 else x.dtype
    if epi == 1:
        shapes = [(split, M, 2 * N0)] if split > 1 else [(M, N0)]
    else:
        shapes = [(split, M, p.out_features) if split > 1 else (M, p.out_features) for p in ps]
    outs = _kernel(len(ps), epi, NB, smem)(
        "cuda",
        inputs=[x] + [a for p in ps for a in (p.weight, p.scales, p.biases)],
        output_shapes=shapes, output_dtypes=[yt] * len(shapes),
        grid=(nbn * 128 * WG, nbm, split), threadgroup=(128 * WG, 1, 1),
        template=_template(x.dtype, p0.group_size, cfg, len(ps), epi),
        init_value=qgemm.POISON,
    )
    return qgemm.finish(list(outs), split, epi, x.dtype, N0)


def examples() -> list[tuple[PortableKernel, KernelExample]]:
    """Instantiations for check_cuda: each token tile at one and four projections, bf16 and fp16, SwiGLU."""
    combos = ([(1, 0, mx.bfloat16, M) for M in (16, 32, 64)] + [(1, 0, mx.float16, 64), (4, 0, mx.bfloat16, 64)]
              + [(2, 1, mx.bfloat16, M) for M in (16, 64)])
    out = []
    for P, epi, dt, M in combos:
        cfg = config(M, 4096, 4096, epi)
        RT, NB, ST, split, NBUF, WG = cfg
        kern = _kernel(P, epi, NB, ST * stage_bytes(RT * WG, NB))
        wq = [(mx.uint32, (4096, 512)), (dt, (4096, 64)), (dt, (4096, 64))]
        ex = KernelExample(inputs=[(dt, (M, 4096))] + wq * P,
                           outputs=[mx.float32 if split > 1 else dt] * (1 if epi else P),
                           template=_template(dt, 64, cfg, P, epi))
        out.append((kern, ex))
    return out


def available() -> bool:
    """CUDA on compute capability 9: MLX's JIT compiles for the arch-specific target (sm_90a) there, which
    wgmma needs."""
    global _CC
    if gpu_backend() != "cuda":
        return False
    if _CC is None:  # the device does not change within a process
        _CC = int(mx.device_info().get("compute_capability_major", 0))
    return _CC == 9


_CC: int | None = None
