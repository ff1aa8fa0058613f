"""Prefill attention over paged KV on tensor cores (CUDA): FlashAttention-2 over the cached blocks.

One threadblock of NW warps owns (sequence, KV head g, query tile): BM = 16*NW query rows, row r = token
t0 + r / REP of the sequence x query head g*REP + r % REP (GQA: the REP heads of g share every K/V tile
the block loads). Warp w owns rows 16w..16w+15. Per tile of 64 keys, read from the paged pools through the
block table into shared memory (cp.async, zero-filled past the sequence's end):
  S = Q K^T (mma.sync m16n8k16, Q and K fragments by ldmatrix, fp32 accumulate), causal mask where the tile
  crosses the tile's first query position, online softmax in exp2 (scale folded in), P packed to 16 bit
  in registers as the A operand of O += P V (V fragments by ldmatrix.trans).
The V tile's copy overlaps the QK^T of its keys, the next K tile's copy the PV (FA2's order). Shared
rows are 16-byte-chunk swizzled (chunk ^ row % 8) so ldmatrix reads hit 8 different banks. No T x S score
matrix exists anywhere; the sigmoid output gate is applied in the epilogue, as in the decode kernel.

A batch of too few query tiles to fill the SMs (a short chunk over a long context) also splits its key range
(grid x NS, `plan`): each split writes unnormalised partials (o, m, l) that the decode kernel's merge
(kernels.py) combines and gates.

The new tokens' own K/V are already in the pools (write_kv_inplace / write_kv run first), so "its cached
blocks plus its own chunk" is one key range 0 .. kv_valid + q_len per sequence.

CUDA only (Apple GPUs have no mma.sync): on Metal prefill batches take the decode kernel's portable SIMT
body (kernels.py; selection.py row prefill_attn_min_queries). The reference twin is paged_attention_ref.
"""

from __future__ import annotations

import mlx.core as mx

from ..portable import KernelExample, PortableKernel
from ..selection import SELECT
from ..tensor_core import MMA_HEADER
from ..seqs import SeqLayout
from . import kernels as decode
from .kernels import MAX_SPLITS

POISON: float | None = None  # tests set NaN: every output element must then be written by the kernel
_XKIND = {mx.bfloat16: 1, mx.float16: 2}
KEYS = 64  # keys per tile
HEAD_DIMS = (64, 128, 256)

_HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define PF_NEG_INF (__int_as_float(0xff800000))
__device__ __forceinline__ unsigned pf_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// 16-byte copy global -> shared; src_bytes 0 writes zeros (rows past the sequence, padding query rows)
__device__ __forceinline__ void pf_cp16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(pf_smem(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void pf_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void pf_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void pf_ldm4(uint32_t (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void pf_ldm4t(uint32_t (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// two floats -> one register of two 16-bit values (lo = the lower column)
template <int XK> __device__ __forceinline__ uint32_t pf_pack(float lo, float hi) {
  uint32_t r;
  if constexpr (XK == 1) { __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); r = *reinterpret_cast<uint32_t*>(&v); }
  else { __half2 v = __floats2half2_rn(lo, hi); r = *reinterpret_cast<uint32_t*>(&v); }
  return r;
}
template <int XK> __device__ __forceinline__ float pf_f(unsigned short u) {
  if constexpr (XK == 1) return __uint_as_float(((uint32_t)u) << 16);
  else return __half2float(__ushort_as_half(u));
}
"""

# Template constants: TQ (q / pool / out dtype), XK (1 bf16, 2 fp16), HD, REP, BT (block tokens), NW (warps),
# GST / GOF (gate row stride and offset in elements). prm = [NQT query tiles, NS key splits, CS keys a split
# (a multiple of 64)]. Split launches (NS > 1) write unnormalised partials po / pm / pl that the decode kernel's
# merge (kernels.py) combines and gates, as the decode kernel's own split does.
_BODY = r"""
  constexpr int BM = 16 * NW;                // query rows of the tile
  constexpr int TPT = BM / REP;              // tokens of the tile
  constexpr int CH = HD / 8;                 // 16-byte chunks per row
  constexpr int NT = 32 * NW;
  constexpr int KN = 64;                     // keys per tile
  extern __shared__ __align__(16) unsigned char pf_sm[];
  unsigned char* Qs = pf_sm;                 // [BM][HD] swizzled
  unsigned char* Ks = Qs + BM * HD * 2;      // [KN][HD]
  unsigned char* Vs = Ks + KN * HD * 2;      // [KN][HD]

  const int nH = q_shape[1];
  const int nKV = k_pool_shape[2];
  const int nbt = block_tables_shape[1];
  const int nseq = kv_valid_shape[0];
  const int NQT = prm[0], NS = prm[1], CS = prm[2];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  int id = blockIdx.x;
  const int split = id % NS; id /= NS;
  const int g = id % nKV; id /= nKV;
  const int seq = id % nseq; id /= nseq;
  const int qt = NQT - 1 - id;               // the longest key ranges first
  const int q0 = query_start_loc[seq];
  const int qlen = query_start_loc[seq + 1] - q0;
  const int past = kv_valid[seq];
  const int t0 = qt * TPT;
  if (t0 >= qlen) return;                    // uniform: no tokens of this sequence in this tile
  const int ntok = min(TPT, qlen - t0);
  const int kend = past + t0 + ntok;         // keys the tile's last token sees
  const int kbeg = split * CS, kstop = min(kbeg + CS, kend);   // this split's keys (tiles never straddle it)
  const float sl2 = scale_arr[0] * 1.4426950408889634f;
  const int* table = block_tables + (size_t)seq * nbt;

  // Q tile (rows past ntok tokens zero-filled)
  for (int c = tid; c < BM * CH; c += NT) {
    const int r = c / CH, ch = c % CH, tl = r / REP;
    const bool ok = tl < ntok;
    const TQ* src = q + ((size_t)(q0 + t0 + (ok ? tl : 0)) * nH + g * REP + r % REP) * HD + ch * 8;
    pf_cp16(Qs + r * HD * 2 + ((ch ^ (r & 7)) * 16), src, ok ? 16 : 0);
  }
  auto load_kv = [&](unsigned char* dst, const TQ* pool, int kc) {
    for (int c = tid; c < KN * CH; c += NT) {
      const int r = c / CH, ch = c % CH, l = kc + r;
      const bool ok = l < kend;
      const int blk = ok ? table[l / BT] : 0;
      const TQ* src = pool + ((size_t)(blk * BT + (ok ? l % BT : 0)) * nKV + g) * HD + ch * 8;
      pf_cp16(dst + r * HD * 2 + ((ch ^ (r & 7)) * 16), src, ok ? 16 : 0);
    }
  };
  if (kbeg < kstop) load_kv(Ks, k_pool, kbeg);
  pf_commit();

  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
  float m_a = PF_NEG_INF, m_b = PF_NEG_INF, l_a = 0.0f, l_b = 0.0f;   // rows gq and gq + 8 of the warp
  const int ra = warp * 16 + gq, rb = ra + 8;
  const int lim_a = past + t0 + ra / REP + 1, lim_b = past + t0 + rb / REP + 1;   // causal: keys < lim
  const int mask_from = past + t0 + 1;       // tiles ending at or before this need no mask
  const unsigned qs_base = pf_smem(Qs), ks_base = pf_smem(Ks), vs_base = pf_smem(Vs);

  for (int kc = kbeg; kc < kstop; kc += KN) {
    pf_wait<0>();
    __syncthreads();                         // K tile in; every warp done with the previous V tile
    load_kv(Vs, v_pool, kc);
    pf_commit();

    // S = Q K^T: 16 rows x 64 keys per warp, k over hd in steps of 16
    float s[KN / 8][4];
#pragma unroll
    for (int n = 0; n < KN / 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4];
      {
        const int r = warp * 16 + (lane & 15), ch = 2 * kk + (lane >> 4);
        pf_ldm4(a, qs_base + r * HD * 2 + ((ch ^ (r & 7)) * 16));
      }
#pragma unroll
      for (int p = 0; p < KN / 16; ++p) {
        uint32_t b[4];
        const int m = lane >> 3;
        const int r = 16 * p + (lane & 7) + 8 * (m >> 1), ch = 2 * kk + (m & 1);
        pf_ldm4(b, ks_base + r * HD * 2 + ((ch ^ (r & 7)) * 16));
        qm_mma<XK>(s[2 * p], a[0], a[1], a[2], a[3], b[0], b[1]);
        qm_mma<XK>(s[2 * p + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }
    // online softmax (log2 domain); the 4 lanes of a row share its max through shuffles
    const bool masked = kc + KN > mask_from;
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int n = 0; n < KN / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int key = kc + 8 * n + 2 * tq + i;
        float va = s[n][i] * sl2, vb = s[n][2 + i] * sl2;
        if (masked) {
          if (key >= lim_a) va = PF_NEG_INF;
          if (key >= lim_b) vb = PF_NEG_INF;
        }
        s[n][i] = va; s[n][2 + i] = vb;
        mx_a = fmaxf(mx_a, va); mx_b = fmaxf(mx_b, vb);
      }
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float base_a = mx_a == PF_NEG_INF ? 0.0f : mx_a, base_b = mx_b == PF_NEG_INF ? 0.0f : mx_b;
    const float al_a = exp2f(m_a - base_a), al_b = exp2f(m_b - base_b);   // m = -inf: 0 (nothing summed yet)
    m_a = mx_a; m_b = mx_b;
    float sum_a = 0.0f, sum_b = 0.0f;
    uint32_t pa[KN / 8][2];                  // P as 16-bit pairs: [key n-tile][row gq / gq + 8]
#pragma unroll
    for (int n = 0; n < KN / 8; ++n) {
      const float p0 = exp2f(s[n][0] - base_a), p1 = exp2f(s[n][1] - base_a);
      const float p2 = exp2f(s[n][2] - base_b), p3 = exp2f(s[n][3] - base_b);
      sum_a += p0 + p1; sum_b += p2 + p3;
      pa[n][0] = pf_pack<XK>(p0, p1); pa[n][1] = pf_pack<XK>(p2, p3);
    }
    l_a = l_a * al_a + sum_a;                // this lane's partial row sums (reduced in the epilogue)
    l_b = l_b * al_b + sum_b;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) { o[n][0] *= al_a; o[n][1] *= al_a; o[n][2] *= al_b; o[n][3] *= al_b; }

    pf_wait<0>();
    __syncthreads();                         // V tile in; every warp done with this K tile
    if (kc + KN < kstop) load_kv(Ks, k_pool, kc + KN);
    pf_commit();

    // O += P V: k over the 64 keys in steps of 16, n over hd in pairs of 8-column tiles
#pragma unroll
    for (int kj = 0; kj < KN / 16; ++kj) {
      const uint32_t a0 = pa[2 * kj][0], a1 = pa[2 * kj][1], a2 = pa[2 * kj + 1][0], a3 = pa[2 * kj + 1][1];
#pragma unroll
      for (int p = 0; p < HD / 16; ++p) {
        uint32_t b[4];
        const int m = lane >> 3;
        const int r = 16 * kj + (lane & 7) + 8 * (m & 1), ch = 2 * p + (m >> 1);
        pf_ldm4t(b, vs_base + r * HD * 2 + ((ch ^ (r & 7)) * 16));
        qm_mma<XK>(o[2 * p], a0, a1, a2, a3, b[0], b[1]);
        qm_mma<XK>(o[2 * p + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
  }
  pf_wait<0>();

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = h ? rb : ra, tl = r / REP;
    if (tl >= ntok) continue;
    const size_t row = (size_t)(q0 + t0 + tl) * nH + g * REP + r % REP;
    WRITE_OUT
  }
"""


def smem_bytes(hd: int, nw: int) -> int:
    return (16 * nw + 2 * KEYS) * hd * 2


_WRITE_FINAL = r"""const float l = h ? l_b : l_a, inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      const int col = 8 * n + 2 * tq;
      float v0 = o[n][2 * h] * inv, v1 = o[n][2 * h + 1] * inv;
      GATE_CODE
      *(uint32_t*)(out + row * HD + col) = pf_pack<XK>(v0, v1);
    }"""

# partials in the decode split's convention: o unnormalised, m the running max in natural-log units of the
# scaled scores (here kept in log2 units: times ln 2), l the sum of exp(s - m); a split with no keys writes
# m = -inf, l = 0, o = 0 (the merge gives it weight 0)
_WRITE_SPLIT = r"""const size_t prow = (size_t)split * q_shape[0] * nH + row;
    const float m2 = h ? m_b : m_a;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
      *(float2*)(po + prow * HD + 8 * n + 2 * tq) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
    if (tq == 0) { pm[prow] = m2 == PF_NEG_INF ? m2 : m2 * 0.6931471805599453f; pl[prow] = h ? l_b : l_a; }"""

_GATE_CODE = r"""{
        const uint32_t gw = *(const uint32_t*)(gate + row * GST + GOF + col);
        v0 = v0 / (1.0f + __expf(-pf_f<XK>((unsigned short)(gw & 0xffffu))));
        v1 = v1 / (1.0f + __expf(-pf_f<XK>((unsigned short)(gw >> 16))));
      }"""

_K: dict = {}


def _kernel(split: bool, gate: bool, smem: int) -> PortableKernel:
    key = (split, gate, smem)
    if key not in _K:
        ins = ["q", "k_pool", "v_pool", "block_tables", "kv_valid", "query_start_loc", "prm", "scale_arr"]
        ins += (["gate"] if gate and not split else []) + ["dep"]  # dep: unread, orders it after the KV write
        body = _BODY.replace("WRITE_OUT", _WRITE_SPLIT if split else _WRITE_FINAL).replace(
            "GATE_CODE", _GATE_CODE if gate and not split else "")
        _K[key] = PortableKernel(name=f"mtl_prefill_attn_s{int(split)}_g{int(gate and not split)}_m{smem}",
                                 input_names=ins, output_names=["po", "pm", "pl"] if split else ["out"], body=body,
                                 cuda_body=body, header=_HEADER + MMA_HEADER, shared_memory=smem)
    return _K[key]


def warps(hd: int) -> int:
    """Warps a block (16 query rows each): SELECT["prefill_attn_warps"]."""
    return SELECT["prefill_attn_warps"]


def covers(q_shape, q_dtype, k_pool: mx.array, v_pool: mx.array, layout: SeqLayout) -> bool:
    T, nH, hd = q_shape
    nKV = k_pool.shape[2]
    if nH % nKV or layout.num_seqs == 0 or T == 0 or layout.traced:
        return False
    rep = nH // nKV
    return (hd in HEAD_DIMS and q_dtype in _XKIND and k_pool.dtype == q_dtype and v_pool.dtype == q_dtype
            and (16 * warps(hd)) % rep == 0)


NUM_SMS = 132  # H200


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _splits(lmax: int, ns: int) -> tuple[int, int]:
    """(NS, CS) for about ns splits of lmax keys: CS a multiple of the 64-key tile, NS <= MAX_SPLITS."""
    cs = _ceil(_ceil(lmax, max(1, min(ns, MAX_SPLITS))), KEYS) * KEYS
    return _ceil(lmax, cs), cs


def plan(layout: SeqLayout, nKV: int, tpt: int, nw: int) -> tuple[int, int]:
    """(NS key splits, CS keys a split). A batch of few query tiles (a short chunk, or one sequence's last
    tiles) over a long context would leave most SMs idle: its key range is then split into as many parts as
    one wave of blocks holds, each split at least SELECT["prefill_attn_split_keys"] keys (0: never split)."""
    lmax = layout.longest()
    # blocks with work (the grid's others exit at once: tiles past a shorter sequence's chunk)
    blocks = nKV * sum(_ceil(layout.q_len(i), tpt) for i in range(layout.num_seqs))
    target = NUM_SMS * max(1, 8 // nw)  # resident blocks: one an SM at 8 warps, two at 4 (shared memory)
    min_keys = SELECT["prefill_attn_split_keys"]
    ns = min(target // blocks, lmax // min_keys) if min_keys > 0 else 1  # at most one wave of blocks
    if ns < 2:  # half the SMs or more busy already (a second wave would gain nothing), or a short context
        return 1, _ceil(lmax, KEYS) * KEYS
    return _splits(lmax, ns)


_CONSTS: dict = {}


def _consts(nqt: int, ns: int, cs: int, scale: float) -> tuple[mx.array, mx.array]:
    key = (nqt, ns, cs, scale)
    if key not in _CONSTS:
        if len(_CONSTS) > 4096:
            _CONSTS.clear()
        _CONSTS[key] = (mx.array([nqt, ns, cs], dtype=mx.int32), mx.array([scale], dtype=mx.float32))
    return _CONSTS[key]


def prefill_attention_gpu(q, k_pool, v_pool, layout: SeqLayout, scale: float, gate=None, after=None, nw=None,
                          splits=None):
    """q [T, nH, hd] -> [T, nH, hd] (gate as in kernels.paged_attention_gpu), or None where not covered.
    `nw` overrides the warps a block (benchmarks), `splits` the key splits (tests)."""
    if not covers(q.shape, q.dtype, k_pool, v_pool, layout):
        return None
    T, nH, hd = q.shape
    nKV = k_pool.shape[2]
    rep = nH // nKV
    nw = nw or warps(hd)
    if (16 * nw) % rep:
        return None
    tpt = 16 * nw // rep
    qmax = max(layout.q_len(i) for i in range(layout.num_seqs))
    nqt = _ceil(qmax, tpt)
    ns, cs = plan(layout, nKV, tpt, nw)
    if splits is not None:
        ns, cs = _splits(layout.longest(), splits)
    prm, sc = _consts(nqt, ns, cs, scale)
    if after is None:
        after = mx.zeros((1,), dtype=mx.int32)
    packed = gate is not None and gate.ndim == 3 and gate.shape[-1] == 2 * hd
    gst, gof = (2 * hd, hd) if packed else (hd, 0)
    if gate is not None and not packed:
        gate = gate.reshape(T, nH * hd)
    arrays = [q, k_pool, v_pool, layout.array("block_tables"), layout.array("kv_valid"),
              layout.array("query_start_loc"), prm, sc]
    smem = smem_bytes(hd, nw)
    grid = (layout.num_seqs * nKV * nqt * ns * 32 * nw, 1, 1)
    tmpl = [("TQ", q.dtype), ("XK", _XKIND[q.dtype]), ("HD", hd), ("REP", rep), ("BT", layout.block_tokens),
            ("NW", nw), ("GST", gst), ("GOF", gof)]
    if ns == 1:
        return _kernel(False, gate is not None, smem)(
            "cuda", inputs=arrays + ([gate] if gate is not None else []) + [after], output_shapes=[(T, nH, hd)],
            output_dtypes=[q.dtype], grid=grid, threadgroup=(32 * nw, 1, 1), template=tmpl, init_value=POISON)[0]
    po, pm, pl = _kernel(True, False, smem)(
        "cuda", inputs=arrays + [after], output_shapes=[(ns, T, nH, hd), (ns, T, nH), (ns, T, nH)],
        output_dtypes=[mx.float32] * 3, grid=grid, threadgroup=(32 * nw, 1, 1), template=tmpl, init_value=POISON)
    merge_prm = decode._consts(ns, cs, nqt, scale)[0]  # the merge reads NS from prm[0]
    return decode._merge_kernel(gate is not None)(
        "cuda", inputs=[q, po, pm, pl, merge_prm] + ([gate] if gate is not None else []),
        output_shapes=[(T, nH, hd)], output_dtypes=[q.dtype], grid=(T * nH * 128, 1, 1), threadgroup=(128, 1, 1),
        template=[("TQ", q.dtype), ("HD", hd), ("GST", gst), ("GOF", gof)], init_value=POISON)[0]


def examples() -> list[tuple[PortableKernel, KernelExample]]:
    """Instantiations for check_cuda: the 9B shape (hd 256, GQA 4, bf16, gated q|gate) at 8 and 4 warps, fp16,
    the key-split partials, hd 128 / 64, GQA 1 and 8, 16-token blocks (tiles spanning blocks)."""
    combos = [(mx.bfloat16, 256, 4, 128, True, 8, False), (mx.bfloat16, 256, 4, 128, True, 4, False),
              (mx.bfloat16, 256, 4, 128, False, 8, False), (mx.float16, 256, 4, 128, True, 8, False),
              (mx.bfloat16, 256, 4, 128, False, 8, True), (mx.float16, 128, 2, 16, False, 4, True),
              (mx.bfloat16, 128, 1, 16, False, 8, False), (mx.float16, 64, 8, 16, True, 8, False),
              (mx.bfloat16, 64, 2, 128, False, 4, False)]
    out = []
    for dt, hd, rep, bt, gate, nw, split in combos:
        gate = gate and not split
        nh = 4 * rep
        ins = [(dt, (64, nh, hd)), (dt, (8, bt, 4, hd)), (dt, (8, bt, 4, hd)), (mx.int32, (2, 4)), (mx.int32, (2,)),
               (mx.int32, (3,)), (mx.int32, (3,)), (mx.float32, (1,))]
        ins += ([(dt, (64, nh, 2 * hd))] if gate else []) + [(mx.int32, (1,))]
        ex = KernelExample(inputs=ins, outputs=[mx.float32] * 3 if split else [dt], template=[
            ("TQ", dt), ("XK", _XKIND[dt]), ("HD", hd), ("REP", rep), ("BT", bt), ("NW", nw), ("GST", 2 * hd), ("GOF", hd)])
        out.append((_kernel(split, gate, smem_bytes(hd, nw)), ex))
    return out
