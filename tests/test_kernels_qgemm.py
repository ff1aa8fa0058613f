"""The tensor-core quantized GEMM (qgemm.py) against an fp32 dequantize-then-matmul reference.

GPU tests (CUDA only: on Metal and the CPU these sizes run MLX's quantized_matmul) draw fresh shapes and
data per example: M over 1..1100 with the tile and split boundaries, K a multiple of 256 (the kernel's
stage alignment), odd N so the last block has a row tail, 4/8-bit, groups 32/64/128, bf16/fp16, several
projections and SwiGLU, random block configurations and split-K factors; outputs are NaN-poisoned first.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend, selection
from mtlqwen.kernels.qmatmul import linear

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu
from test_kernels_qmatmul import DTYPES, TOL, make_params, ref32, rel_err, swiglu_ref32


def test_config_table_is_launchable():
    """Every M the table sends to the kernel gets a configuration whose shared memory fits an H200 SM."""
    from mtlqwen.kernels.qmatmul import qgemm  # noqa: PLC0415

    for M in range(9, selection.SELECT["qgemm_max_rows"] + 1, 7):
        for N, K in ((32, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (248320, 4096)):
            for bits in (4, 8):
                for epi in (0, 1):
                    RT, TT, WN, WM, ST, split = qgemm.config(M, N, K, bits, epi)
                    assert (RT == 2) if epi == 1 else RT in (1, 2)
                    assert ST >= 2 and split >= 1 and K // 128 // split >= 1
                    assert ST * qgemm.stage_bytes(bits, RT, TT, WN, WM) <= 227 * 1024
                    assert 8 * TT * WM >= min(M, 64)  # one block row of tokens covers small M


def test_supported_shapes():
    from mtlqwen.kernels.qmatmul import qgemm  # noqa: PLC0415

    rng = np.random.default_rng(0)
    p = make_params(rng, 40, 512, 4, 64, mx.bfloat16)
    x = mx.zeros((20, 512), dtype=mx.bfloat16)
    assert qgemm.supported(x, [p])
    assert not qgemm.supported(x.astype(mx.float32), [p])          # fp32 x: MLX's path
    q = make_params(rng, 40, 384, 4, 64, mx.bfloat16)               # K % 256 != 0
    assert not qgemm.supported(mx.zeros((20, 384), dtype=mx.bfloat16), [q])
    assert not qgemm.supported(x, [p, make_params(rng, 40, 512, 8, 64, mx.bfloat16)])  # mixed bits


def test_cpu_linear_unchanged_past_qmv_rows():
    """On the CPU the dispatcher runs the reference whatever M (the kernel is CUDA-only)."""
    rng = np.random.default_rng(1)
    p = make_params(rng, 24, 256, 4, 64, mx.float32)
    x = mx.array(rng.standard_normal((37, 256)).astype(np.float32))
    if backend.gpu_backend() is None:
        assert rel_err(linear(x, p), ref32(x, p)) < 1e-4


def _cuda_qgemm():
    from mtlqwen.kernels.qmatmul import qgemm  # noqa: PLC0415  (GPU module)

    if backend.gpu_backend() != "cuda":
        pytest.skip("the tensor-core GEMM is CUDA-only (Metal runs MLX's quantized_matmul)")
    qgemm.POISON = float("nan")
    return qgemm


m_values = st.one_of(st.sampled_from([9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511,
                                      512, 513, 1023, 1024, 1100]), st.integers(1, 1100))
cfgs = st.tuples(st.sampled_from([1, 2]), st.sampled_from([2, 4, 8]), st.sampled_from([2, 4]),
                 st.sampled_from([1, 2]), st.sampled_from([2, 3, 4]), st.sampled_from([1, 2, 3, 5]))


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(40), **GPU_SETTINGS)
@given(m=m_values, kq=st.integers(1, 6), n=st.integers(1, 160), bits=st.sampled_from([4, 8]),
       gs=st.sampled_from([32, 64, 128]), dtype=st.sampled_from(["bfloat16", "float16"]),
       nproj=st.integers(1, 3), cfg=st.one_of(st.none(), cfgs), seed=st.integers(0, 2**31 - 1))
def test_qgemm_matches_reference(m, kq, n, bits, gs, dtype, nproj, cfg, seed):
    qg = _cuda_qgemm()
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    k = 256 * kq
    ps = [make_params(rng, 2 * n + 1 + 7 * i, k, bits, gs, dt) for i in range(nproj)]
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dt)
    ys = qg.qgemm(x, ps, cfg=cfg)
    for y, p in zip(ys, ps):
        assert y.shape == (m, p.out_features) and y.dtype == dt
        assert rel_err(y, ref32(x, p)) < TOL[dt], (cfg, p.out_features)
    up = make_params(rng, 2 * n + 1, k, bits, gs, dt)
    scfg = None if cfg is None else (2,) + cfg[1:]
    y = qg.qgemm(x, [ps[0], up], epi=1, cfg=scfg)[0]
    assert y.shape == (m, ps[0].out_features)
    assert rel_err(y, swiglu_ref32(x, ps[0], up)) < TOL[dt], scfg


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(12), **GPU_SETTINGS)
@given(m=st.sampled_from([9, 17, 64, 200, 1024]), n=st.sampled_from([32, 1024, 4096, 12288]),
       bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**31 - 1))
def test_linear_dispatch_through_qgemm(m, n, bits, seed):
    """The model's entry points (linear, linear_multi, swiglu_linear) at 9B-like K, through the table."""
    _cuda_qgemm()
    from mtlqwen.kernels import qmatmul as linear_fused  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    k = 4096
    ps = [make_params(rng, n, k, bits, 64, mx.bfloat16), make_params(rng, 1024, k, bits, 64, mx.bfloat16)]
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(mx.bfloat16)
    assert rel_err(linear(x, ps[0]), ref32(x, ps[0])) < TOL[mx.bfloat16]
    for y, p in zip(linear_fused.linear_multi(x, ps), ps):
        assert rel_err(y, ref32(x, p)) < TOL[mx.bfloat16]
    up = make_params(rng, n, k, bits, 64, mx.bfloat16)
    g, u = ref32(x, ps[0]), ref32(x, up)
    y = linear_fused.swiglu_linear(x, ps[0], up)
    assert rel_err(y, g / (1 + np.exp(-g)) * u) < TOL[mx.bfloat16]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(20), **GPU_SETTINGS)
