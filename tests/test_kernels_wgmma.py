"""qgemm's warpgroup-MMA form (qmatmul/wgmma.py) against an fp32 dequantize-then-matmul reference.

GPU tests (CUDA on compute capability 9 only: elsewhere qgemm's mma.sync form or MLX's quantized_matmul
serves) draw fresh shapes and data per example: M over 1..300 with the token-tile boundaries (16 / 32 / 64),
K a multiple of 256, odd N so the last block has a row tail, 4-bit, groups 32/64/128, bf16/fp16, 1-4
projections and SwiGLU, random tile configurations and split-K factors; outputs are NaN-poisoned first.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend, selection
from mtlqwen.kernels.qmatmul import wgmma

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu
from test_kernels_qmatmul import DTYPES, TOL, make_params, ref32, rel_err, swiglu_ref32


def test_config_table_is_launchable():
    """Every M qgemm takes gets a configuration whose shared memory fits an H200 SM, whose token tile holds
    M up to 64 rows, and whose split leaves each split a K step."""
    for M in range(9, selection.SELECT["qgemm_max_rows"] + 1, 5):
        for N, K in ((32, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (248320, 4096)):
            for epi in (0, 1):
                RT, NB, ST, split, NBUF, WG = wgmma.config(M, N, K, epi)
                assert RT == 2 and NB in wgmma.NBS and split >= 1 and K // 128 // split >= 1
                assert (WG, ST) == ((2, 3) if NB == 64 else (1, 2))
                assert ST >= 2 and NBUF in (2, 3, 4)
                assert NB >= min(M, 64) and (NB == 16 or NB // 2 < M)   # the smallest tile that holds M
                assert WG in (1, 2) and ST * wgmma.stage_bytes(RT * WG, NB) <= 227 * 1024


def test_not_taken_off_hopper():
    """Without CUDA (this CPU run, Metal) the form never takes a call, whatever the row says."""
    rng = np.random.default_rng(0)
    p = make_params(rng, 40, 512, 4, 64, mx.bfloat16)
    x = mx.zeros((20, 512), dtype=mx.bfloat16)
    if backend.gpu_backend() != "cuda":
        saved = selection.SELECT["qgemm_wgmma_min_rows"]
        selection.SELECT["qgemm_wgmma_min_rows"] = 1
        try:
            assert not wgmma.takes(x, [p])
        finally:
            selection.SELECT["qgemm_wgmma_min_rows"] = saved


def _cuda_wgmma():
    from mtlqwen.kernels.qmatmul import qgemm  # noqa: PLC0415

    if not wgmma.available():
        pytest.skip("the warpgroup-MMA GEMM needs CUDA on compute capability 9 (an H100 / H200)")
    qgemm.POISON = float("nan")
    return wgmma


m_values = st.one_of(st.sampled_from([1, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 300]),
                     st.integers(1, 300))
cfgs = st.tuples(st.sampled_from([1, 2]), st.sampled_from([16, 32, 64]), st.sampled_from([2, 3, 4]),
                 st.sampled_from([1, 2, 3, 5]), st.sampled_from([2, 4]), st.sampled_from([1, 2]))


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(40), **GPU_SETTINGS)
@given(m=m_values, kq=st.integers(1, 6), n=st.integers(1, 160), gs=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(["bfloat16", "float16"]), nproj=st.integers(1, 4), cfg=st.one_of(st.none(), cfgs),
       seed=st.integers(0, 2**31 - 1))
def test_wgmma_matches_reference(m, kq, n, gs, dtype, nproj, cfg, seed):
    wg = _cuda_wgmma()
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    k = 256 * kq
    if cfg is not None and cfg[2] * wg.stage_bytes(cfg[0] * cfg[5], cfg[1]) > 227 * 1024:
        cfg = (cfg[0], cfg[1], 2) + cfg[3:]
    ps = [make_params(rng, 2 * n + 1 + 7 * i, k, 4, gs, dt) for i in range(nproj)]
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dt)
    ys = wg.qgemm_wg(x, ps, cfg=cfg)
    for y, p in zip(ys, ps):
        assert y.shape == (m, p.out_features) and y.dtype == dt
        assert rel_err(y, ref32(x, p)) < TOL[dt], (cfg, p.out_features)
    up = make_params(rng, 2 * n + 1, k, 4, gs, dt)
    scfg = None if cfg is None else (2,) + cfg[1:]
    if scfg is not None and scfg[2] * wg.stage_bytes(2 * scfg[5], scfg[1]) > 227 * 1024:
        scfg = (2, scfg[1], 2) + scfg[3:]
    y = wg.qgemm_wg(x, [ps[0], up], epi=1, cfg=scfg)[0]
    assert y.shape == (m, ps[0].out_features)
    assert rel_err(y, swiglu_ref32(x, ps[0], up)) < TOL[dt], scfg


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(12), **GPU_SETTINGS)
@given(m=st.sampled_from([9, 17, 33, 64, 100, 128]), n=st.sampled_from([32, 1024, 4096, 12288]),
       seed=st.integers(0, 2**31 - 1))
def test_linear_dispatch_through_wgmma(m, n, seed):
    """With the row on from 9 rows, the model's entry points (linear, linear_multi with four projections,
    swiglu_linear) at 9B-like K reach the form and match the reference."""
    _cuda_wgmma()
    from mtlqwen.kernels import qmatmul as linear_fused  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul import linear  # noqa: PLC0415

    saved = selection.SELECT["qgemm_wgmma_min_rows"]
    selection.SELECT["qgemm_wgmma_min_rows"] = 9
    try:
        rng = np.random.default_rng(seed)
        k = 4096
        ps = [make_params(rng, nn, k, 4, 64, mx.bfloat16) for nn in (n, 1024, 32, 32)]
        x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(mx.bfloat16)
        assert wgmma.takes(x, ps)
        assert rel_err(linear(x, ps[0]), ref32(x, ps[0])) < TOL[mx.bfloat16]
        for y, p in zip(linear_fused.linear_multi(x, ps), ps):
            assert rel_err(y, ref32(x, p)) < TOL[mx.bfloat16]
        up = make_params(rng, n, k, 4, 64, mx.bfloat16)
        assert rel_err(linear_fused.swiglu_linear(x, ps[0], up), swiglu_ref32(x, ps[0], up)) < TOL[mx.bfloat16]
    finally:
        selection.SELECT["qgemm_wgmma_min_rows"] = saved


def test_tc_gemm_routes_by_rows_and_bits(monkeypatch):
    """The table's rule on any machine (the device check faked): from qgemm_wgmma_min_rows rows, 4-bit
    projections take the warpgroup form; fewer rows, 8-bit ones, or the row at 0 keep qgemm's mma.sync."""
    from mtlqwen.kernels.qmatmul import gemv, qgemm  # noqa: PLC0415

    calls = []
    monkeypatch.setattr(wgmma, "available", lambda: True)
    monkeypatch.setattr(wgmma, "qgemm_wg", lambda x, ps, epi=0: calls.append(("wgmma", x.shape[0], epi)) or [])
    monkeypatch.setattr(qgemm, "qgemm", lambda x, ps, epi=0: calls.append(("mma.sync", x.shape[0], epi)) or [])
    monkeypatch.setitem(selection.SELECT, "qgemm_wgmma_min_rows", 33)
    rng = np.random.default_rng(3)
    p4 = [make_params(rng, 40, 512, 4, 64, mx.bfloat16) for _ in range(2)]
    p8 = [make_params(rng, 40, 512, 8, 64, mx.bfloat16)]
    for M, ps, epi in ((32, p4, 0), (33, p4, 0), (128, p4, 1), (64, p8, 0)):
        gemv.tc_gemm(mx.zeros((M, 512), dtype=mx.bfloat16), ps, epi)
    monkeypatch.setitem(selection.SELECT, "qgemm_wgmma_min_rows", 0)
    gemv.tc_gemm(mx.zeros((64, 512), dtype=mx.bfloat16), p4)
    assert calls == [("mma.sync", 32, 0), ("wgmma", 33, 0), ("wgmma", 128, 1), ("mma.sync", 64, 0),
                     ("mma.sync", 64, 0)]
