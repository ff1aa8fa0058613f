"""qgemm's split-K reduce launch (qmatmul/splitk.py) against the MLX ops it replaces: the sum over splits and
the cast per output, and the SwiGLU epilogue. Outputs start as NaN (the emulator's bytes, `init_value` on the
GPU), so every element must be written. Metal emulator on the CPU; the CUDA rendering on a GPU (skipped on
the CPU); qgemm with the row on against the row off on a GPU."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend
from mtlqwen.kernels.qmatmul import splitk

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu

DT = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
TOL = {mx.float32: 1e-6, mx.float16: 1e-3, mx.bfloat16: 8e-3}  # max |err| / max |ref|: one output rounding

shapes = dict(S=st.sampled_from([2, 3, 4, 8]), M=st.integers(1, 40), P=st.integers(1, 4), epi=st.integers(0, 1),
              ns=st.lists(st.integers(1, 300), min_size=4, max_size=4), seed=st.integers(0, 2**31 - 1),
              dtype=st.sampled_from(sorted(DT)))


def case(S, M, P, epi, ns, seed):
    rng = np.random.default_rng(seed)
    widths = [2 * ns[0]] if epi else ns[:P]
    return [mx.array(rng.standard_normal((S, M, n)).astype(np.float32)) for n in widths]


def reference(parts, epi, dt):
    with mx.stream(mx.cpu):
        if epi:
            s = mx.sum(parts[0], axis=0)
            g, u = mx.split(s, 2, axis=1)
            return [np.array((g * mx.sigmoid(g) * u).astype(dt).astype(mx.float32))]
        return [np.array(mx.sum(p, axis=0).astype(dt).astype(mx.float32)) for p in parts]


def check(got, want, dt):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.array(g.astype(mx.float32))
        assert g.shape == w.shape and np.isfinite(g).all()
        assert np.max(np.abs(g - w)) <= TOL[dt] * max(np.max(np.abs(w)), 1e-6)


def test_covers():
    p = mx.zeros((2, 5, 8))
    assert splitk.covers([p], 0) and splitk.covers([p] * 4, 0) and splitk.covers([p], 1)
    assert not splitk.covers([p] * 5, 0) and not splitk.covers([p, p], 1) and not splitk.covers([mx.zeros((2, 5, 7))], 1)
    assert not splitk.covers([p, mx.zeros((2, 6, 8))], 0) and not splitk.covers([p.astype(mx.bfloat16)], 0)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=8, deadline=None, database=None)
@given(**shapes)
def test_reduce_metal_emulated(S, M, P, epi, ns, seed, dtype):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    dt, parts = DT[dtype], case(S, M, P, epi, ns, seed)
    want = reference(parts, epi, dt)
    with metal_emulator.emulating() as launches:  # outputs start as NaN bytes there
        got = splitk.reduce("metal", parts, epi, dt)
        mx.eval(got)
    assert [ln.kernel for ln in launches] == [f"mtl_splitk_reduce_p{1 if epi else P}_e{epi}"]
    check(got, want, dt)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**shapes)
def test_reduce_matches_reference(S, M, P, epi, ns, seed, dtype):
    dt, parts = DT[dtype], case(S, M, P, epi, ns, seed)
    got = splitk.reduce(backend.gpu_backend(), parts, epi, dt, init_value=float("nan"))
    check(got, reference(parts, epi, dt), dt)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(12), **GPU_SETTINGS)
@given(M=st.integers(9, 40), epi=st.integers(0, 1), P=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_qgemm_with_the_reduce_launch_equals_the_mlx_reduction(M, epi, P, seed):
    """CUDA: a split qgemm call (1-4 of the 9B's 4096 x 4096 projections of one x, or gate|up for SwiGLU) with the
    row on == with it off (the same partials; the reductions' orders differ, so up to one output rounding)."""
    from mtlqwen.kernels.qmatmul import qgemm  # noqa: PLC0415
    from mtlqwen.kernels.selection import selected  # noqa: PLC0415
    from test_kernels_qmatmul import make_params  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    ps = [make_params(rng, 4096, 4096, 4, 64, mx.bfloat16) for _ in range(2 if epi else P)]
    x = mx.array(rng.standard_normal((M, 4096)).astype(np.float32)).astype(mx.bfloat16)
    cfg = (*qgemm.config(M, 4096, 4096, 4, epi)[:5], 4)  # force 4 splits
    with selected({"qgemm_reduce_kernel": 0}):
        want = [np.array(y.astype(mx.float32)) for y in qgemm.qgemm(x, ps, epi, cfg)]
    with selected({"qgemm_reduce_kernel": 1}):
        got = qgemm.qgemm(x, ps, epi, cfg)
    check(got, want, mx.bfloat16)
