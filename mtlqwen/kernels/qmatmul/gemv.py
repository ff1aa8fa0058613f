"""Quantized matmul on GPU back-ends: a GEMV kernel for decode-sized M (1..8 rows) over MLX affine 4/8-bit
weights, with fused variants (several projections of one input in one launch, gate+up with the SwiGLU
epilogue); larger M goes to MLX's quantized GEMM or dequantize-then-bf16-GEMM per `selection.py`.
The kernel source lives in bodies.py; this module declares its instantiations and launches them.

Math (docs/qwen35.md §5.4): w = s*q + b per group of G input columns, so per group
    y += s * sum(x*q) + b * sum(x).
A 4-bit (8-bit) q becomes a float without a convert: OR-ing it under the exponent of 2^BITS gives the float
2^BITS + q exactly. We accumulate sum(x*(2^BITS+q)) and fold the offset into the bias,
    y += s * sum(x*f) + (b - 2^BITS*s) * sum(x),
which costs a shift+LOP3+FMA per weight (the instruction budget at M=1 is ~4 per weight at full bandwidth).
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, portable_kernel
from ..selection import SELECT, qmv_config
from . import dequant, qgemm, wgmma
from .bodies import HEADER, MMA_HEADER, XKIND, fma_body, mma_body
from .params import LinearParams

POISON: float | None = None  # tests set NaN: every output element must then be written by the kernel

_KERNELS: dict = {}


def _kernel(P: int, epi: int):
    key = (P, epi)
    if key not in _KERNELS:
        body = fma_body(P, epi)
        ins = ["x"] + [f"{a}{i}" for i in range(P) for a in ("w", "s", "b")]
        outs = ["y0"] if epi == 1 else [f"y{i}" for i in range(P)]
        _KERNELS[key] = portable_kernel(
            name=f"mtl_qmv_p{P}_e{epi}", input_names=ins, output_names=outs, body=body, header=HEADER,
            examples=[_example(P, epi, dt, bits) for dt in (mx.bfloat16, mx.float32) for bits in (4, 8)],
        )
    return _KERNELS[key]


def _mma_kernel(P: int, epi: int):
    """The tensor-core variant; its portable body (Metal, compile check) is the FMA kernel's."""
    key = ("mma", P, epi)
    if key not in _KERNELS:
        port = _kernel(P, epi)
        cuda = mma_body(P, epi)
        _KERNELS[key] = portable_kernel(
            name=f"mtl_qmv_mma_p{P}_e{epi}", input_names=port.input_names, output_names=port.output_names,
            body=port.body, cuda_body=cuda, header=HEADER + MMA_HEADER, examples=port.examples,
            cuda_examples=[_mma_example(P, epi, dt, c) for dt in (mx.bfloat16, mx.float16)
                           for c in (MMA_EXAMPLE_CFGS if dt == mx.bfloat16 else MMA_EXAMPLE_CFGS[:1])])
    return _KERNELS[key]


