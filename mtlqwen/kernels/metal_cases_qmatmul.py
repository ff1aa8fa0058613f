"""check_metal --run's trials of the quantized GEMV and the dequantize kernel (kernels/metal_cases.py collects
them): one to four projections, the SwiGLU, residual + RMSNorm and conv epilogues, the stacked dequantize, and
the ops at the selection table's defaults where CUDA would take a CUDA-only variant."""

from __future__ import annotations

import numpy as np

import mlx.core as mx

from .metal_cases import BF16, F32, TOL, Trial, _cpu, _fn, _layout, _n, _pool_rows, _rand


# ---- quantized GEMV (one to three projections, SwiGLU epilogue, residual + RMSNorm epilogue) ------------------


def _linear(rng, N, K, bits, dt):
    w = _rand(rng, N, K, scale=0.05)
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)
    return _fn("LinearParams")(wq, s.astype(dt), b.astype(dt), bits=bits, group_size=64)


def _linear32(x, p):
    """The twin evaluated in fp32 (MLX's CPU quantized_matmul keeps 16-bit inputs' precision), x's dtype out."""
    p32 = _fn("LinearParams")(p.weight, p.scales.astype(F32), p.biases.astype(F32), bits=p.bits,
                              group_size=p.group_size)
    return _cpu(_fn("linear_ref"), x.astype(F32), p32)


def _qmv_conv_trials() -> list[Trial]:
    """The GDN projections with the conv epilogue (qmatmul/conv_epilogue.py) at the examples' template values
    (2 rows, R 4, U 1, conv K 4), K 512: two one-token sequences in random slots of 5; outputs: the four
    projections (the first through the conv) and the pool's rows after the launch (batch rows, then the others)."""
    out = []
    for dt in (BF16, F32):
        for bits in (4, 8):
            rng = np.random.default_rng(60 + bits)
            x = _rand(rng, 2, 512, dtype=dt)
            ps = [_linear(rng, n, 512, bits, dt) for n in (96, 64, 8, 8)]
            w, pool = _rand(rng, 96, 4, dtype=dt), _rand(rng, 5, 3, 96, dtype=dt)
            layout = _layout([1, 1], 5, rng)

            def run(x=x, ps=ps, w=w, pool=pool, L=layout, pf=bits == 4):
                p = pool + 0  # a fresh buffer: the kernel writes it in place
                mx.eval(p)
                ys = _fn("qmv_conv")(x, ps, w, p, L, cfg=(4, 1, int(pf)))
                mx.eval(ys)
                return list(ys) + _pool_rows(p, L.state_rows)

            def ref(x=x, ps=ps, w=w, pool=pool, L=layout):
                ys = [_linear32(x, p) for p in ps]
                y, states = _cpu(_fn("causal_conv1d_ref"), ys[0], w, pool, L)
                return [y] + ys[1:] + [states.astype(F32), _pool_rows(pool, L.state_rows)[1]]

            out.append(Trial(f"mtl_qmv_conv_p4[{_n(dt)} {bits}-bit]", run, ref, [TOL[dt]] * 5 + [0.0]))
    return out


def _qmv_trials() -> list[Trial]:
    out = []
    for dt in (BF16, F32):
        for bits in (4, 8):
            pf = bits == 4
            rng = np.random.default_rng(bits)
            x = _rand(rng, 4, 512, dtype=dt)  # M = 4: the examples' MT
            ps = [_linear(rng, 64, 512, bits, dt) for _ in range(4)]
            tag = f"{_n(dt)} {bits}-bit"
            for P, epi in ((1, 0), (2, 0), (3, 0), (4, 0), (2, 1)):
                name = f"mtl_qmv_p{P}_e{epi}"

                def run(x=x, ps=ps[:P], e=epi, pf=pf):  # the examples' R = 4 rows (SwiGLU: 2 gate + 2 up)
                    return list(_fn("qmv")(x, ps, epi=e, cfg=(2 if e else 4, 1, int(pf))))

                def ref(x=x, ps=ps[:P], e=epi):
                    ys = [_linear32(x, p) for p in ps]
                    if e == 1:
                        g, u = ys
                        return [_cpu(lambda: (g * mx.sigmoid(g) * u).astype(x.dtype))]
                    return [y.astype(x.dtype) for y in ys]

                out.append(Trial(f"{name}[{tag}]", run, ref, [TOL[dt]] * (1 if epi else P)))
                mma = f"mtl_qmv_mma_p{P}_e{epi}"
                out.append(Trial(f"{mma}[{tag}]", run, ref, [TOL[dt]] * (1 if epi else P), substitute=(name, mma)))
            for p_bits in (bits,):
                rng = np.random.default_rng(10 + p_bits)
                x2 = _rand(rng, 2, 256, dtype=dt)  # N = 4096: the examples' NBLK / EPT, short K
                p = _linear(rng, 4096, 256, p_bits, dt)
                h = _rand(rng, 2, 4096, dtype=dt)
                nw = 1 + _rand(rng, 4096, dtype=dt, scale=0.2)

                def run(x=x2, p=p, h=h, nw=nw):  # + the arrival counter: the last threadgroup resets it
                    from .selection import selected  # noqa: PLC0415

                    with selected({"qmv_residual_chunk": 0}):  # the one-pass epilogue; the default below
                        hs, y = _fn("qmv_add_rms")(x, p, h, nw, 1e-6, pf=1)
                        return [hs, y, _fn("arrival_counter")(p) + 0]

                def ref(x=x2, p=p, h=h, nw=nw):
                    d = _linear32(x, p).astype(x.dtype)
                    return list(_cpu(_fn("add_rms_norm_ref"), h, d, nw, 1e-6)) + [mx.zeros((8,), dtype=mx.uint32)]

                out.append(Trial(f"mtl_qmv_add_rms[{tag}]", run, ref, [TOL[dt], TOL[dt], 0.0]))
                if p_bits == 4:  # the tensor-core form's portable body (the FMA epilogue's) in its place
                    out.append(Trial(f"mtl_qmv_mma_add_rms[{tag}]", run, ref, [TOL[dt], TOL[dt], 0.0],
                                     substitute=("mtl_qmv_add_rms", "mtl_qmv_mma_add_rms")))
                if dt == BF16 and p_bits == 4:  # the two-pass epilogue, 8 columns a pass (qmv_residual_chunk)

                    def run_chunked(x=x2, p=p, h=h, nw=nw):
                        from .selection import selected  # noqa: PLC0415

                        with selected({"qmv_residual_chunk": 8}):
                            hs, y = _fn("qmv_add_rms")(x, p, h, nw, 1e-6, pf=1)
                            return [hs, y, _fn("arrival_counter")(p) + 0]

                    out.append(Trial(f"mtl_qmv_add_rms[{tag} EC 8]", run_chunked, ref, [TOL[dt], TOL[dt], 0.0]))
    return out


