"""Decode attention over paged KV (FlashAttention-2 style, split over the context).

One threadgroup (128 lanes) owns (sequence, KV head, query tile, context split): the query rows of the
tile are its tokens x the KV head's REP query heads (GQA: the REP heads share every loaded K/V row). Per
chunk of 32 keys: (1) 4 lanes per key take the q.k dots over hd (q, pre-scaled, in threadgroup memory);
(2) one SIMD group per row does the online softmax over the 32 scores (lane = key), causal limit per row;
(3) lanes split hd x keys for P.V. Long contexts split into NS ranges whose partial (o, m, l) a second
kernel merges. Packed sequences are located through query_start_loc / kv_valid / block_tables.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, portable_kernel
from ..selection import SELECT
from ..seqs import SeqLayout

POISON: float | None = None  # tests set NaN: every output element must then be written by the kernel
_KIND = {mx.float32: 0, mx.bfloat16: 1, mx.float16: 2}

_HEADER = r"""
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)  // nvcc / NVRTC; otherwise Metal
#define PA_AS_FLOAT(u) __uint_as_float(u)
#define PA_HALF_BITS(u) __half2float(__ushort_as_half((unsigned short)(u)))
#else
#define PA_AS_FLOAT(u) as_type<float>(u)
#define PA_HALF_BITS(u) float(as_type<half>((ushort)(u)))
#endif
INLINE float pa_elem(uint32_t w, int hi, int kind) {
  if (kind == 0) return PA_AS_FLOAT(w);
  if (kind == 1) return PA_AS_FLOAT(hi ? (w & 0xffff0000u) : (w << 16));
  return PA_HALF_BITS(hi ? (w >> 16) : (w & 0xffffu));
}
#define PA_NEG_INF (-PA_AS_FLOAT(0x7f800000u))
INLINE uint32_t pa_word(uint4 v, int i) { return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w)); }
"""

# Template constants: TQ (q / out dtype), KK (pool kind), HD, REP (query heads per KV head), TPT (tokens
# per query tile), BT (block tokens); variants: gated output, split (partials po/pm/pl for the merge).
# prm = [NS splits, CS keys per split, NQT query tiles].
_BODY = r"""
  constexpr int RT = REP * TPT;           // query rows of the tile
  constexpr int KB = KK == 0 ? 4 : 2;     // pool element bytes
  constexpr int EPV = 16 / KB;            // elements per uint4
  constexpr int NV = HD / EPV / 4;        // uint4 per lane per key (4 lanes per key)
  constexpr int DPT = 4;                  // hd columns per lane in P.V
  constexpr int NKG = 128 / (HD / DPT);   // key groups in P.V
  SHARED float qs[RT * HD];               // scaled q rows; reused to merge the P.V key groups
  SHARED float sp[RT * 32];               // scores, then probabilities, of the current chunk
  SHARED float al[RT];                    // rescale factor of the chunk, then final l per row
  SHARED float mr[RT];
  const int nH = q_shape[1];
  const int nKV = k_pool_shape[2];
  const int nbt = block_tables_shape[1];
  const int T = q_shape[0];
  const int NS = prm[0], CS = prm[1], NQT = prm[2];
  const int tid = TID_X, lane = LANE, warp = SIMD_ID;
  int id = TGID_X;
  const int split = id % NS; id /= NS;
  const int qt = id % NQT; id /= NQT;
  const int g = id % nKV;
  const int seq = id / nKV;
  const int q0 = query_start_loc[seq];
  const int qlen = query_start_loc[seq + 1] - q0;
  const int past = kv_valid[seq];
  const int t0 = qt * TPT;
  if (t0 >= qlen) return;                 // uniform: this tile has no tokens in this sequence
  const int ntok = min(TPT, qlen - t0);
  const int kbeg = split * CS;
  const int kend = min(kbeg + CS, past + t0 + ntok);
  const float scale = scale_arr[0];

  for (int i = tid; i < RT * HD; i += 128) {
    const int r = i / HD, d = i % HD, tl = r / REP;
    qs[i] = tl < ntok ? scale * TO_FLOAT(q[((size_t)(q0 + t0 + tl) * nH + g * REP + r % REP) * HD + d]) : 0.0f;
  }
  float m_run[(RT + 3) / 4], l_run[(RT + 3) / 4];
  for (int i = 0; i < (RT + 3) / 4; ++i) { m_run[i] = PA_NEG_INF; l_run[i] = 0.0f; }
  const int kg = tid / (HD / DPT), dc = (tid % (HD / DPT)) * DPT;
  float acc[RT][DPT];
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < DPT; ++i) acc[r][i] = 0.0f;
  BARRIER;

  for (int kc = kbeg; kc < kend; kc += 32) {
    // (1) scores: key ck = warp*8 + lane/4, lane part = lane%4 takes uint4s part, part+4, ...
    {
      const int ck = warp * 8 + lane / 4, part = lane % 4, l = kc + ck;
      float kf[NV * EPV];
      if (l < kend) {
        const int blk = block_tables[seq * nbt + l / BT];
        CONST_PTR uint4* kp = (CONST_PTR uint4*)(k_pool + ((size_t)(blk * BT + l % BT) * nKV + g) * HD);
        uint4 kv[NV];
#pragma unroll
        for (int i = 0; i < NV; ++i) kv[i] = kp[part + 4 * i];
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int e = 0; e < EPV; ++e)
            kf[i * EPV + e] = pa_elem(pa_word(kv[i], (e * KB) / 4), ((e * KB) / 2) & 1, KK);
      } else {
#pragma unroll
        for (int i = 0; i < NV * EPV; ++i) kf[i] = 0.0f;
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // 4 independent FMA chains instead of one of length HD/4
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int e = 0; e < EPV; ++e) s4[e & 3] += kf[i * EPV + e] * qs[r * HD + (part + 4 * i) * EPV + e];
        float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
        s += SIMD_SHUFFLE_XOR(s, 1);
        s += SIMD_SHUFFLE_XOR(s, 2);
        if (part == 0) sp[r * 32 + ck] = s;
      }
    }
    BARRIER;
    // (2) online softmax: SIMD group w owns rows w, w+4, ...; lane = key of the chunk
