"""check_metal --run's trials of the MoE kernels (kernels/metal_cases.py collects them): the routing
kernel and the fused expert kernels (with and without the residual add + norm epilogue) on the Metal
emulator against their references on the CPU, at the registered examples' template values (k = 8, g64, 2
gate rows / 2 down rows per SIMD group; the epilogue's EPT at H = 256)."""

from __future__ import annotations

import numpy as np

import mlx.core as mx

from ..metal_cases import BF16, F32, TOL, Trial, _cpu, _fn, _n, _rand
from ..metal_cases_qmatmul import _linear32


def _experts(rng, E, N, K, bits, dt):
    """Stacked experts [E, N, K] quantized g64, scales in dt."""
    w = _rand(rng, E, N, K, scale=0.05)
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)
    return _fn("LinearParams")(wq, s.astype(dt), b.astype(dt), bits=bits, group_size=64)


def _to32(p):
    return _fn("LinearParams")(p.weight, p.scales.astype(F32), p.biases.astype(F32), bits=p.bits,
                               group_size=p.group_size)


def moe_trials() -> list[Trial]:
    out = []
    for dt in (BF16, F32):
        rng = np.random.default_rng(25)
        logits = _rand(rng, 3, 256, dtype=dt)  # E = 256: the examples' 8 logits per lane
        sgl = _rand(rng, 3, 1, dtype=dt)
        for sh in (False, True):
            s = sgl if sh else None
            out.append(Trial(
                f"mtl_moe_route_s{int(sh)}[{_n(dt)}]",
                lambda lg=logits, s=s: list(_fn("route")(lg, 8, True, s)),
                lambda lg=logits, s=s: list(_cpu(_fn("moe_route_ref"), lg, 8, True, s)), [0.0, 1e-5]))
        for bits in (4, 8):  # the router projection with the routing in its last threadgroup (moe/router.py)
            for T, H in ((3, 256), (1, 2048)):  # several tokens a SIMD group routes; the examples' batch-1 router
                rng = np.random.default_rng(20)
                xr = _rand(rng, T, H, dtype=dt)
                rt, sg = _experts(rng, 1, 256, H, bits, dt), _experts(rng, 1, 1, H, bits, dt)
                rt, sg = (_fn("LinearParams")(p.weight[0], p.scales[0], p.biases[0], bits=bits, group_size=64)
                          for p in (rt, sg))
                for sh in (False, True):
                    s = sg if sh else None

                    # bf16 logits tie (the kernel takes the lower id, the reference may not): the experts are
                    # compared by the logits they were picked for, position by position, as the tests do
                    def run_r(x=xr, rt=rt, s=s):  # + the arrival counter, reset by the last threadgroup
                        outs = list(_fn("launch")(x, rt, s, 8, True))
                        picked = mx.take_along_axis(outs[0], outs[-2], axis=-1)
                        return outs[:-2] + [picked, outs[-1], _fn("arrival_counter")(rt) + 0]

                    def ref_r(x=xr, rt=rt, s=s):
                        lg = [_linear32(x, p).astype(x.dtype) for p in ([rt] + ([s] if s is not None else []))]
                        inds, w = _cpu(_fn("moe_route_ref"), lg[0], 8, True, lg[1] if s is not None else None)
                        return lg + [mx.take_along_axis(lg[0], inds, axis=-1), w, mx.zeros((8,), dtype=mx.uint32)]

                    tol = [TOL[dt]] * (2 + sh) + [1e-4 if dt == F32 else TOL[dt], 0.0]
                    out.append(Trial(f"mtl_moe_router_route[{_n(dt)} {bits}-bit{' shared' if sh else ''} T{T}]", run_r, ref_r,
                                     tol, kernels=(f"mtl_moe_router_route_s{int(sh)}",)))
        # the fused experts at a small geometry; with the add + norm epilogue also at the examples' 35B-A3B one
        for bits, (E, H, Im, k, T) in ((b, g) for b in (4, 8) for g in ((16, 256, 128, 8, 2), (16, 2048, 512, 8, 1))):
            rng = np.random.default_rng(30 + bits)
            small = H == 256
            gate, up = (_experts(rng, E, Im, H, bits, dt) for _ in range(2))
            down = _experts(rng, E, H, Im, bits, dt)
            shared = tuple(_experts(rng, 1, n, kk, bits, dt) for n, kk in ((Im, H), (Im, H), (H, Im)))
            shared = tuple(_fn("LinearParams")(p.weight[0], p.scales[0], p.biases[0], bits=bits, group_size=64)
                           for p in shared)
            x = _rand(rng, T, H, dtype=dt)
            inds = mx.array(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
            w = mx.softmax(_rand(rng, T, k + 1), axis=-1)
            for sh in (False, True):
                tag = f"{_n(dt)} {bits}-bit{' shared' if sh else ''}"
                sp = shared if sh else None

                def run(x=x, w=w, sp=sp, g=gate, u=up, d=down, i=inds):
                    return [_fn("fused_experts")(x, g, u, d, i, w, sp, rows=(2, 2))]

                def ref(x=x, w=w, sp=sp, g=gate, u=up, d=down, inds=inds):
                    s32 = tuple(_to32(p) for p in sp) if sp else None
                    y = _cpu(_fn("moe_experts_ref"), x.astype(F32), _to32(g), _to32(u), _to32(d), inds,
                             w if sp else w[:, :k], s32)
                    return [y.astype(x.dtype)]

                if small:
                    out.append(Trial(f"mtl_moe_experts[{tag}]", run, ref, [TOL[dt]],
                                     kernels=(f"mtl_moe_gate_up_s{int(sh)}", f"mtl_moe_down_s{int(sh)}")))
                h = _rand(rng, T, H, dtype=dt)
                nw = 1 + _rand(rng, H, dtype=dt, scale=0.2)

                def run_rms(x=x, w=w, sp=sp, g=gate, u=up, d=down, i=inds, h=h, nw=nw):  # + the counter, reset
                    hs, y = _fn("fused_experts_add_rms_norm")(x, g, u, d, i, w, sp, h, nw, 1e-6, rows=(2, 2))
                    return [hs, y, _fn("arrival_counter")(d) + 0]

                def ref_rms(x=x, w=w, sp=sp, g=gate, u=up, d=down, inds=inds, h=h, nw=nw, ref=ref):
                    moe = ref(x, w, sp, g, u, d, inds)[0]
                    return list(_cpu(_fn("add_rms_norm_ref"), h, moe, nw, 1e-6)) + [mx.zeros((8,), dtype=mx.uint32)]

                out.append(Trial(f"mtl_moe_experts_add_rms[{tag} H{H}]", run_rms, ref_rms, [TOL[dt], TOL[dt], 0.0],
                                 kernels=(f"mtl_moe_gate_up_s{int(sh)}", f"mtl_moe_down_rms_s{int(sh)}")))
    # the combine step (moe/combine.py) at its examples' geometry: 9 tokens, top-8 rows of a 100-row buffer
    for dt in (BF16, F32):
        for sh in (False, True):
            rng = np.random.default_rng(27)
            y = _rand(rng, 100, 2048, dtype=dt)
            dest = mx.array(rng.permutation(100)[:72].astype(np.int32))
            w = mx.array((rng.random((9, 8 + sh)) + 0.1).astype(np.float32))
            s = _rand(rng, 9, 2048, dtype=dt) if sh else None
            out.append(Trial(
                f"mtl_moe_combine_s{int(sh)}[{_n(dt)}]",
                lambda y=y, d=dest, w=w, s=s: [_fn("combine")(y, d, w, 8, s)],
                lambda y=y, d=dest, w=w, s=s: [_cpu(_fn("combine_ref"), y, d, w, 8, s)], [TOL[dt]]))
    return out
