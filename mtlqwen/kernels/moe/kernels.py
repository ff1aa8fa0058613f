"""MoE kernels on GPU back-ends: the router's softmax + top-k + renormalisation in one launch, and the
decode-sized expert MLP in two launches that read only the selected experts' packed weights.

Routing (`route`): one SIMD group per token holds its E logits (EPL per lane); a SIMD max and sum give
the softmax denominator, then k rounds of a SIMD argmax (ties: the lower expert id) pick the experts in
decreasing order. Weights p_j / sum of the k picked (renormalised) or p_j, fp32; with the shared expert,
its gate sigmoid(logit) is written as weight k.

Experts (`fused_experts`), T <= SELECT["moe_fused_max_tokens"] tokens: both launches are the qmv FMA body
(qmatmul/bodies.py) at one activation row, with the projection chosen per threadgroup:
- gate+up: threadgroup (row block, pair), pair = (token, slot) over the k routed slots and the shared
  expert's; it reads expert inds[t, slot]'s gate and up rows and writes
  h[pair] = weight[t, slot] * silu(x W_g^T) * (x W_u^T)   [T * S, Im], S = k (+1 shared);
- down: threadgroup (row block, token) over x' = h[t] viewed as one row of S * Im columns, whose chunk c
  belongs to slot c / (Im / chunk): a GEMV against the slots' down rows laid end to end, so the routing
  weights (already in h) and the sum over slots, shared expert included, come out of the K loop.
At batch 1 that is Im / 8 * 9 = 576 gate+up blocks and H / 8 = 256 down blocks (the table's 2 rows per
SIMD group) for the 35B-A3B geometry.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS, eps_array
from ..portable import KernelExample, portable_kernel
from ..qmatmul.bodies import FMA_BODY, HEADER, XKIND, with_loads
from ..qmatmul.residual import EPILOGUE, MAX_EPT, arrival_counter
from ..selection import SELECT

POISON: float | None = None  # tests set NaN: every output element must then be written by the kernel

ROUTE_BODY = r"""
  const int E = logits_shape[1];
  const int t = TGID_X;
  const int lane = LANE;
  constexpr float PAD = -3.0e38f;      // experts past E: below every logit
  constexpr float TAKEN = -3.4e38f;    // picked already: below PAD, never picked again
  float v[EPL];
  float mval = PAD;
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? TO_FLOAT(logits[(size_t)t * E + e]) : PAD;
    mval = FMAX(mval, v[i]);
  }
  mval = SIMD_MAX(mval);
  float den = 0.0f;
  for (int i = 0; i < EPL; ++i) den += (lane + 32 * i < E) ? EXP(v[i] - mval) : 0.0f;
  den = SIMD_SUM(den);
  float pw[KT];
  int pi[KT];
  float picked = 0.0f;
#pragma unroll
  for (int j = 0; j < KT; ++j) {
    float bv = TAKEN;
    int bi = 0x7fffffff;
    for (int i = 0; i < EPL; ++i)
      if (v[i] > bv) { bv = v[i]; bi = lane + 32 * i; }
    const float gv = SIMD_MAX(bv);
    const float cand = bv == gv ? (float)bi : 3.0e38f;   // ids < 2^24: exact as floats
    const int gi = (int)(-SIMD_MAX(-cand));
    for (int i = 0; i < EPL; ++i)
      if (lane + 32 * i == gi) v[i] = TAKEN;
    pw[j] = EXP(gv - mval);
    pi[j] = gi;
    picked += pw[j];
  }
  if (lane == 0) {
    const int KS = KT + SH;            // weights per token (the shared gate last)
    const float d = RN ? picked : den;
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      inds[(size_t)t * KT + j] = pi[j];
      weights[(size_t)t * KS + j] = pw[j] / d;
    }
    SHARED_GATE
  }
"""

# gate+up: which pair this threadgroup serves, and that expert's gate / up rows
GATE_UP_SELECT = r"""
  const int N = wg_shape[1];
  const int pair = TGID_Y;
  const int tok = pair / (KT + SH);
  const int slot = pair - tok * (KT + SH);
  const float rw = weights[(size_t)tok * weights_shape[1] + slot];
  const size_t eo = (size_t)((SH && slot == KT) ? 0 : inds[(size_t)tok * KT + slot]) * N;
  CONST_PTR uint32_t* WG = wg + eo * KW; CONST_PTR T* SG = sg + eo * NG; CONST_PTR T* BG = bg + eo * NG;
  CONST_PTR uint32_t* WU = wu + eo * KW; CONST_PTR T* SU = su + eo * NG; CONST_PTR T* BU = bu + eo * NG;
  SHARED_ROWS