@given(n=st.integers(1, 300), kg=st.integers(1, 12), bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]), seed=st.integers(0, 2**31 - 1))
def test_dequantize_kernel_matches_mlx(n, kg, bits, gs, dtype, seed):
    """The dequantize kernel against s*q + b computed exactly (float64 from the unpacked words): one rounding
    of the exact value. (mx.dequantize, the reference twin, rounds s*q before adding b in 16-bit types, so
    against it the bound is two roundings of |s*q| + |b|.)"""
    from mtlqwen.kernels.qmatmul import dequant  # noqa: PLC0415

    dequant.POISON = float("nan")
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    k = kg * gs
    p = make_params(rng, n, k, bits, gs, dt)
    got = np.array(dequant.dequantize(p, dt).astype(mx.float32)).astype(np.float64)
    words = np.array(p.weight).astype(np.uint64)                      # [n, k*bits/32]
    epw = 32 // bits
    col = np.arange(k)
    q = (words[:, col // epw] >> ((col % epw) * bits).astype(np.uint64)) & ((1 << bits) - 1)
    sc = np.repeat(np.array(p.scales.astype(mx.float32)).astype(np.float64), gs, axis=1)
    bi = np.repeat(np.array(p.biases.astype(mx.float32)).astype(np.float64), gs, axis=1)
    exact = sc * q + bi
    assert got.shape == (n, k) and np.isfinite(got).all()
    half_ulp = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 2.0**-24}[dt]
    assert np.all(np.abs(got - exact) <= 1.01 * half_ulp * np.abs(exact) + 1e-30), np.abs(got - exact).max()
    with mx.stream(mx.cpu):
        twin = np.array(mx.dequantize(p.weight, p.scales, p.biases, group_size=gs, bits=bits).astype(mx.float32))
    assert np.all(np.abs(got - twin) <= 4 * half_ulp * (np.abs(sc * q) + np.abs(bi)) + 1e-30)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(16), **GPU_SETTINGS)