#pragma unroll
    for (int i = 0; i < (RT + 3) / 4; ++i) {
      const int r = warp + 4 * i;
      if (r >= RT) break;
      const int lim = past + t0 + r / REP + 1;   // causal: row sees keys < lim
      const float s = (kc + lane < min(lim, kend)) ? sp[r * 32 + lane] : PA_NEG_INF;
      const float m_new = max(m_run[i], SIMD_MAX(s));
      const float p = m_new == PA_NEG_INF ? 0.0f : EXP(s - m_new);
      const float a = m_new == PA_NEG_INF ? 1.0f : EXP(m_run[i] - m_new);
      l_run[i] = l_run[i] * a + SIMD_SUM(p);
      m_run[i] = m_new;
      sp[r * 32 + lane] = p;
      if (lane == 0) { al[r] = a; mr[r] = m_new; }
    }
    BARRIER;
    // (3) P.V: key group kg takes keys kg, kg+NKG, ...; DPT hd columns per lane. Every V row of the chunk
    // is loaded before the math: with the loads inside the guarded loop, they ran one latency at a time
    // (a 192-key split took ~60 us in a B=1 step, benchmarks/decode_profile.md).
    for (int r = 0; r < RT; ++r) {
      const float a = al[r];
      for (int i = 0; i < DPT; ++i) acc[r][i] *= a;
    }
    constexpr int NJ = 32 / NKG;
    uint2 vr2[NJ];                  // the raw V columns of key kg + j*NKG: 16-bit pools ...
    uint4 vr4[KB == 2 ? 1 : NJ];    // ... or fp32 pools
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int l = min(kc + kg + j * NKG, kend - 1);  // clamped to a valid key: its p is not used below
      const int blk = block_tables[seq * nbt + l / BT];
      CONST_PTR TV* vp = v_pool + ((size_t)(blk * BT + l % BT) * nKV + g) * HD + dc;
      if (KB == 2) vr2[j] = *((CONST_PTR uint2*)vp);
      else vr4[KB == 2 ? 0 : j] = *((CONST_PTR uint4*)vp);
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int ck = kg + j * NKG;
      if (kc + ck < kend) {
        float vf[DPT];
        if (KB == 2) {
          vf[0] = pa_elem(vr2[j].x, 0, KK); vf[1] = pa_elem(vr2[j].x, 1, KK);
          vf[2] = pa_elem(vr2[j].y, 0, KK); vf[3] = pa_elem(vr2[j].y, 1, KK);
        } else {
          const uint4 u = vr4[KB == 2 ? 0 : j];
          vf[0] = PA_AS_FLOAT(u.x); vf[1] = PA_AS_FLOAT(u.y); vf[2] = PA_AS_FLOAT(u.z); vf[3] = PA_AS_FLOAT(u.w);
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const float p = sp[r * 32 + ck];
#pragma unroll
          for (int i = 0; i < DPT; ++i) acc[r][i] += p * vf[i];
        }
      }
    }
    BARRIER;
  }
