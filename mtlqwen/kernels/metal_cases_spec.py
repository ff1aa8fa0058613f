"""check_metal --run's trials of the speculative step's launch cuts (kernels/metal_cases.py collects them):
qgemm's split-K reduce (qmatmul/splitk.py) for 1-4 outputs and SwiGLU, and the in-place candidates commit
(gdn/commit.py), at the registered examples' template values, against MLX ops on the CPU."""

from __future__ import annotations

import numpy as np

import mlx.core as mx

from .metal_cases import BF16, F32, Trial, _cpu, _n, _rand


def _reduce_ref(parts, epi, dt):
    def f():
        if epi:
            g, u = mx.split(mx.sum(parts[0], axis=0), 2, axis=1)
            return [(g * mx.sigmoid(g) * u).astype(dt)]
        return [mx.sum(p, axis=0).astype(dt) for p in parts]
    return _cpu(f)


def _splitk_trials() -> list[Trial]:
    from .qmatmul import splitk  # noqa: PLC0415

    out = []
    tol = {BF16: 1e-2, mx.float16: 2e-3}
    for (P, epi) in splitk.REDUCE:
        for dt in (BF16, mx.float16):  # the examples' output dtypes
            rng = np.random.default_rng(40 + P + 10 * epi)
            parts = [_rand(rng, 4, 9, n) for n in ([2 * 37] if epi else [37, 16, 5, 3][:P])]
            out.append(Trial(f"mtl_splitk_reduce_p{P}_e{epi}[{_n(dt)}]",
                             lambda parts=parts, epi=epi, dt=dt: list(splitk.reduce("metal", parts, epi, dt)),
                             lambda parts=parts, epi=epi, dt=dt: _reduce_ref(parts, epi, dt), [tol[dt]] * len(parts)))
    return out


def _commit_trials() -> list[Trial]:
    """Two verifications of 3 rows (k = 0: old conv rows survive; k = 2: all drafts) into slots 3 and 1 of 5, the
    examples' geometry; outputs: the pools after the launch (every row: the others must stay)."""
    from .gdn.commit import pick_inplace  # noqa: PLC0415

    out = []
    for dt in (BF16, F32):
        rng = np.random.default_rng(45)
        Hv, d, C, K1 = 4, 16, 96, 3
        rec, conv = _rand(rng, 5, Hv, d, d), _rand(rng, 5, K1, C, dtype=dt)
        cand, raw = _rand(rng, 6, Hv, d, d), _rand(rng, 6, C, dtype=dt)
        k, starts, slots = (mx.array(v, dtype=mx.int32) for v in ([0, 2], [0, 3], [3, 1]))
        mx.eval(rec, conv, cand, raw)

        def run(rec=rec, conv=conv, cand=cand, raw=raw, k=k, starts=starts, slots=slots):
            r, c = rec + 0, conv + 0  # fresh buffers: the kernel writes them in place
            mx.eval(r, c)
            done = pick_inplace(r, c, cand, raw, k, starts, slots, backend="metal")
            mx.eval(done)
            return [r, c]

        def ref(rec=rec, conv=conv, cand=cand, raw=raw):
            r, c = np.array(rec), np.array(conv.astype(F32))
            r[[3, 1]] = np.array(cand)[[0, 5]]
            c[3] = c[3][1:].tolist() + [np.array(raw.astype(F32))[0].tolist()]  # k = 0: slot 3's own rows shift
            c[1] = np.array(raw.astype(F32))[3:6]
            return [mx.array(r), mx.array(c).astype(conv.dtype)]

        out.append(Trial(f"gdn_commit_inplace[{_n(dt)}]", run, ref, [0.0, 0.0]))
    return out


def spec_trials() -> list[Trial]:
    return _splitk_trials() + _commit_trials()
