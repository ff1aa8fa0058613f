"""The MoE expert MLPs at prefill sizes on the tensor-core quantized GEMM (qmatmul/qgemm.py), grouped by
expert: no per-expert launch, no host read.

Layout (`group_layout`, plain MLX ops of static shapes): the T*k (token, expert) pairs sorted by expert
(ties in pair order), each expert's segment padded to a multiple of MB rows and laid end to end in a
buffer of R rows (`padded_rows`, the static upper bound), and per MB-row tile the expert it belongs to
(-1 past the last segment). Path (`grouped_experts`): one grouped SwiGLU launch over x's rows in the
buffer's order (gate + up -> [R, Im]), one grouped down launch (-> [R, H]), each pair's row gathered back,
weighted and summed over its k experts (routed_sum); the shared expert on the dense ops.

The gather of x is the gate+up kernel's own activation load (row r reads x[src[r]], zeros for padding), so
the [R, H] buffer is never written. Rows the kernel never writes: unused tiles exit (qgemm_source.group_select),
so their output rows keep whatever the buffer held (NaN under POISON); padding rows inside an expert's
tile come out zero and are never read back. Only the pairs' rows (`dest`) are read.

CUDA only (qgemm's mma.sync); elsewhere, and for shapes it does not cover, the sorted gather_qmm path.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample
from ..qmatmul import qgemm, qgemm_source
from ..qmatmul.params import LinearParams
from ..selection import SELECT
from .reference import combine_ref, shared_expert_ref

POISON: float | None = None  # tests set NaN: the rows the path reads must then be written by the kernel


class GroupLayout(NamedTuple):
    """Pairs p = t*k + j of inds [T, k] grouped by expert in a padded buffer of R rows, MB-row tiles."""

    counts: mx.array       # [E] int32: pairs per expert
    offsets: mx.array      # [E] int32: first buffer row of each expert's segment (padded to MB rows)
    dest: mx.array         # [T*k] int32: each pair's buffer row
    src: mx.array          # [R] int32: each buffer row's token (-1: padding)
    tile_expert: mx.array  # [R / MB] int32: each tile's expert (-1: unused)


def padded_rows(pairs: int, experts: int, mb: int) -> int:
    """R: every pair plus at most MB-1 padding rows per expert that has pairs, rounded up to MB."""
    r = pairs + min(experts, pairs) * (mb - 1)
    return -(-r // mb) * mb


def group_layout(inds: mx.array, experts: int, mb: int) -> GroupLayout:
    """Expert ids inds [T, k] -> the grouped layout (see GroupLayout), on the device."""
    T, k = inds.shape
    P, E = T * k, experts
    if E * P >= 2**31:
        raise ValueError(f"grouped layout: {E} experts x {P} pairs overflow the int32 sort key")
    R = padded_rows(P, E, mb)
    flat = inds.reshape(-1).astype(mx.int32)                       # [P]
    pair = mx.arange(P, dtype=mx.int32)
    counts = mx.zeros((E,), mx.int32).at[flat].add(1)               # [E]
    padded = (counts + mb - 1) // mb * mb
    seg_end = mx.cumsum(padded)                                      # [E] inclusive
    offsets = seg_end - padded
    first = mx.cumsum(counts) - counts                               # [E] first sorted position of e
    order = mx.argsort(flat * P + pair)                              # unique keys: by expert, then pair
    ids = flat[order]
    dest = mx.zeros((P,), mx.int32)
    dest[order] = offsets[ids] + (pair - first[ids])                 # rank inside the expert's segment
    src = mx.full((R,), -1, mx.int32)
    src[dest] = pair // k
    starts = mx.arange(0, R, mb, dtype=mx.int32)                     # [R / MB] first row of each tile
    te = (seg_end[None, :] <= starts[:, None]).astype(mx.int32).sum(axis=1)  # segments ending at or before
    tile_expert = mx.where(te < E, te, -1).astype(mx.int32)
    return GroupLayout(counts, offsets, dest, src, tile_expert)


def tile_rows(pairs: int, experts: int) -> int:
    """MB: SELECT["moe_grouped_tile_rows"], or (0) the smallest of qgemm's row classes 16 / 32 / 64 that
    holds the mean pairs per expert (why: selection.py)."""
    row = SELECT["moe_grouped_tile_rows"]
    if row:
        return row
    mean = pairs / max(experts, 1)
    return 16 if mean <= 16 else (32 if mean <= 32 else 64)


def config(mb: int, epi: int) -> tuple[int, int, int, int, int]:
    """(RT, TT, WN, WM, STAGES) at MB = mb activation rows: qgemm.config's blocking for that row class, as
    it picks it for a 4-bit 4096 x 4096 matrix (not tuned per expert shape; the stages' shared memory is
    sized for the real bits by _launch_args).
    No split-K: the tile count is a static upper bound, so the blocks that work are unknown on the host,
    and T*k >= 64 pairs already give N / TR blocks per used tile."""
    if mb not in (16, 32, 64):
        raise ValueError(f"grouped qgemm: tile rows must be 16, 32 or 64, got {mb}")
    RT, TT, WN, WM, ST, _ = qgemm.config(mb, 4096, 4096, 4, epi)
    assert 8 * TT * WM == mb
    return RT, TT, WN, WM, ST


def _launch_args(x_dtype, p0: LinearParams, P: int, epi: int, mb: int, gather: bool = False):
    RT, TT, WN, WM, ST = config(mb, epi)
    smem = ST * qgemm.stage_bytes(p0.bits, RT, TT, WN, WM)
    template = [("T", x_dtype), ("XK", qgemm_source.XKIND[x_dtype]), ("BITS", p0.bits), ("GS", p0.group_size),
                ("RT", RT), ("TT", TT), ("WN", WN), ("WM", WM), ("STAGES", ST), ("P", P), ("EPI", epi),
                ("PART", 0), ("YT", x_dtype)]
    nout = 16 * WN if epi == 1 else 16 * RT * WN
    return qgemm.kernel(P, epi, smem, grouped=2 if gather else 1), template, nout, 32 * WN * WM


def grouped_qgemm(x: mx.array, ps: list[LinearParams], tile_expert: mx.array, mb: int, epi: int = 0,
                  src: mx.array | None = None) -> list[mx.array]:
    """x [R, K] (R = MB * tiles) over stacked experts' weights ([E, N, K*bits/32], scales / biases
    [E, N, K/gs]) -> [y_p [R, N_p]] (epi 0) or [silu(x W_0^T) * (x W_1^T)] (epi 1), tile i of MB rows
    against expert tile_expert[i]; rows of tiles with expert -1 are not written. With `src` [R] int32,
    x is [T, K] and row r of the activations is x[src[r]] (zeros where src[r] = -1), read in the kernel."""
    R = x.shape[0] if src is None else src.shape[0]
    if R % mb or tile_expert.shape != (R // mb,):
        raise ValueError(f"grouped qgemm: {R} rows are not {tile_expert.shape[0]} tiles of {mb}")
    kern, template, nout, nt = _launch_args(x.dtype, ps[0], len(ps), epi, mb, gather=src is not None)
    nbn = sum(-(-p.weight.shape[1] // nout) for p in (ps[:1] if epi == 1 else ps))
    shapes = [(R, ps[0].weight.shape[1])] if epi == 1 else [(R, p.weight.shape[1]) for p in ps]
    return list(kern(
        "cuda", inputs=[x] + [a for p in ps for a in (p.weight, p.scales, p.biases)] + [tile_expert]
        + ([] if src is None else [src]),
        output_shapes=shapes, output_dtypes=[x.dtype] * len(shapes), grid=(nbn * nt, R // mb, 1),
        threadgroup=(nt, 1, 1), template=template, init_value=POISON))


def grouped_qgemm_ref(x: mx.array, ps: list[LinearParams], tile_expert: mx.array, mb: int, epi: int = 0,
                      src: mx.array | None = None) -> list[mx.array]:
    """grouped_qgemm's reference twin (MLX's gather_qmm, each row against its tile's expert; unused tiles
    against expert 0): what the CPU tests of the path run."""
    if src is not None:  # the gathered rows, padding rows zero
        x = x[mx.maximum(src, 0)] * (src >= 0)[:, None].astype(x.dtype)
    ids = mx.repeat(mx.maximum(tile_expert, 0), mb)                                # [R]

    def proj(p):
        return mx.gather_qmm(x[:, None, :], p.weight, p.scales, p.biases, rhs_indices=ids, transpose=True,
                             group_size=p.group_size, bits=p.bits, sorted_indices=True)[:, 0, :]

    if epi == 1:
        g = proj(ps[0])
        return [g * mx.sigmoid(g) * proj(ps[1])]
    return [proj(p) for p in ps]


def supported(x: mx.array, gate: LinearParams, up: LinearParams, down: LinearParams, inds: mx.array) -> bool:
    """CUDA; bf16 / fp16 x; 4/8-bit groups of 32/64/128 with x's dtype for scales; gate and up alike;
    H and Im multiples of 256 (qgemm's K-stage alignment, as qgemm.supported)."""
    if gpu_backend() != "cuda" or x.ndim != 2 or x.dtype not in qgemm_source.XKIND or inds.ndim != 2:
        return False
    ps = (gate, up, down)
    if not all(p.quantized and p.weight.ndim == 3 and p.bits in (4, 8) and p.group_size in (32, 64, 128)
               and p.scales.dtype == x.dtype and p.biases.dtype == x.dtype for p in ps):
        return False
    E, Im, H = gate.weight.shape[0], gate.weight.shape[1], x.shape[1]
    return (gate.bits == up.bits and gate.group_size == up.group_size and up.weight.shape == gate.weight.shape
            and gate.in_features == H and down.weight.shape[:2] == (E, H) and down.in_features == Im
            and H % 256 == 0 and Im % 256 == 0 and E * inds.size < 2**31
            and padded_rows(inds.size, E, 16) // 16 < 65536)  # tiles at MB 16 within grid.y's limit


def grouped_experts(x: mx.array, gate: LinearParams, up: LinearParams, down: LinearParams, inds: mx.array,
                    weights: mx.array, shared: tuple | None = None, shared_mlp=shared_expert_ref,
                    mb: int | None = None, gemm=grouped_qgemm, combine=combine_ref) -> mx.array:
    """moe_experts_ref on the grouped layout and two grouped qgemm launches: x [T, H] -> [T, H]. `mb`
    overrides tile_rows; `gemm` = grouped_qgemm_ref runs the same path on the CPU; `combine` reads each
    pair's row of the buffer back (combine_ref's signature; ops.py passes the combine op)."""
    T, k = inds.shape
    E = gate.weight.shape[0]
    mb = mb or tile_rows(T * k, E)
    lay = group_layout(inds, E, mb)
    h = gemm(x, [gate, up], lay.tile_expert, mb, epi=1, src=lay.src)[0]           # [R, Im], x's rows by src
    y = gemm(h, [down], lay.tile_expert, mb)[0]                                    # [R, H]
    return combine(y, lay.dest, weights, k, None if shared is None else shared_mlp(x, shared), dtype=x.dtype)


def examples() -> list[tuple]:
    """Instantiations for check_cuda, as the path launches them: SwiGLU gate+up (gathering x's rows) and
    down at each tile-row class, 4/8-bit, bf16, fp16 at 32 rows; the 35B-A3B geometry (E 256, H 2048,
    Im 512)."""
    E, H, Im = 256, 2048, 512
    combos = [(mx.bfloat16, bits, mb) for bits in (4, 8) for mb in (16, 32, 64)] + [(mx.float16, 4, 32)]
    out = []
    for dt, bits, mb in combos:
        for epi, (N, K), P in ((1, (Im, H), 2), (0, (H, Im), 1)):
            gather = epi == 1  # the path's gate+up reads x's rows by src_row, its down the buffer
            kern, template, _, _ = _launch_args(dt, LinearParams(None, None, None, bits, 64), P, epi, mb, gather)
            wq = [(mx.uint32, (E, N, K * bits // 32)), (dt, (E, N, K // 64)), (dt, (E, N, K // 64))]
            rows = [(mx.int32, (mb * 40,))] if gather else []
            ex = KernelExample(inputs=[(dt, (100 if gather else mb * 40, K))] + wq * P + [(mx.int32, (40,))] + rows,
                               outputs=[dt], template=template)
            out.append((kern, ex))
    return out


def available() -> bool:
    return gpu_backend() == "cuda"