#pragma unroll
  for (int i = 0; i < (RT + 3) / 4; ++i)
    if (warp + 4 * i < RT && lane == 0) { al[warp + 4 * i] = l_run[i]; mr[warp + 4 * i] = m_run[i]; }
  BARRIER;  // al / mr are read by other lanes below (no merge-loop barrier when NKG == 1)
  // merge the key groups' partial P.V through qs (no longer needed)
  for (int gi = NKG - 1; gi > 0; --gi) {
    if (kg == gi)
      for (int r = 0; r < RT; ++r)
        for (int i = 0; i < DPT; ++i) qs[r * HD + dc + i] = acc[r][i];
    BARRIER;
    if (kg == gi - 1)
      for (int r = 0; r < RT; ++r)
        for (int i = 0; i < DPT; ++i) acc[r][i] += qs[r * HD + dc + i];
    BARRIER;
  }
  if (kg == 0) {
    for (int r = 0; r < RT; ++r) {
      const int tl = r / REP;
      if (tl < ntok) {
        const size_t row = (size_t)(q0 + t0 + tl) * nH + g * REP + r % REP;
        WRITE_OUT
      }
    }
  }
"""

_WRITE_FINAL = r"""const float inv = al[r] > 0.0f ? 1.0f / al[r] : 0.0f;
        for (int i = 0; i < DPT; ++i) {
          float o = acc[r][i] * inv;
          GATE_CODE
          out[row * HD + dc + i] = FROM_FLOAT(TQ, o);
        }"""

_WRITE_SPLIT = r"""const size_t prow = (size_t)split * T * nH + row;
        for (int i = 0; i < DPT; ++i) po[prow * HD + dc + i] = acc[r][i];
        if (dc == 0) { pm[prow] = mr[r]; pl[prow] = al[r]; }"""

# Merge of the splits: one threadgroup of 128 lanes per (token, head). The split weights
# exp(m_s - max) / sum go to threadgroup memory once; then each lane sums its hd columns over the splits
# with independent loads in flight (a serial loop over splits was latency-bound at 100+ splits).
MAX_SPLITS = 1024
_MERGE = r"""
  SHARED float ws[MAX_SPLITS];
  SHARED float red[4];
  const int T = q_shape[0];
  const int nH = q_shape[1];
  const int NS = prm[0];
  const size_t row = TGID_X;
  const size_t stride = (size_t)T * nH;
  const int tid = TID_X;
  float mloc = PA_NEG_INF;
  for (int s = tid; s < NS; s += 128) mloc = max(mloc, pm[s * stride + row]);
  mloc = SIMD_MAX(mloc);
  if (LANE == 0) red[SIMD_ID] = mloc;
  BARRIER;
  const float mx_ = max(max(red[0], red[1]), max(red[2], red[3]));
  BARRIER;
  float wloc = 0.0f;
  for (int s = tid; s < NS; s += 128) {
    const float m = pm[s * stride + row];
    const float w = m == PA_NEG_INF ? 0.0f : EXP(m - mx_);
    ws[s] = w;
    wloc += w * pl[s * stride + row];
  }
  wloc = SIMD_SUM(wloc);
  if (LANE == 0) red[SIMD_ID] = wloc;
  BARRIER;
  const float wsum = (red[0] + red[1]) + (red[2] + red[3]);
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  for (int d = tid; d < HD; d += 128) {
    float o = 0.0f;
#pragma unroll 8
    for (int s = 0; s < NS; ++s) {
      const float w = ws[s];
      if (w != 0.0f) o += w * po[(s * stride + row) * HD + d];  // skipped splits were never written
    }
    o *= inv;
    GATE_MERGE
    out[row * HD + d] = FROM_FLOAT(TQ, o);
  }