@given(ns=st.lists(st.integers(1, 300), min_size=1, max_size=4), kg=st.integers(1, 12), bits=st.sampled_from([4, 8]),
       gs=st.sampled_from([32, 64, 128]), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       seed=st.integers(0, 2**31 - 1))
def test_dequantize_stack_is_the_matrices_stacked(ns, kg, bits, gs, dtype, seed):
    """One launch over 1-4 matrices of different heights (outputs poisoned): bit for bit the single-matrix
    kernel's outputs stacked by rows, which the test above holds to one rounding of s*q + b."""
    from mtlqwen.kernels.qmatmul import dequant  # noqa: PLC0415

    dequant.POISON = float("nan")
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    ps = [make_params(rng, n, kg * gs, bits, gs, dt) for n in ns]
    got = np.array(dequant.dequantize_stack(ps, dt).astype(mx.float32))
    want = np.concatenate([np.array(dequant.dequantize(p, dt).astype(mx.float32)) for p in ps])
    assert got.shape == (sum(ns), kg * gs) and np.isfinite(got).all()
    assert np.array_equal(got, want)


def test_small_n_split_picks_the_small_projections(monkeypatch):
    """Past qgemm's rows, up to qgemm_small_n_rows: the projections of at most 128 outputs among several go
    to one qgemm launch, the others keep their path (exact indices; CPU, qgemm's availability faked)."""
    from mtlqwen.kernels.qmatmul import gemv, qgemm  # noqa: PLC0415

    monkeypatch.setattr(qgemm, "available", lambda: True)
    monkeypatch.setitem(selection.SELECT, "qgemm_small_n_rows", 1024)
    rng = np.random.default_rng(2)
    ps = [make_params(rng, n, 512, 4, 64, mx.bfloat16) for n in (384, 256, 32, 128)]
    x = mx.zeros((512, 512), dtype=mx.bfloat16)
    assert gemv.small_n_split(x, ps) == ([2, 3], [0, 1])
    assert gemv.small_n_split(x, [ps[2], ps[0], ps[3]]) == ([0, 2], [1])
    assert gemv.small_n_split(x, ps[2:]) == ([0, 1], [])                     # all small: one launch for all
    assert gemv.small_n_split(x, ps[:2]) is None                             # none small
    assert gemv.small_n_split(x, ps[2:3]) is None                            # a single projection: linear's
    assert gemv.small_n_split(mx.zeros((128, 512), dtype=mx.bfloat16), ps) is None   # qgemm's own rows
    assert gemv.small_n_split(mx.zeros((1025, 512), dtype=mx.bfloat16), ps) is None  # past the row
    assert gemv.small_n_split(x.astype(mx.float32), ps) is None              # a dtype qgemm does not take
    monkeypatch.setitem(selection.SELECT, "qgemm_small_n_rows", 0)
    assert gemv.small_n_split(x, ps) is None


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(8), **GPU_SETTINGS)
@given(m=st.sampled_from([129, 300, 512, 1024]), seed=st.integers(0, 2**31 - 1))
def test_small_n_projections_past_qgemm_rows(m, seed):
    """A GDN layer's four projections past qgemm's rows with the row on: b and a through one qgemm launch,
    qkv and z through dequantize + GEMM, each output against the reference."""
    _cuda_qgemm()
    from mtlqwen.kernels import qmatmul as linear_fused  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul import gemv  # noqa: PLC0415

    saved = selection.SELECT["qgemm_small_n_rows"]
    selection.SELECT["qgemm_small_n_rows"] = 1024
    try:
        rng = np.random.default_rng(seed)
        ps = [make_params(rng, n, 4096, 4, 64, mx.bfloat16) for n in (1024, 512, 32, 32)]
        x = mx.array(rng.standard_normal((m, 4096)).astype(np.float32)).astype(mx.bfloat16)
        assert gemv.small_n_split(x, ps) == ([2, 3], [0, 1])
        for y, p in zip(linear_fused.linear_multi(x, ps), ps):
            assert y.shape == (m, p.out_features)
            assert rel_err(y, ref32(x, p)) < TOL[mx.bfloat16]
    finally:
        selection.SELECT["qgemm_small_n_rows"] = saved
