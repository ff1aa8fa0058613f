"""The GDN input projections with the causal conv + SiLU in their epilogue (decode: one token a sequence).

    mixed = x @ W_0^T                          (rounded to x's dtype, as `linear` returns it)
    y_0   = silu(sum_j w[:, j] * concat(old conv rows, mixed)[j])   the conv output the delta rule reads
    new conv rows = (old rows 1.., mixed)      written into the conv pool's rows in place
    y_p   = x @ W_p^T for p = 1, 2, 3          (z, b, a)

Why: at decode the conv is its own launch after the projections, one a GDN layer (24 a 9B step, 30 a
35B-A3B step), each ~10-15 us of MLX host time in a host-bound step (benchmarks/decode_profile.md). The conv
is depthwise: output channel n reads only channel n's K-1 old rows and its new value, so the lane that stores
projection row n does it. Only when every sequence of the batch has one token (a longer segment's tokens
read each other's raw rows) and the FMA qmv serves (the tensor-core variant has no epilogue).

Row m of x is sequence m; its conv state is pool row rows[m]. The lane owning channel n reads that row's K-1
values of channel n, then writes them: no other lane touches them (two sequences never share a slot; the
compiled step's padding rows may share its scratch slot, but the same lane handles every row m of channel n,
in order, and padding's values are never read).
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..norms.kernels import FLOATS
from ..portable import KernelExample, portable_kernel
from ..selection import SELECT, qmv_config
from ..seqs import SeqLayout
from . import gemv
from .bodies import HEADER, XKIND, fma_body, ptr_select
from .params import LinearParams

# Projection 0's store: the conv over (old rows, this row's raw value), in the reference's order and roundings
# (old values pass through x's dtype, as causal_conv1d_ref concatenates pool.astype(x.dtype) with x).
CONV_STORE = r"""if (n < N) {
          if (p == 0) {
            constexpr int KS = KC - 1;
            const float raw = TO_FLOAT(FROM_FLOAT(T, acc[m][r]));
            DEVICE_PTR PT* prow = (DEVICE_PTR PT*)pool + (size_t)rows[m] * KS * N + n;
            float old[KS];
            for (int i = 0; i < KS; ++i) old[i] = TO_FLOAT(FROM_FLOAT(T, TO_FLOAT(prow[(size_t)i * N])));
            float cv = 0.0f;
            for (int i = 0; i < KS; ++i) cv += TO_FLOAT(convw[(size_t)n * KC + i]) * old[i];
            cv += TO_FLOAT(convw[(size_t)n * KC + KS]) * raw;
            y0[(size_t)m * N + n] = FROM_FLOAT(T, cv / (1.0f + EXP(-cv)));
            for (int i = 0; i + 1 < KS; ++i) prow[(size_t)i * N] = FROM_FLOAT(PT, old[i + 1]);
            prow[(size_t)(KS - 1) * N] = FROM_FLOAT(PT, raw);
          } else {
            DEVICE_PTR T* Y = YSEL;
            Y[(size_t)m * N + n] = FROM_FLOAT(T, acc[m][r]);
          }
        }"""

PROJECTIONS = 4  # the GDN layer's qkv, z, b, a


def _example(dt, bits: int) -> KernelExample:
    """The Qwen3.5-9B GDN projections (K 4096; qkv 8192, z 4096, b and a 32 rows, g64), conv K 4, for the
    compile checks (check_metal's trial runs these template values at a smaller K and N)."""
    wq = [[(mx.uint32, (n, 4096 * bits // 32)), (dt, (n, 64)), (dt, (n, 64))] for n in (8192, 4096, 32, 32)]
    ins = [(dt, (2, 4096))] + [a for w in wq for a in w] + [(dt, (8192, 4)), (dt, (5, 3, 8192)), (mx.int32, (2,))]
    tmpl = [("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", 64), ("MT", 2), ("R", 4), ("U", 1),
            ("P", PROJECTIONS), ("EPI", 0), ("PF", bits == 4), ("NP", bits == 4), ("PT", dt), ("KC", 4)]
    return KernelExample(inputs=ins, outputs=[dt] * PROJECTIONS, template=tmpl)


QMV_CONV = portable_kernel(
    name=f"mtl_qmv_conv_p{PROJECTIONS}",
    input_names=["x"] + [f"{a}{i}" for i in range(PROJECTIONS) for a in ("w", "s", "b")] + ["convw", "pool", "rows"],
    output_names=[f"y{i}" for i in range(PROJECTIONS)],
    body=fma_body(PROJECTIONS, 0, store=CONV_STORE.replace("YSEL", ptr_select("y", PROJECTIONS))),
    header=HEADER, examples=[_example(dt, bits) for dt in (mx.bfloat16, mx.float32) for bits in (4, 8)])


def one_token_each(layout: SeqLayout) -> bool:
    """Every sequence of the batch has exactly one token, none verifying, no state taps (decode rows)."""
    B = layout.num_seqs
    return (B > 0 and layout.query_start_loc == list(range(B + 1)) and not (layout.verify and any(layout.verify))
            and not layout.state_taps)


def covers(x: mx.array, ps: list[LinearParams], conv_w: mx.array, conv_pool: mx.array, layout: SeqLayout) -> bool:
    M = x.shape[0] if x.ndim == 2 else 0
    N0 = ps[0].out_features if ps else 0
    return (SELECT["qmv_conv_epilogue"] == 1 and gpu_backend() is not None and len(ps) == PROJECTIONS
            and gemv.fma_serves(M) and M == layout.num_seqs and one_token_each(layout) and x.dtype in FLOATS
            and conv_w.ndim == 2 and conv_w.shape[0] == N0 and 2 <= conv_w.shape[1] <= 8 and conv_w.dtype in FLOATS
            and conv_pool.ndim == 3 and conv_pool.shape[1:] == (conv_w.shape[1] - 1, N0) and conv_pool.dtype in FLOATS
            and gemv.qmv_supported(x, ps))


def qmv_conv(x: mx.array, ps: list[LinearParams], conv_w: mx.array, conv_pool: mx.array, layout: SeqLayout,
             init_value: float | None = None, cfg: tuple[int, int, int] | None = None) -> list[mx.array]:
    """The launch: x [M, K] (row m = sequence m), the four projections -> [silu(conv) [M, N0], z, b, a]; conv_pool's rows
    state_rows[m] hold the new conv states afterwards (the caller makes later readers depend on y0).
    cfg = (R, U, PF) overrides the qmv's blocking and prefetch (check_metal's trials)."""
    if len(ps) != PROJECTIONS:
        raise ValueError(f"qmv_conv takes the GDN layer's {PROJECTIONS} projections (qkv, z, b, a), got {len(ps)}")
    M, K = x.shape
    p0 = ps[0]
    R, U = cfg[:2] if cfg is not None else qmv_config(gemv.row_bucket(M), K, p0.bits, N=p0.out_features)
    nblocks = sum((p.out_features + 4 * R - 1) // (4 * R) for p in ps)
    return QMV_CONV(
        gpu_backend(),
        inputs=gemv.fma_inputs(x, ps) + [conv_w, conv_pool, layout.array("state_rows")],
        output_shapes=[(M, p.out_features) for p in ps],
        output_dtypes=[x.dtype] * len(ps),
        grid=(nblocks * 128, 1, 1),
        threadgroup=(128, 1, 1),
        template=gemv.fma_template(x, p0, R, U, PROJECTIONS, 0, cfg[2] if cfg is not None else None)
        + [("PT", conv_pool.dtype), ("KC", conv_w.shape[1])],
        init_value=gemv.POISON if init_value is None else init_value,
    )


def gdn_in_proj_conv_kernel(x, ps, conv_w, conv_pool, layout):
    """-> ([silu(conv(x W_0^T)), x W_1^T, ...], None): the conv states written in place; None where `covers`
    says no."""
    if not covers(x, ps, conv_w, conv_pool, layout):
        return None
    return qmv_conv(x, ps, conv_w, conv_pool, layout), None