"""

_K: dict = {}


def _kernel(split: int, gate: bool):
    key = ("attn", split, gate)
    if key not in _K:
        ins = ["q", "k_pool", "v_pool", "block_tables", "kv_valid", "query_start_loc", "prm", "scale_arr"]
        ins += ["gate"] if gate and not split else []
        ins += ["dep"]  # unread: orders this kernel after the in-place KV write (kv_write.py)
        outs = ["po", "pm", "pl"] if split else ["out"]
        body = _BODY.replace("WRITE_OUT", _WRITE_SPLIT if split else _WRITE_FINAL).replace(
            "GATE_CODE", "o = o / (1.0f + EXP(-TO_FLOAT(gate[row * GST + GOF + dc + i])));" if gate else "")
        ex = [KernelExample(
            inputs=[(dt, (4, 16, 256)), (dt, (64, 128, 4, 256)), (dt, (64, 128, 4, 256)), (mx.int32, (2, 8)),
                    (mx.int32, (2,)), (mx.int32, (3,)), (mx.int32, (3,)), (mx.float32, (1,))]
            + ([(dt, (4, 4096))] if gate and not split else []) + [(mx.int32, (1,))],
            outputs=[mx.float32] * 3 if split else [dt],
            template=[("TQ", dt), ("TV", dt), ("KK", _KIND[dt]), ("HD", 256), ("REP", 4), ("TPT", 2), ("BT", 128),
                      ("GST", 512), ("GOF", 256)],
        ) for dt in (mx.bfloat16, mx.float32)]
        _K[key] = portable_kernel(name=f"mtl_paged_attn_s{split}_g{int(gate)}", input_names=ins,
                                  output_names=outs, body=body, header=_HEADER, examples=ex)
    return _K[key]


def _merge_kernel(gate: bool):
    key = ("merge", gate)
    if key not in _K:
        ins = ["q", "po", "pm", "pl", "prm"] + (["gate"] if gate else [])
        ex = [KernelExample(inputs=[(mx.bfloat16, (4, 16, 256)), (mx.float32, (8, 4, 16, 256)),
                                    (mx.float32, (8, 4, 16)), (mx.float32, (8, 4, 16)), (mx.int32, (3,))]
                            + ([(mx.bfloat16, (4, 4096))] if gate else []),
                            outputs=[mx.bfloat16], template=[("TQ", mx.bfloat16), ("HD", 256), ("GST", 256), ("GOF", 0)])]
        _K[key] = portable_kernel(name=f"mtl_paged_attn_merge_g{int(gate)}", input_names=ins, examples=ex,
                                  output_names=["out"], header=_HEADER, body=_MERGE.replace("MAX_SPLITS", str(MAX_SPLITS)).replace(
            "GATE_MERGE", "o = o / (1.0f + EXP(-TO_FLOAT(gate[row * GST + GOF + d])));" if gate else ""))
    return _K[key]


for _sg in ((0, False), (0, True), (1, False)):  # declared at import so check_metal sees them
    _kernel(*_sg)
for _g in (False, True):
    _merge_kernel(_g)

TARGET_GROUPS = 528  # ~4 threadgroups per H200 SM keep enough K/V loads in flight


def plan(layout: SeqLayout, nKV: int, rep: int, splits: int | None = None) -> tuple[int, int, int, int]:
    """(NS splits, CS keys per split, NQT query tiles, TPT tokens per tile) for a batch."""
    qmax = max(layout.q_len(i) for i in range(layout.num_seqs))
    tpt = max(1, min(qmax, 16 // rep))
    nqt = (qmax + tpt - 1) // tpt
    lmax = layout.longest()
    work = layout.num_seqs * nKV * nqt
    ns = max(1, min(math.ceil(lmax / SELECT["attn_min_split_keys"]), math.ceil(TARGET_GROUPS / work)))
    if splits is not None:  # tests and benchmarks force the split path
        ns = min(splits, lmax)
    ns = min(ns, MAX_SPLITS)
    cs = (math.ceil(lmax / ns) + 31) // 32 * 32
    ns = math.ceil(lmax / cs)
    return ns, cs, nqt, tpt


_CONSTS: dict = {}


def _consts(ns: int, cs: int, nqt: int, scale: float) -> tuple[mx.array, mx.array]:
    """Small parameter arrays, made once per distinct value (every layer of a step shares them)."""
    key = (ns, cs, nqt, scale)
    if key not in _CONSTS:
        if len(_CONSTS) > 4096:
            _CONSTS.clear()
        _CONSTS[key] = (mx.array([ns, cs, nqt], dtype=mx.int32), mx.array([scale], dtype=mx.float32))
    return _CONSTS[key]


def covers(q_shape, q_dtype, k_pool: mx.array, v_pool: mx.array, layout: SeqLayout) -> bool:
    """Whether the kernel handles this attention (else the reference runs)."""
    T, nH, hd = q_shape
    nKV = k_pool.shape[2]
    # up to 16 query rows a threadgroup keep hd + 34 floats each in threadgroup memory: at hd 512 that is
    # 34,944 bytes, past Metal's 32 KiB (the emulator's limit check), so Metal stops at 256
    max_hd = 256 if gpu_backend() == "metal" else 512
    return not (nH % nKV or hd % 32 or hd > max_hd or k_pool.dtype not in _KIND or q_dtype not in _KIND
                or v_pool.dtype != k_pool.dtype or 128 % (hd // 4) or layout.num_seqs == 0 or T == 0
                or nH // nKV > 16)


_NO_DEP: list = []


def paged_attention_gpu(q, k_pool, v_pool, layout: SeqLayout, scale: float, gate=None, splits=None, after=None):
    """q [T, nH, hd] -> [T, nH, hd]; gate (optional) multiplies by sigmoid(gate): [T, nH*hd], or [T, nH, 2*hd]
    = the q|gate projection, read in place (gate = each head's second half; a slice would be copied);
    `after`: the token of an in-place KV write this attention must follow."""
    T, nH, hd = q.shape
    nKV = k_pool.shape[2]
    if not covers(q.shape, q.dtype, k_pool, v_pool, layout):
        return None
    rep = nH // nKV
    if after is None:
        if not _NO_DEP:
            _NO_DEP.append(mx.zeros((1,), dtype=mx.int32))
        after = _NO_DEP[0]
    ns, cs, nqt, tpt = plan(layout, nKV, rep, splits)
    prm, sc = _consts(ns, cs, nqt, scale)
    arrays = [q, k_pool, v_pool, layout.array("block_tables"), layout.array("kv_valid"),
              layout.array("query_start_loc"), prm, sc]
    # gate row stride and offset in elements: compact [T*nH, hd] rows, or the gate half of q|gate rows
    packed = gate is not None and gate.ndim == 3 and gate.shape[-1] == 2 * hd
    gst, gof = (2 * hd, hd) if packed else (hd, 0)
    tmpl = [("TQ", q.dtype), ("TV", v_pool.dtype), ("KK", _KIND[k_pool.dtype]), ("HD", hd), ("REP", rep),
            ("TPT", tpt), ("BT", layout.block_tokens), ("GST", gst), ("GOF", gof)]
    groups = layout.num_seqs * nKV * nqt * ns
    be = gpu_backend()
    if gate is not None and not packed:
        gate = gate.reshape(T, nH * hd)
    if ns == 1:
        return _kernel(0, gate is not None)(
            be, inputs=arrays + ([gate] if gate is not None else []) + [after], output_shapes=[(T, nH, hd)],
            output_dtypes=[q.dtype], grid=(groups * 128, 1, 1), threadgroup=(128, 1, 1), template=tmpl,
            init_value=POISON)[0]
    po, pm, pl = _kernel(1, False)(
        be, inputs=arrays + [after], output_shapes=[(ns, T, nH, hd), (ns, T, nH), (ns, T, nH)],
        output_dtypes=[mx.float32] * 3, grid=(groups * 128, 1, 1), threadgroup=(128, 1, 1),
        template=tmpl, init_value=POISON)
    return _merge_kernel(gate is not None)(
        be, inputs=[q, po, pm, pl, prm] + ([gate] if gate is not None else []), output_shapes=[(T, nH, hd)],
        output_dtypes=[q.dtype], grid=(T * nH * 128, 1, 1), threadgroup=(128, 1, 1),
        template=[("TQ", q.dtype), ("HD", hd), ("GST", gst), ("GOF", gof)], init_value=POISON)[0]