"""
GATE_UP_SHARED = ("if (slot == KT) { WG = wsg; SG = ssg; BG = bsg; WU = wsu; SU = ssu; BU = bsu; }")
GATE_UP_ROW = ("const bool up = r >= RP; const int row = min(n0 + (up ? r - RP : r), N - 1);\n"
               "        CONST_PTR uint32_t* W = up ? WU : WG; CONST_PTR T* S = up ? SU : SG;"
               " CONST_PTR T* B = up ? BU : BG;")
GATE_UP_WRITE = "if (n < N) hout[(size_t)pair * N + n] = FROM_FLOAT(T, rw * qm_silu(acc[m][r]) * acc[m][r + RP]);"

# down: one token's slots end to end; chunk c of that row is chunk cl of slot `slot`'s row
DOWN_SELECT = r"""
  const int N = wd_shape[1];
  const int tok = TGID_Y;
  const int KWE = wd_shape[2];        // words of one expert row
  const int NGE = sd_shape[2];        // groups of one expert row
  const int CPE = NC / (KT + SH);     // chunks of one expert row
"""
DOWN_ROW = ("const int row = min(n0 + r, N - 1); const int slot = c / CPE; const int cl = c - slot * CPE;\n"
            "        CONST_PTR uint32_t* W; CONST_PTR T* S; CONST_PTR T* B;\n"
            "        SHARED_ROWS{ const size_t eo = (size_t)inds[(size_t)tok * KT + slot] * N;"
            " W = wd + eo * KWE; S = sd + eo * NGE; B = bd + eo * NGE; }")
DOWN_SHARED = "if (slot == KT) { W = wsd; S = ssd; B = bsd; } else "
DOWN_WRITE = "if (n < N) y[(size_t)tok * N + n] = FROM_FLOAT(T, acc[m][r]);"
# down with the residual add + next RMSNorm (qmatmul/residual.py's epilogue): the block output goes to dlt,
# and the last of the blocks (row blocks x tokens, counted at run time) adds and norms every token's row
DOWN_RMS_WRITE = "if (n < N) dlt[(size_t)tok * N + n] = FROM_FLOAT(T, acc[m][r]);"


def _replaced_once(src: str, pairs, what: str) -> str:
    """src with each (old, new) replaced, each old appearing exactly once (else the source it comes from
    changed under this file)."""
    for old, new in pairs:
        if src.count(old) != 1:
            raise AssertionError(f"{what} changed: {old!r} appears {src.count(old)} times")
        src = src.replace(old, new)
    return src


# residual.py's epilogue over every token's row (h_shape[0]), its arrival count the down launch's row
# blocks x tokens (residual.py's NBLK template counts one row set's blocks)
DOWN_RMS_EPILOGUE = _replaced_once(EPILOGUE, (
    ("(uint32_t)(NBLK - 1)", "(uint32_t)(((N + 4 * R - 1) / (4 * R)) * h_shape[0] - 1)"),
    ("for (int m = 0; m < M; ++m)", "for (int m = 0; m < h_shape[0]; ++m)")), "qmatmul/residual.py's epilogue")


def _one_row(body: str) -> str:
    """The FMA body at one activation row: row `tok` of x (the pair's or the token's)."""
    return _replaced_once(body, (("const int M = x_shape[0];", "const int M = 1;"),
                                 ("(x + (size_t)m * K", "(x + (size_t)(tok + m) * K")), "qmv body")


_KERNELS: dict = {}


def _route_kernel(sh: bool):
    key = ("route", sh)
    if key not in _KERNELS:
        gate = "if (SH) weights[(size_t)t * KS + KT] = 1.0f / (1.0f + EXP(-TO_FLOAT(sgl[t])));" if sh else ""
        _KERNELS[key] = portable_kernel(
            name=f"mtl_moe_route_s{int(sh)}", input_names=["logits"] + (["sgl"] if sh else []),
            output_names=["inds", "weights"], body=ROUTE_BODY.replace("SHARED_GATE", gate),
            examples=[KernelExample([(dt, (4, 256))] + ([(dt, (4, 1))] if sh else []), [mx.int32, mx.float32],
                                    [("T", dt), ("KT", 8), ("EPL", 8), ("SH", sh), ("RN", True)])
                      for dt in (mx.bfloat16, mx.float32)])
    return _KERNELS[key]


def _expert_example(dt, bits: int, sh: bool, stage: str) -> KernelExample:
    """The 35B-A3B geometry (E 256, H 2048, Im 512, k 8, g64) for the compile checks."""
    E, H, Im, k = 256, 2048, 512, 8
    rows, cols = (Im, H) if stage == "gate_up" else (H, Im)
    w = [(mx.uint32, (E, rows, cols * bits // 32)), (dt, (E, rows, cols // 64)), (dt, (E, rows, cols // 64))]
    ws = [(mx.uint32, (rows, cols * bits // 32)), (dt, (rows, cols // 64)), (dt, (rows, cols // 64))]
    S = k + sh
    if stage == "gate_up":
        ins = [(dt, (1, H)), (mx.int32, (1, k)), (mx.float32, (1, S))] + w * 2 + (ws * 2 if sh else [])
        R, epi, P = 4, 1, 2
    else:
        ins = [(dt, (1, S * Im)), (mx.int32, (1, k))] + w + (ws if sh else [])
        R, epi, P = 2, 0, 1
    tmpl = [("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", 64), ("MT", 1), ("R", R), ("U", 1), ("P", P),
            ("EPI", epi), ("PF", False), ("NP", bits == 4), ("KT", k), ("SH", sh)]
    return KernelExample(inputs=ins, outputs=[dt], template=tmpl)


def _gate_up_kernel(sh: bool):
    key = ("gate_up", sh)
    if key not in _KERNELS:
        body = _one_row(with_loads(FMA_BODY)).replace(
            "PROJ_SELECT", GATE_UP_SELECT.replace("SHARED_ROWS", GATE_UP_SHARED if sh else "")).replace(
            "ROW_SELECT", GATE_UP_ROW).replace("WRITE_OUT", GATE_UP_WRITE)
        shared = [f"{a}s{p}" for p in ("g", "u") for a in ("w", "s", "b")] if sh else []
        _KERNELS[key] = portable_kernel(
            name=f"mtl_moe_gate_up_s{int(sh)}", header=HEADER, body=body,
            input_names=["x", "inds", "weights", "wg", "sg", "bg", "wu", "su", "bu"] + shared,
            output_names=["hout"],
            examples=[_expert_example(dt, b, sh, "gate_up") for dt in (mx.bfloat16, mx.float32) for b in (4, 8)])
    return _KERNELS[key]


def _down_kernel(sh: bool):
    key = ("down", sh)
    if key not in _KERNELS:
        body = _one_row(with_loads(FMA_BODY, row_words="KWE", row_groups="NGE", chunk="cl")).replace(
            "PROJ_SELECT", DOWN_SELECT).replace(
            "ROW_SELECT", DOWN_ROW.replace("SHARED_ROWS", DOWN_SHARED if sh else "")).replace("WRITE_OUT", DOWN_WRITE)
        _KERNELS[key] = portable_kernel(
            name=f"mtl_moe_down_s{int(sh)}", header=HEADER, body=body,
            input_names=["x", "inds", "wd", "sd", "bd"] + (["wsd", "ssd", "bsd"] if sh else []),
            output_names=["y"],
            examples=[_expert_example(dt, b, sh, "down") for dt in (mx.bfloat16, mx.float32) for b in (4, 8)])
    return _KERNELS[key]


def _down_rms_example(dt, bits: int, sh: bool, H: int, Im: int, T: int) -> KernelExample:
    """The down + residual-norm launch at E 256, k 8, g64: H, Im, T as given (EPT = H / 128 is a template
    value, so each hidden size the checks run needs its own example)."""
    E, k = 256, 8
    w = [(mx.uint32, (E, H, Im * bits // 32)), (dt, (E, H, Im // 64)), (dt, (E, H, Im // 64))]
    ws = [(mx.uint32, (H, Im * bits // 32)), (dt, (H, Im // 64)), (dt, (H, Im // 64))]
    ins = ([(dt, (T, (k + sh) * Im)), (mx.int32, (T, k))] + w + (ws if sh else [])
           + [(dt, (T, H)), (dt, (H,)), (mx.float32, (1,)), (mx.uint32, (8,))])
    tmpl = [("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", 64), ("MT", 1), ("R", 2), ("U", 1), ("P", 1),
            ("EPI", 0), ("PF", False), ("NP", bits == 4), ("KT", k), ("SH", sh), ("EPT", -(-H // 128)),
            ("EC", -(-H // 128))]
    return KernelExample(inputs=ins, outputs=[dt] * 3, template=tmpl)


def _down_rms_kernel(sh: bool):
    key = ("down_rms", sh)
    if key not in _KERNELS:
        body = _one_row(with_loads(FMA_BODY, row_words="KWE", row_groups="NGE", chunk="cl")).replace(
            "PROJ_SELECT", DOWN_SELECT).replace(
            "ROW_SELECT", DOWN_ROW.replace("SHARED_ROWS", DOWN_SHARED if sh else "")).replace(
            "WRITE_OUT", DOWN_RMS_WRITE) + DOWN_RMS_EPILOGUE
        _KERNELS[key] = portable_kernel(
            name=f"mtl_moe_down_rms_s{int(sh)}", header=HEADER, body=body,
            input_names=["x", "inds", "wd", "sd", "bd"] + (["wsd", "ssd", "bsd"] if sh else [])
            + ["h", "nw", "eps", "cnt"],
            output_names=["dlt", "hsum", "y"],
            # the 35B-A3B geometry at batch 1, and metal_cases' trial (H 256, Im 128, 2 tokens)
            examples=[_down_rms_example(dt, b, sh, H, Im, T) for dt in (mx.bfloat16, mx.float32) for b in (4, 8)
                      for H, Im, T in ((2048, 512, 1), (256, 128, 2))])
    return _KERNELS[key]


for _sh in (False, True):  # declared at import so check_metal / check_cuda see them
    _route_kernel(_sh)
    _gate_up_kernel(_sh)
    _down_kernel(_sh)
    _down_rms_kernel(_sh)

MAX_EXPERTS = 32 * 32  # EPL <= 32 logits per lane
MAX_TOP_K = 16


def route_limits(E: int, k: int) -> bool:
    """The routing body's limits: top-k of at most MAX_TOP_K, at most MAX_EXPERTS logits (EPL <= 32 a lane)."""
    return 1 <= k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS


def route_supported(logits: mx.array, k: int, shared_logit: mx.array | None) -> bool:
    T, E = logits.shape if logits.ndim == 2 else (0, 0)
    return (logits.ndim == 2 and T > 0 and route_limits(E, k) and logits.dtype in XKIND
            and (shared_logit is None or (shared_logit.shape == (T, 1) and shared_logit.dtype in XKIND)))


def route(logits: mx.array, k: int, renorm: bool = True, shared_logit: mx.array | None = None):
    """logits [T, E] -> (inds [T, k] int32, weights [T, k (+1)] fp32), as moe_route_ref; None: not covered."""
    if not route_supported(logits, k, shared_logit):
        return None
    T, E = logits.shape
    sh = shared_logit is not None
    inds, w = _route_kernel(sh)(
        gpu_backend(), inputs=[logits] + ([shared_logit] if sh else []),
        output_shapes=[(T, k), (T, k + sh)], output_dtypes=[mx.int32, mx.float32],
        grid=(32 * T, 1, 1), threadgroup=(32, 1, 1),
        template=[("T", logits.dtype), ("KT", k), ("EPL", -(-E // 32)), ("SH", sh), ("RN", bool(renorm))],
        init_value=POISON)
    return inds, w


def _quant_ok(p, x: mx.array, bits: int, gs: int) -> bool:
    return (p.quantized and p.bits == bits and p.group_size == gs
            and (p.scales.dtype == x.dtype or x.dtype == mx.float32))


def fused_supported(x, gate, up, down, inds) -> bool:
    """Shapes the fused expert kernels cover: T <= moe_fused_max_tokens, 4/8-bit, g32/64/128, the three
    stacked projections alike, scales in x's dtype (or x fp32)."""
    if not (x.ndim == 2 and 1 <= x.shape[0] <= SELECT["moe_fused_max_tokens"] and x.dtype in XKIND
            and inds.ndim == 2 and inds.shape[0] == x.shape[0] and gate.quantized):
        return False
    bits, gs = gate.bits, gate.group_size
    if bits not in (4, 8) or gs not in (32, 64, 128) or not all(_quant_ok(p, x, bits, gs) for p in (gate, up, down)):
        return False
    E, Im, _ = gate.weight.shape
    H = x.shape[1]
    return (gate.weight.ndim == 3 and up.weight.shape == gate.weight.shape and H % gs == 0 and Im % gs == 0
            and gate.weight.shape[2] * 32 // bits == H and down.weight.shape == (E, H, Im * bits // 32))


def shared_fusable(shared, gate, x) -> bool:
    """The shared expert rides in the fused launches as one more slot: same quantization, Is == Im."""
    if shared is None:
        return False
    sg, su, sd = shared
    Im = gate.weight.shape[1]
    return (all(_quant_ok(p, x, gate.bits, gate.group_size) for p in shared) and sg.weight.shape == gate.weight.shape[1:]
            and su.weight.shape == sg.weight.shape and sd.weight.shape == (x.shape[1], Im * gate.bits // 32))


def _cast(a: mx.array, dt) -> mx.array:
    return a if a.dtype == dt else a.astype(dt)


def _fused_launches(x, gate, up, down, inds, weights, with_shared, rows, down_kernel, down_extra, down_tmpl, n_out):
    """The gate+up launch, then `down_kernel` over its output: `down_extra` inputs and `down_tmpl` template
    values appended, `n_out` outputs of [T, H]."""
    T, H = x.shape
    k = inds.shape[1]
    sh = with_shared is not None
    dt, bits, gs = x.dtype, gate.bits, gate.group_size
    Im = gate.weight.shape[1]
    gr, dr = rows or (SELECT["moe_gate_up_rows"], SELECT["moe_down_rows"])

    def tmpl(R, P, epi):  # the examples' order (check_metal matches launches to them)
        return [("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", gs), ("MT", 1), ("R", R), ("U", 1), ("P", P),
                ("EPI", epi), ("PF", False), ("NP", bits == 4 and SELECT["qmv_nibble_pairs"] == 1), ("KT", k),
                ("SH", sh)]

    def wsb(p):
        return [p.weight, _cast(p.scales, dt), _cast(p.biases, dt)]

    S = k + sh
    inds = _cast(inds, mx.int32)
    ins = [x, inds, _cast(weights, mx.float32)] + wsb(gate) + wsb(up)
    if sh:
        ins += wsb(with_shared[0]) + wsb(with_shared[1])
    # h: pair (t, s)'s Im units at row t, columns s*Im.. — [T * S, Im] in memory, declared [T, S * Im] (the
    # kernel reads no output shape) so that down reads it without a reshape node (host time per node)
    h = _gate_up_kernel(sh)(
        gpu_backend(), inputs=ins, output_shapes=[(T, S * Im)], output_dtypes=[dt],
        grid=(-(-Im // (4 * gr)) * 128, T * S, 1), threadgroup=(128, 1, 1),
        template=tmpl(2 * gr, 2, 1), init_value=POISON)[0]
    ins = [h, inds] + wsb(down) + (wsb(with_shared[2]) if sh else []) + down_extra
    return down_kernel(sh)(
        gpu_backend(), inputs=ins, output_shapes=[(T, H)] * n_out, output_dtypes=[dt] * n_out,
        grid=(-(-H // (4 * dr)) * 128, T, 1), threadgroup=(128, 1, 1),
        template=tmpl(dr, 1, 0) + down_tmpl, init_value=POISON)


def fused_experts(x, gate, up, down, inds, weights, with_shared: tuple | None = None,
                  rows: tuple[int, int] | None = None) -> mx.array:
    """x [T, H] -> sum over the k routed slots (and `with_shared`'s expert as slot k, weight weights[:, k])
    [T, H]; `rows` = (gate rows, down rows) per SIMD group overrides the table's blocking."""
    return _fused_launches(x, gate, up, down, inds, weights, with_shared, rows, _down_kernel, [], [], 1)[0]


def fused_add_norm_supported(x, gate, up, down, inds, with_shared, h, w) -> bool:
    """fused_supported, the shared expert (if any) riding along, and a residual h [T, H] of x's dtype that
    the epilogue's registers hold (SELECT["qmv_residual_norm"] switches both residual epilogues)."""
    return (SELECT["qmv_residual_norm"] == 1 and fused_supported(x, gate, up, down, inds)
            and (with_shared is None or shared_fusable(with_shared, gate, x))
            and h.shape == x.shape and h.dtype == x.dtype and x.dtype in FLOATS and w.shape == (x.shape[1],)
            and x.shape[1] <= 128 * MAX_EPT)


def fused_experts_add_rms_norm(x, gate, up, down, inds, weights, with_shared, h, w, eps: float,
                               rows: tuple[int, int] | None = None) -> tuple[mx.array, mx.array]:
    """(h + fused_experts(...), rms_norm(h + fused_experts(...)) * w), both [T, H]: the down launch carries
    the residual add and the norm (the last of its threadgroups does every token's row)."""
    extra = [h, w, eps_array(eps), arrival_counter(down)]
    # residual elements a thread of the epilogue holds, all in one pass (residual.py's EC = EPT)
    ept = [("EPT", -(-x.shape[1] // 128)), ("EC", -(-x.shape[1] // 128))]
    _, hsum, y = _fused_launches(x, gate, up, down, inds, weights, with_shared, rows, _down_rms_kernel, extra, ept, 3)
    return hsum, y