def _dequant_trials() -> list[Trial]:
    """The dequantize kernel at the examples' dtypes and bits (K = 512: 8 groups of 64), alone and stacking
    two to four matrices of different heights (a GDN layer's projections, scaled down)."""
    out = []
    tol = {**TOL, mx.float16: 3e-3}
    for dt in (BF16, mx.float16, F32):
        for bits in (4, 8):
            rng = np.random.default_rng(30 + bits)
            ps = [_linear(rng, n, 512, bits, dt) for n in (48, 40, 8, 24)]

            def ref(ps=ps, dt=dt):
                return [_cpu(lambda: mx.concatenate([
                    mx.dequantize(p.weight, p.scales.astype(F32), p.biases.astype(F32), group_size=64,
                                  bits=p.bits) for p in ps]).astype(dt))]

            out.append(Trial(f"mtl_dequantize_x1[{_n(dt)} {bits}-bit]", lambda p=ps[0], dt=dt: [_fn("dequantize")(p, dt)],
                             lambda ps=ps, dt=dt: ref(ps[:1], dt), [tol[dt]]))
            for n in (2, 3, 4):
                out.append(Trial(f"mtl_dequantize_x{n}[{_n(dt)} {bits}-bit]",
                                 lambda ps=ps[:n], dt=dt: [_fn("dequantize_stack")(ps, dt)],
                                 lambda ps=ps[:n], dt=dt: ref(ps, dt), [tol[dt]]))
    return out


def _selection_trials() -> list[Trial]:
    """Ops at the selection table's defaults, at shapes where CUDA would take a CUDA-only variant (the
    tensor-core qmv from SELECT["qmv_mma_min_rows"] rows): on Metal the portable kernel must run instead
    (a CUDA-only launch is a limit violation)."""
    from .selection import SELECT  # noqa: PLC0415

    rng = np.random.default_rng(21)
    x = _rand(rng, 6, 512, dtype=BF16)
    p = _linear(rng, 64, 512, 4, BF16)
    rows = SELECT["dequant_gemm_min_rows"] + 3  # prefill rows: the stacked dequantize + GEMM
    xp = _rand(rng, rows, 512, dtype=BF16)
    ps = [_linear(rng, n, 512, 4, BF16) for n in (256, 128, 32, 32)]
    gate, up = (_linear(rng, 128, 512, 4, BF16) for _ in range(2))

    def swiglu_ref():
        g, u = _linear32(xp, gate), _linear32(xp, up)
        return [_cpu(lambda: (g * mx.sigmoid(g) * u).astype(BF16))]

    return [Trial("linear[bfloat16 4-bit M=6, default selection]", lambda: [_fn("linear_kernel")(x, p)],
                  lambda: [_linear32(x, p).astype(BF16)], [TOL[BF16]], kernels=("mtl_qmv_p1_e0",)),
            Trial(f"linear_multi[bfloat16 4-bit M={rows}, 4 projections, default selection]",
                  lambda: list(_fn("linear_multi_kernel")(xp, ps)),
                  lambda: [_linear32(xp, p).astype(BF16) for p in ps], [TOL[BF16]] * 4, kernels=("mtl_dequantize_x4",)),
            Trial(f"swiglu_linear[bfloat16 4-bit M={rows}, default selection]",
                  lambda: [_fn("swiglu_linear_kernel")(xp, gate, up)], swiglu_ref, [TOL[BF16]],
                  kernels=("mtl_dequantize_x2",))]


def qmatmul_trials() -> list[Trial]:
    return _qmv_trials() + _qmv_conv_trials() + _dequant_trials() + _selection_trials()
