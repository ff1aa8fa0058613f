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
from .bodies import MMA_HEADER
from .params import LinearParams
from .qgemm_source import HEADER, XKIND, body as kernel_body, stage_bytes

POISON: float | None = None  # tests set NaN: every output element must then be written by the kernel
KSTEP = 128  # columns per pipeline stage
NUM_SMS = 132  # H200; split-K aims at a few waves of blocks over them

# kernels are built per (P, epi, shared-memory size): MLX's cuda_kernel fixes the dynamic shared memory
# when the kernel object is made
_KERNELS: dict = {}


def kernel(P: int, epi: int, smem: int, grouped: int = 0) -> PortableKernel:
    key = (P, epi, smem, grouped)
    if key not in _KERNELS:
        ins = (["x"] + [f"{a}{i}" for i in range(P) for a in ("w", "s", "b")]
               + ["tile_expert", "src_row"][:grouped])
        outs = ["y0"] if epi == 1 else [f"y{i}" for i in range(P)]
        body = kernel_body(P, epi, grouped)
        _KERNELS[key] = PortableKernel(
            name=f"mtl_qgemm{f'_grouped{grouped}' if grouped else ''}_p{P}_e{epi}_s{smem}", input_names=ins,
            output_names=outs, body=body,
            cuda_body=body, header=HEADER + MMA_HEADER, shared_memory=smem)
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
    if not (x.ndim == 2 and x.dtype in XKIND and x.shape[0] >= 1):
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
    kern = kernel(len(ps), epi, smem)
    outs = kern(
        "cuda",
        inputs=[x] + [a for p in ps for a in (p.weight, p.scales, p.biases)],
        output_shapes=shapes, output_dtypes=[yt] * len(shapes),
        grid=(nbn * 32 * WN * WM, nbm, split), threadgroup=(32 * WN * WM, 1, 1),
        template=[("T", x.dtype), ("XK", XKIND[x.dtype]), ("BITS", p0.bits), ("GS", p0.group_size),
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
        kern = kernel(P, epi, ST * stage_bytes(bits, RT, TT, WN, WM))
        yt = mx.float32 if split > 1 else dt
        wq = [(mx.uint32, (4096, 4096 * bits // 32)), (dt, (4096, 4096 // 64)), (dt, (4096, 4096 // 64))]
        ex = KernelExample(
            inputs=[(dt, (M, 4096))] + wq * P, outputs=[yt] * (1 if epi else P),
            template=[("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", 64), ("RT", RT), ("TT", TT),
                      ("WN", WN), ("WM", WM), ("STAGES", ST), ("P", P), ("EPI", epi), ("PART", int(split > 1)),
                      ("YT", yt)])
        out.append((kern, ex))
    return out


def available() -> bool:
    return gpu_backend() == "cuda"
