"""The MoE combine step (kernels/moe/combine.py) against its reference (moe/reference.py combine_ref).

CPU: the reference against a NumPy loop over the pairs; the op serves the reference. Metal emulator and
GPU: the kernel over random T (odd, one token), hidden sizes off the 256-column threadgroup, top-k, buffers
whose rows are read by several pairs or by none, the shared term on and off, bf16 / fp32; outputs start as
NaN (the emulator's, `init_value` on the GPU), so every element must be written.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels.moe import combine as combine_launch
from mtlqwen.kernels.moe.ops import moe_combine
from mtlqwen.kernels.moe.reference import combine_ref

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu

TOL = {mx.float32: 1e-5, mx.bfloat16: 1e-2}  # ||out - ref|| / ||ref||: the output dtype's rounding


def case(T, H, k, R, shared, dtype, seed, distinct):
    """y [R, H], dest [T*k] (distinct rows: a permutation's prefix; else any rows, repeats allowed),
    weights [T, k (+1)] fp32, the shared rows or None."""
    rng = np.random.default_rng(seed)
    y = mx.array(rng.standard_normal((R, H)).astype(np.float32)).astype(dtype)
    rows = rng.permutation(R)[: T * k] if distinct else rng.integers(0, R, T * k)
    w = mx.array((rng.random((T, k + shared)) + 0.1).astype(np.float32))
    s = mx.array(rng.standard_normal((T, H)).astype(np.float32)).astype(dtype) if shared else None
    return y, mx.array(rows.astype(np.int32)), w, k, s


def numpy_combine(y, dest, w, k, s):
    y32, w32 = np.array(y.astype(mx.float32)), np.array(w)
    d = np.array(dest)
    T = w32.shape[0]
    out = np.zeros((T, y32.shape[1]), np.float32)
    for t in range(T):
        for j in range(k):
            out[t] += w32[t, j] * y32[d[t * k + j]]
        if s is not None:
            out[t] += w32[t, k] * np.array(s.astype(mx.float32))[t]
    return out


def case_and_ref(T, H, k, extra, shared, distinct, seed, dtype):
    """A drawn case in dtype (named) and its reference on the CPU in fp32."""
    dt = getattr(mx, dtype)
    c = case(T, H, k, T * k + extra, shared, dt, seed, distinct)
    with mx.stream(mx.cpu):
        return dt, c, np.array(combine_ref(*c).astype(mx.float32))


def rel_err(out, ref) -> float:
    out = np.array(out.astype(mx.float32))
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


shapes = dict(T=st.sampled_from([1, 2, 7, 33]), H=st.sampled_from([64, 200, 256, 300, 2048]),
              k=st.sampled_from([1, 2, 8]), extra=st.integers(0, 40), shared=st.booleans(),
              distinct=st.booleans(), seed=st.integers(0, 2**31 - 1))


@settings(max_examples=10, deadline=None, database=None)
@given(**shapes)
def test_reference_is_the_weighted_sum_of_each_pairs_row(T, H, k, extra, shared, distinct, seed):
    c = case(T, H, k, T * k + extra, shared, mx.float32, seed, distinct)
    with mx.stream(mx.cpu):
        assert rel_err(combine_ref(*c), numpy_combine(*c)) < 1e-6
        assert mx.array_equal(moe_combine(*c), combine_ref(*c)).item()  # the CPU serves the reference


def test_covers_refuses_what_the_kernel_does_not_take():
    y, dest, w, k, s = case(3, 64, 2, 10, True, mx.float32, 0, True)
    ok = combine_launch.covers
    assert not ok(y, dest.astype(mx.uint32), w, k, s)          # indices int32 only
    assert not ok(y, dest, w.astype(mx.bfloat16), k, s)        # fp32 weights only
    assert not ok(y, dest, w[:, :k], k, s)                     # a shared term needs its weight column
    assert not ok(y, dest[:-1], w, k, s)                       # one row per (token, slot)
    assert not ok(y, dest, w, k, s.astype(mx.bfloat16))        # the shared rows in y's dtype


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=6, deadline=None, database=None)
@given(**shapes, dtype=st.sampled_from(["float32", "bfloat16"]))
def test_combine_metal_emulated(T, H, k, extra, shared, distinct, seed, dtype):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    dt, c, ref = case_and_ref(T, H, k, extra, shared, distinct, seed, dtype)
    with metal_emulator.emulating() as launches:  # outputs start as NaN bytes there
        out = combine_launch.combine(*c)
        mx.eval(out)
    assert [ln.kernel for ln in launches] == [f"mtl_moe_combine_s{int(shared)}"]
    assert rel_err(out, ref) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**shapes, dtype=st.sampled_from(["float32", "bfloat16"]))
def test_combine_matches_reference(T, H, k, extra, shared, distinct, seed, dtype):
    dt, c, ref = case_and_ref(T, H, k, extra, shared, distinct, seed, dtype)
    assert combine_launch.covers(*c)
    out = combine_launch.combine(*c, init_value=float("nan"))
    assert rel_err(out, ref) < TOL[dt]