def _example(P: int, epi: int, dt, bits: int) -> KernelExample:
    """A Qwen3.5-9B-like call (K=4096, g64) for the Metal compile check."""
    wq = [(mx.uint32, (4096, 4096 * bits // 32)), (dt, (4096, 64)), (dt, (4096, 64))]
    tmpl = [("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", 64), ("MT", 4), ("R", 4), ("U", 1),
            ("P", P), ("EPI", epi), ("PF", bits == 4), ("NP", bits == 4)]
    return KernelExample(inputs=[(dt, (4, 4096))] + wq * P, outputs=[dt] * (1 if epi else P), template=tmpl)


MMA_EXAMPLE_CFGS = [(2, 2, 0), (4, 1, 0), (1, 4, 0), (2, 2, 1)]  # (RT, UG, CG) compiled by check_cuda: the table's first


def _mma_example(P: int, epi: int, dt, cfg: tuple[int, int, int] = (2, 2, 0)) -> KernelExample:
    """The tensor-core body's template (as `_qmv_mma` launches it) for the CUDA compile check."""
    ex = _example(P, epi, dt, 4)
    rt, ug, cg = cfg
    return KernelExample(inputs=ex.inputs, outputs=ex.outputs,
                         template=[("T", dt), ("XK", XKIND[dt]), ("GS", 64), ("UG", ug), ("NW", 8),
                                   ("P", P), ("EPI", epi), ("RT", rt), ("CG", cg)])


def row_bucket(M: int) -> int:
    """MT, the template's row count a launch of M rows is compiled for (1, 2, 4 or 8)."""
    return 1 if M == 1 else 2 if M == 2 else 4 if M <= 4 else 8


def qmv_supported(x: mx.array, ps: list[LinearParams], any_rows: bool = False) -> bool:
    """Shapes and types the qmv kernel covers; the scales must share x's dtype unless x is fp32. `any_rows`:
    everything but the row count (1..8)."""
    p0 = ps[0]
    if not (x.ndim == 2 and 1 <= x.shape[0] and (any_rows or x.shape[0] <= 8) and x.dtype in XKIND):
        return False
    return all(
        p.quantized and p.bits in (4, 8) and p.group_size in (32, 64, 128)
        and p.bits == p0.bits and p.group_size == p0.group_size and p.in_features == x.shape[1]
        and (p.scales.dtype == x.dtype or x.dtype == mx.float32)
        for p in ps
    )


def qmv(x: mx.array, ps: list[LinearParams], epi: int = 0, cfg: tuple[int, int] | None = None,
        mma: bool | None = None) -> list[mx.array]:
    """x [M, K], M <= 8 -> [y_p [M, N_p]] (epi 0) or [silu(x W_0^T) * (x W_1^T)] (epi 1).
    `cfg` = (R, U[, PF]) overrides the FMA kernel's blocking (and prefetch); `mma` forces / forbids the
    tensor-core variant, whose blocking `cfg` = (RT, UG, CG) then overrides (mma_config's)."""
    M, K = x.shape
    p0 = ps[0]
    if mma is None:
        mma = cfg is None and 0 < SELECT["qmv_mma_min_rows"] <= M
    if mma and gpu_backend() == "cuda" and p0.bits == 4 and x.dtype in (mx.bfloat16, mx.float16):
        return _qmv_mma(x, ps, epi, cfg)
    R, U = cfg[:2] if cfg is not None else qmv_config(row_bucket(M), K, p0.bits, swiglu=epi == 1, N=p0.out_features)
    pf = cfg[2] if cfg is not None and len(cfg) > 2 else None
    if epi == 1:
        R *= 2  # gate and up rows share the activation loads
    rp = R // 2 if epi == 1 else R
    nblocks = sum((p.out_features + 4 * rp - 1) // (4 * rp) for p in ([p0] if epi == 1 else ps))
    shapes = [(M, p0.out_features)] if epi == 1 else [(M, p.out_features) for p in ps]
    return _kernel(len(ps), epi)(
        gpu_backend(),
        inputs=fma_inputs(x, ps),
        output_shapes=shapes,
        output_dtypes=[x.dtype] * len(shapes),
        grid=(nblocks * 128, 1, 1),
        threadgroup=(128, 1, 1),
        template=fma_template(x, p0, R, U, len(ps), epi, pf),
        init_value=POISON,
    )


def fma_inputs(x: mx.array, ps: list[LinearParams]) -> list[mx.array]:
    """x, then (weight, scales, biases) per projection, scales in x's dtype (qmv_supported: they share it,
    or x is fp32 and they are cast)."""
    dt = x.dtype
    return [x] + [a if a.dtype == dt or a is p.weight else a.astype(dt)
                  for p in ps for a in (p.weight, p.scales, p.biases)]


def fma_template(x: mx.array, p0: LinearParams, R: int, U: int, P: int, epi: int, pf: int | None) -> list:
    """The FMA body's template constants (also residual.py's); pf None: the selection table's."""
    pf = SELECT["qmv_prefetch"] if pf is None else pf
    return [("T", x.dtype), ("XK", XKIND[x.dtype]), ("BITS", p0.bits), ("GS", p0.group_size), ("MT", row_bucket(x.shape[0])),
            ("R", R), ("U", U), ("P", P), ("EPI", epi), ("PF", int(pf)),
            ("NP", int(p0.bits == 4 and SELECT["qmv_nibble_pairs"] == 1))]


def mma_config(M: int, K: int, N: int, gs: int, epi: int) -> tuple[int, int, int]:
    """(RT, UG, CG) of a tensor-core qmv launch: 16-row tiles per threadgroup, K groups per pass of a SIMD
    group (0: 256 columns' worth), whether a pass's groups are consecutive; from the selection table."""
    wide = SELECT["qmv_mma_wide_tiles"]
    if wide and N >= 65536:  # the LM head: threadgroups enough for many waves whatever the tiles
        return wide, 1, 0
    ug = SELECT["qmv_mma_groups"] or max(1, 256 // gs)
    return SELECT["qmv_mma_tiles"], ug, SELECT["qmv_mma_consecutive"]


def mma_template(x: mx.array, p0: LinearParams, P: int, epi: int, cfg: tuple[int, int, int]) -> list:
    """The tensor-core body's template constants (also residual.py's) for blocking cfg = (RT, UG, CG)."""
    rt, ug, cg = cfg
    if not (1 <= rt <= 8 and ug >= 1 and cg in (0, 1)):  # SIMD group rt writes tile rt: at most NW = 8 tiles
        raise ValueError(f"tensor-core qmv blocking (RT, UG, CG) = {cfg}: needs 1 <= RT <= 8, UG >= 1, CG 0 or 1")
    return [("T", x.dtype), ("XK", XKIND[x.dtype]), ("GS", p0.group_size), ("UG", ug), ("NW", 8), ("P", P),
            ("EPI", epi), ("RT", rt), ("CG", cg)]


def mma_blocks(ps: list[LinearParams], epi: int, rt: int) -> int:
    """Threadgroups of a tensor-core qmv launch: RT tiles of 16 rows (8 gate + 8 up under SwiGLU) each."""
    rows = (8 if epi == 1 else 16) * rt
    return sum((p.out_features + rows - 1) // rows for p in (ps[:1] if epi == 1 else ps))


def _qmv_mma(x: mx.array, ps: list[LinearParams], epi: int, cfg: tuple[int, int, int] | None = None) -> list[mx.array]:
    """Tensor-core qmv: 8 SIMD groups split K, RT tiles of 16 weight rows per threadgroup (8 under SwiGLU)."""
    M, K = x.shape
    p0, dt = ps[0], x.dtype
    cfg = cfg or mma_config(M, K, p0.out_features, p0.group_size, epi)
    inputs = [x] + [a for p in ps for a in (p.weight, p.scales, p.biases)]
    shapes = [(M, p0.out_features)] if epi == 1 else [(M, p.out_features) for p in ps]
    return _mma_kernel(len(ps), epi)(
        "cuda", inputs=inputs, output_shapes=shapes, output_dtypes=[dt] * len(shapes),
        grid=(mma_blocks(ps, epi, cfg[0]) * 256, 1, 1), threadgroup=(256, 1, 1),
        template=mma_template(x, p0, len(ps), epi, cfg),
        init_value=POISON,
    )


def _flat(x: mx.array) -> tuple[mx.array, tuple]:
    lead = x.shape[:-1]
    # a reshape with -1 is a graph node even when nothing changes (host cost on every step)
    return (x if x.ndim == 2 else x.reshape(-1, x.shape[-1])), lead


def _use_qgemm(x2: mx.array, ps: list[LinearParams]) -> bool:
    """More rows than the qmv takes, up to qgemm_max_rows, on CUDA: the tensor-core GEMM."""
    return (qmv_rows_exceeded(x2) and x2.shape[0] <= SELECT["qgemm_max_rows"] and qgemm.available()
            and qgemm.supported(x2, ps))


def tc_gemm(x2: mx.array, ps: list[LinearParams], epi: int = 0) -> list[mx.array]:
    """The tensor-core GEMM for x2 [M, K]: the warpgroup-MMA form on Hopper where it takes the projections
    (wgmma.py: 4-bit), else qgemm's mma.sync."""
    if wgmma.takes(x2, ps):
        return wgmma.qgemm_wg(x2, ps, epi)
    return qgemm.qgemm(x2, ps, epi)


def fma_serves(M: int) -> bool:
    """The FMA qmv (not the tensor-core variant) serves M rows: the rows its epilogues (residual.py,
    conv_epilogue.py) can fuse into, as the tensor-core variant has none."""
    mma_from = SELECT["qmv_mma_min_rows"]
    return 1 <= M <= SELECT["qmv_max_rows"] and not (0 < mma_from <= M and gpu_backend() == "cuda")


def qmv_rows_exceeded(x2: mx.array) -> bool:
    return x2.shape[0] > SELECT["qmv_max_rows"]


def small_k_rows(x2: mx.array, ps: list[LinearParams]) -> bool:
    """More rows than qmv takes with a K the tensor-core GEMM cannot step through, on CUDA: these go to
    dequantize + GEMM, never to MLX's quantized GEMM (SELECT["small_k_dequant"])."""
    return (SELECT["small_k_dequant"] and gpu_backend() == "cuda" and qmv_rows_exceeded(x2)
            and x2.shape[1] % 256 != 0 and all(p.quantized for p in ps))


def dequant_linear(x2: mx.array, p: LinearParams) -> mx.array:
    """x2 [M, K] @ W^T with W dequantized to x2's dtype: the copy kept in memory, else the dequantize kernel
    where it covers p."""
    if p.dense is not None and p.dense.dtype == x2.dtype:
        return x2 @ p.dense_t  # attach() sets both
    if SELECT["dequant_kernel"] and dequant.supported(p, x2.dtype):
        return x2 @ dequant.dequantize(p, x2.dtype).T
    return x2 @ p.dequantized().astype(x2.dtype).T


def _dequant_route(x2: mx.array, p: LinearParams) -> bool:
    """More rows than qmv takes and not the tensor-core GEMM's: the table sends p to dequantize + GEMM."""
    if small_k_rows(x2, [p]):
        return True
    small_n = SELECT["small_n_dequant"] and p.out_features % 128 != 0  # any dtype: see the row
    return small_n or (SELECT["dequant_gemm_min_rows"] <= x2.shape[0] and x2.dtype in (mx.bfloat16, mx.float16))


def _big_m(x2: mx.array, p: LinearParams) -> mx.array:
    """More rows than qmv takes: the tensor-core GEMM (CUDA), else MLX's quantized GEMM (None: the
    reference) or dequantize + GEMM."""
    M = x2.shape[0]
    if _use_qgemm(x2, [p]):
        return tc_gemm(x2, [p])[0]
    if _dequant_route(x2, p):
        return dequant_linear(x2, p)
    if M <= SELECT["qmv_loop_max_rows"]:  # a few qmv launches beat MLX's GEMM for small M
        return mx.concatenate([qmv(x2[i:i + 8], [p])[0] for i in range(0, M, 8)], axis=0)
    return None


def _stacked_t(x2: mx.array, ps: list[LinearParams]) -> tuple[mx.array, list[mx.array]] | None:
    """Several projections of one input that all go to dequantize + GEMM, transposed for x2 @ W^T: (the
    stacked matrix's transpose [K, sum N_p], each projection's [K, N_p], views of it): the copies kept in memory
    (dense_weights.py: no slice or transpose node a step), else one dequantize launch (SELECT["dequant_stack"]);
    None where they cannot."""
    if not (SELECT["dequant_stack"] and SELECT["dequant_kernel"] and len(ps) > 1 and qmv_rows_exceeded(x2)
            and not _use_qgemm(x2, ps) and dequant.stackable(ps, x2.dtype)
            and all(_dequant_route(x2, p) for p in ps)):
        return None
    if kept_stack(ps, x2.dtype) is not None:
        return ps[0].dense_stack_t, [p.dense_t for p in ps]
    w = dequant.dequantize_stack(ps, x2.dtype)
    out, r = [], 0
    for p in ps:  # row ranges of the stack: contiguous, so no GEMM copies them
        out.append(w[r:r + p.out_features].T)
        r += p.out_features
    return w.T, out


def kept_stack(ps: list[LinearParams], dtype) -> mx.array | None:
    """The stacked copy kept in memory for exactly ps, in this order, of `dtype` (dense_weights.py), or None."""
    if ps[0].dense_stack is None:
        return None
    w = ps[0].dense_stack[0]
    if w.dtype != dtype or w.shape[0] != sum(p.out_features for p in ps):
        return None
    ok = all(p.dense_stack is not None and p.dense_stack[0] is w and p.dense_stack[1] == i for i, p in enumerate(ps))
    return w if ok else None


def _silu_mul_ops(g: mx.array, u: mx.array) -> mx.array:
    return (g * mx.sigmoid(g)) * u


# shapeless: one trace serves every chunk length (a retrace costs milliseconds of host time)
_silu_mul = mx.compile(_silu_mul_ops, shapeless=True)


for _pe in ((1, 0), (2, 0), (3, 0), (4, 0), (2, 1)):  # declared at import so check_metal sees them (4: the GDN projections)
    _kernel(*_pe)
    _mma_kernel(*_pe)


def mma_rows_to_mlx(M: int) -> bool:
    """Rows for which the table picks the tensor-core variant (CUDA only) on another back-end, where
    SELECT["qmv_mma_metal"] = 1 sends them to MLX's quantized matmul (the op's reference) instead of
    the FMA kernel."""
    return gpu_backend() != "cuda" and 0 < SELECT["qmv_mma_min_rows"] <= M and SELECT["qmv_mma_metal"] == 1


def linear_kernel(x: mx.array, p: LinearParams):
    if not p.quantized:
        return None
    x2, lead = _flat(x)
    if not qmv_supported(x2, [p], any_rows=True):  # (a slice of x2 here would be a graph node a call)
        return None
    M = x2.shape[0]
    wide_from = SELECT["mlx_qmm_min_n_at_8_rows"]
    wide = M >= 8 and 0 < wide_from <= p.out_features and fma_serves(M)
    if M <= SELECT["qmv_max_rows"] and not wide:
        y = None if mma_rows_to_mlx(M) else qmv(x2, [p])[0]
    else:
        y = _big_m(x2, p)
    return None if y is None else y.reshape(*lead, p.out_features)


SMALL_N = 128  # outputs of a projection small_n_split sends to qgemm past its rows (a GDN layer's b and a: Hv)


def small_n_split(x2: mx.array, ps: list[LinearParams]) -> tuple[list[int], list[int]] | None:
    """Past qgemm_max_rows and up to SELECT["qgemm_small_n_rows"] rows, on CUDA: (the indices of ps with at
    most SMALL_N outputs, the others') when there are such projections, for one qgemm launch of the small ones
    (cuBLAS runs each of them as a split-K GEMM and its reduce: two launches) beside the others' path; else None."""
    rows, M = SELECT["qgemm_small_n_rows"], x2.shape[0]
    if not (rows > 0 and SELECT["qgemm_max_rows"] < M <= rows and 1 < len(ps) <= 8):
        return None
    small = [i for i, p in enumerate(ps) if p.out_features <= SMALL_N]
    if not small or len(small) > 4 or not (qgemm.available() and qgemm.supported(x2, [ps[i] for i in small])):
        return None
    return small, [i for i in range(len(ps)) if i not in small]


def _small_n_multi(x: mx.array, x2: mx.array, lead: tuple, ps: list[LinearParams], small: list[int],
                   rest: list[int]) -> list[mx.array] | None:
    out: list = [None] * len(ps)
    # qgemm's mma.sync form, not tc_gemm: the warpgroup form's 256-row tiles would be mostly past these N
    for i, y in zip(small, qgemm.qgemm(x2, [ps[i] for i in small])):
        out[i] = y.reshape(*lead, ps[i].out_features)
    if rest:
        ys = (linear_multi_kernel(x, [ps[i] for i in rest]) if len(rest) > 1 else [linear_kernel(x, ps[rest[0]])])
        if ys is None or any(y is None for y in ys):
            return None
        for i, y in zip(rest, ys):
            out[i] = y
    return out


def linear_multi_kernel(x: mx.array, ps: list[LinearParams]):
    x2, lead = _flat(x)
    if len(ps) <= 4 and _use_qgemm(x2, ps):
        return [y.reshape(*lead, p.out_features) for y, p in zip(tc_gemm(x2, ps), ps)]
    sp = small_n_split(x2, ps)
    if sp is not None:
        return _small_n_multi(x, x2, lead, ps, *sp)
    st = _stacked_t(x2, ps)
    if st is not None and SELECT["dequant_stack_one_gemm"]:  # one GEMM; the outputs are its column ranges
        y, r, out = x2 @ st[0], 0, []
        for p in ps:
            out.append(y[:, r:r + p.out_features].reshape(*lead, p.out_features))
            r += p.out_features
        return out
    if st is not None:  # a GEMM per projection on its rows of the stack
        return [(x2 @ wt).reshape(*lead, p.out_features) for wt, p in zip(st[1], ps)]
    if small_k_rows(x2, ps):
        return [dequant_linear(x2, p).reshape(*lead, p.out_features) for p in ps]
    if (x2.shape[0] > SELECT["qmv_max_rows"] or len(ps) > 4 or mma_rows_to_mlx(x2.shape[0])
            or not qmv_supported(x2, ps)):
        return None
    return [y.reshape(*lead, p.out_features) for y, p in zip(qmv(x2, ps), ps)]


def swiglu_linear_kernel(x: mx.array, gate: LinearParams, up: LinearParams):
    x2, lead = _flat(x)
    if gate.out_features == up.out_features and _use_qgemm(x2, [gate, up]):
        return tc_gemm(x2, [gate, up], epi=1)[0].reshape(*lead, gate.out_features)
    st = _stacked_t(x2, [gate, up]) if gate.out_features == up.out_features else None
    if st is not None:
        # one dequantize, one GEMM gu [M, 2I], one fused SwiGLU reading its halves in place (MLX's
        # compiler): 3 launches instead of 7
        inter = gate.out_features
        gu = x2 @ st[0]
        return _silu_mul(gu[:, :inter], gu[:, inter:]).reshape(*lead, inter)
    if small_k_rows(x2, [gate, up]):
        g, u = dequant_linear(x2, gate), dequant_linear(x2, up)
        return ((g * mx.sigmoid(g)) * u).reshape(*lead, gate.out_features)
    if (x2.shape[0] > SELECT["qmv_max_rows"] or gate.out_features != up.out_features
            or mma_rows_to_mlx(x2.shape[0]) or not qmv_supported(x2, [gate, up])):
        return None
    return qmv(x2, [gate, up], epi=1)[0].reshape(*lead, gate.out_features)
