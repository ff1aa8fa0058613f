"""Quantized GEMV kernels (qmatmul/gemv.py) against their references; fused-op references against plain ops.

GPU tests draw fresh random shapes and data per example (odd M, K a multiple of the group size, odd N so
the last threadgroup has a row tail) over every bits x group size x activation dtype, poison the outputs
with NaN before the kernel writes, and compare with an fp32 dequantize-then-matmul reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend, selection
from mtlqwen.kernels import qmatmul
from mtlqwen.kernels.qmatmul import LinearParams, linear_ref

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# ||out - ref|| / ||ref||: fp32 accumulation everywhere, so the bound is the output dtype's rounding
TOL = {mx.float32: 1e-4, mx.bfloat16: 1.5e-2, mx.float16: 3e-3}


def make_params(rng, n, k, bits, gs, dtype) -> LinearParams:
    """Quantized on the CPU stream: the reference side never depends on the GPU back-end's own ops."""
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits, stream=mx.cpu)
    mx.eval(wq, s, b)
    return LinearParams(weight=wq, scales=s, biases=b, bits=bits, group_size=gs)


def ref32(x: mx.array, p: LinearParams) -> np.ndarray:
    """fp32 dequantize-then-matmul: the function every quantized path must compute."""
    with mx.stream(mx.cpu):
        w = mx.dequantize(p.weight, p.scales.astype(mx.float32), p.biases.astype(mx.float32),
                          group_size=p.group_size, bits=p.bits)
        return np.array(x.astype(mx.float32) @ w.T)


def swiglu_ref32(x: mx.array, gate: LinearParams, up: LinearParams) -> np.ndarray:
    """silu(x Wg^T) * (x Wu^T) from ref32's fp32 products."""
    g, u = ref32(x, gate), ref32(x, up)
    return g / (1 + np.exp(-g)) * u


def rel_err(out, ref) -> float:
    out = np.array(out.astype(mx.float32)) if isinstance(out, mx.array) else out
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


# ---------------------------------------------------------------- CPU: references and selection table
@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 9), k=st.sampled_from([64, 128, 192]), n=st.integers(1, 40),
       bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**31 - 1))
def test_fused_references_match_plain_ops(m, k, n, bits, seed):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    ps = [make_params(rng, n + i, k, bits, 64, mx.float32) for i in range(3)]
    for y, p in zip(qmatmul.linear_multi_ref(x, ps), ps):
        assert rel_err(y, ref32(x, p)) < 1e-5
    gate, up = ps[0], make_params(rng, n, k, bits, 64, mx.float32)
    g, u = ref32(x, gate), ref32(x, up)
    want = g / (1 + np.exp(-g)) * u
    assert rel_err(qmatmul.swiglu_linear_ref(x, gate, up), want) < 1e-5


def test_dispatchers_run_references_on_cpu():
    with mx.stream(mx.cpu):
        rng = np.random.default_rng(0)
        x = mx.array(rng.standard_normal((3, 128)).astype(np.float32))
        gate, up = (make_params(rng, 24, 128, 4, 32, mx.float32) for _ in range(2))
        ys = qmatmul.linear_multi(x, [gate, up])
        assert [y.shape for y in ys] == [(3, 24), (3, 24)]
        assert rel_err(ys[1], np.array(linear_ref(x, up))) < 1e-6
        assert rel_err(qmatmul.swiglu_linear(x, gate, up), np.array(qmatmul.swiglu_linear_ref(x, gate, up))) < 1e-6


def test_linear_add_rms_norm_reference_and_cpu_dispatch():
    """The fused op is a projection, the residual add and the next RMSNorm; on the CPU it runs exactly that."""
    from mtlqwen.kernels.norms import add_rms_norm_ref  # noqa: PLC0415
    with mx.stream(mx.cpu):
        rng = np.random.default_rng(1)
        x = mx.array(rng.standard_normal((3, 128)).astype(np.float32))
        p = make_params(rng, 40, 128, 4, 64, mx.float32)
        h = mx.array(rng.standard_normal((3, 40)).astype(np.float32))
        w = mx.array(rng.standard_normal(40).astype(np.float32))
        want_h, want_y = (np.array(t) for t in add_rms_norm_ref(h, linear_ref(x, p), w, 1e-6))
        for got in (qmatmul.linear_add_rms_norm_ref(x, p, h, w, 1e-6),
                    qmatmul.linear_add_rms_norm(x, p, h, w, 1e-6)):
            assert np.array_equal(np.array(got[0]), want_h) and np.array_equal(np.array(got[1]), want_y)
        hs = want_h.astype(np.float64)
        assert np.allclose(want_y, hs / np.sqrt((hs * hs).mean(-1, keepdims=True) + 1e-6) * np.array(w), rtol=1e-4)


def test_selection_table_covers_every_qmv_variant():
    for mt in (1, 2, 4, 8):
        for bits in (4, 8):
            R, U = selection.qmv_config(mt, 4096, bits)
            assert R >= 1 and U >= 1
            assert selection.qmv_config(mt, 4096, bits, swiglu=True)[0] >= 1
    assert selection.SELECT["qmv_max_rows"] <= 8  # the kernel's MT variants stop at 8


@pytest.mark.parametrize("backend_name", ["metal", "cuda"])
def test_the_tensor_core_rows_have_a_metal_fallback_row(monkeypatch, backend_name):
    """qmv_mma_min_rows picks a CUDA-only variant; on Metal SELECT["qmv_mma_metal"] decides what those rows
    run: 0 the FMA qmv kernel, 1 MLX's quantized matmul (the linear op's reference: the kernels decline)."""
    from mtlqwen.kernels.qmatmul import gemv  # noqa: PLC0415

    monkeypatch.setattr(gemv, "gpu_backend", lambda: backend_name)
    rng = np.random.default_rng(0)
    p, up = (make_params(rng, 64, 128, 4, 64, mx.bfloat16) for _ in range(2))
    x = mx.array(rng.standard_normal((6, 128)).astype(np.float32)).astype(mx.bfloat16)
    mma_from = selection.SELECT["qmv_mma_min_rows"]
    assert 0 < mma_from <= 6
    monkeypatch.setitem(selection.SELECT, "qmv_mma_metal", 1)
    to_mlx = backend_name == "metal"
    assert gemv.mma_rows_to_mlx(6) == to_mlx and not gemv.mma_rows_to_mlx(mma_from - 1)
    if to_mlx:  # declined before any launch (CPU: a launch would fail)
        assert gemv.linear_kernel(x, p) is None
        assert gemv.linear_multi_kernel(x, [p, up]) is None
        assert gemv.swiglu_linear_kernel(x, p, up) is None
    monkeypatch.setitem(selection.SELECT, "qmv_mma_metal", 0)
    assert not gemv.mma_rows_to_mlx(6)


@pytest.mark.parametrize("backend_name", ["metal", "cuda"])
def test_the_default_table_gives_one_row_to_the_fma_qmv_on_cuda(monkeypatch, backend_name):
    """The default table's rows (benchmarks/kernels_qmatmul_attn.md, "Tensor-core qmv from 2 rows"): on CUDA
    the FMA qmv (and the epilogues it carries) serves 1 row and the tensor-core qmv 2-8; on Metal, which has
    no tensor-core variant, the FMA qmv serves 1-8; past qmv_max_rows, neither."""
    from mtlqwen.kernels.qmatmul import gemv  # noqa: PLC0415

    monkeypatch.setattr(gemv, "gpu_backend", lambda: backend_name)
    served = [m for m in range(1, 10) if gemv.fma_serves(m)]
    assert served == ([1] if backend_name == "cuda" else list(range(1, 9)))


def test_tensor_core_qmv_blocking_and_the_wide_8_row_rule(monkeypatch):
    """gemv.mma_config: the table's tiles / groups / order, the LM head's wide blocking from 65536 rows, groups
    0 = 256 columns' worth; threadgroups per launch; 8 rows of a 65536+-row matrix go to MLX's GEMM only where
    the FMA qmv would serve them (not on CUDA, where the tensor-core qmv does)."""
    from mtlqwen.kernels.qmatmul import gemv  # noqa: PLC0415

    monkeypatch.setitem(selection.SELECT, "qmv_mma_tiles", 2)
    monkeypatch.setitem(selection.SELECT, "qmv_mma_groups", 2)
    monkeypatch.setitem(selection.SELECT, "qmv_mma_consecutive", 0)
    monkeypatch.setitem(selection.SELECT, "qmv_mma_wide_tiles", 4)
    assert gemv.mma_config(8, 4096, 12288, 64, 1) == (2, 2, 0)
    assert gemv.mma_config(8, 4096, 248320, 64, 0) == (4, 1, 0)
    monkeypatch.setitem(selection.SELECT, "qmv_mma_wide_tiles", 0)
    assert gemv.mma_config(8, 4096, 248320, 64, 0) == (2, 2, 0)
    monkeypatch.setitem(selection.SELECT, "qmv_mma_groups", 0)
    assert gemv.mma_config(8, 4096, 4096, 32, 0) == (2, 8, 0) and gemv.mma_config(8, 4096, 4096, 128, 0) == (2, 2, 0)
    rng = np.random.default_rng(0)
    ps = [make_params(rng, n, 64, 4, 64, mx.bfloat16) for n in (33, 32, 16)]
    # 32-row threadgroups (2 tiles): 2 + 1 + 1; SwiGLU tiles are 8 output rows: 16 a threadgroup over 33
    assert gemv.mma_blocks(ps, 0, 2) == 4 and gemv.mma_blocks(ps[:2], 1, 2) == 3 and gemv.mma_blocks(ps, 0, 1) == 6
    x = mx.zeros((8, 64), dtype=mx.bfloat16)
    assert ("RT", 8) in gemv.mma_template(x, ps[0], 1, 0, (8, 1, 1))
    for bad in ((9, 2, 0), (0, 2, 0), (2, 0, 0), (2, 2, 2)):  # tiles past the 8 SIMD groups would go unwritten
        with pytest.raises(ValueError, match="blocking"):
            gemv.mma_template(x, ps[0], 1, 0, bad)

    calls = []
    monkeypatch.setattr(gemv, "qmv", lambda x, ps, *a, **k: calls.append("qmv") or [mx.zeros((x.shape[0], ps[0].out_features))])
    monkeypatch.setattr(gemv, "_big_m", lambda x, p: calls.append("big_m") or mx.zeros((x.shape[0], p.out_features)))
    monkeypatch.setitem(selection.SELECT, "mlx_qmm_min_n_at_8_rows", 64)
    wide = make_params(rng, 64, 64, 4, 64, mx.bfloat16)
    x8 = mx.zeros((8, 64), dtype=mx.bfloat16)
    for name, want in (("metal", "big_m"), ("cuda", "qmv")):
        monkeypatch.setattr(gemv, "gpu_backend", lambda name=name: name)
        calls.clear()
        gemv.linear_kernel(x8, wide)
        assert calls == [want], name
    calls.clear()
    gemv.linear_kernel(x8[:7], wide)  # fewer than 8 rows: the qmv on any back-end
    assert calls == ["qmv"]


def test_small_k_rows_go_to_dequantize_not_mlx_qmm_on_cuda(monkeypatch):
    """CUDA, 9+ rows, K % 256 != 0: dequantize + GEMM for linear / linear_multi / swiglu (the kernels answer,
    MLX's quantized GEMM is never reached); K % 256 == 0 without the tensor-core GEMM: declined as before;
    another back-end or the row off: declined. N % 128 != 0 (small_n_dequant): dequantize + GEMM, fp32 too."""
    from mtlqwen.kernels.qmatmul import gemv  # noqa: PLC0415

    monkeypatch.setattr(gemv, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(gemv.qgemm, "available", lambda: False)
    monkeypatch.setitem(selection.SELECT, "dequant_kernel", 0)  # MLX's dequantize: runs on the CPU
    rng = np.random.default_rng(3)
    for bits, gs in ((8, 128), (4, 64)):
        p, up = (make_params(rng, 128, gs, bits, gs, mx.float32) for _ in range(2))  # N % 128 == 0: small_n apart
        x = mx.array(rng.standard_normal((9, gs)).astype(np.float32))
        w, wu = (mx.dequantize(q.weight, q.scales, q.biases, group_size=gs, bits=bits) for q in (p, up))
        np.testing.assert_allclose(np.array(gemv.linear_kernel(x, p)), np.array(x @ w.T), rtol=1e-6, atol=1e-6)
        ys = gemv.linear_multi_kernel(x, [p, up])
        np.testing.assert_allclose(np.array(ys[1]), np.array(x @ wu.T), rtol=1e-6, atol=1e-6)
        g = x @ w.T
        np.testing.assert_allclose(np.array(gemv.swiglu_linear_kernel(x, p, up)),
                                   np.array(g * mx.sigmoid(g) * (x @ wu.T)), rtol=1e-5, atol=1e-6)
    p256 = make_params(rng, 128, 256, 8, 128, mx.float32)
    x256 = mx.array(rng.standard_normal((9, 256)).astype(np.float32))
    assert gemv.linear_kernel(x256, p256) is None and gemv.swiglu_linear_kernel(x256, p256, p256) is None
    monkeypatch.setitem(selection.SELECT, "small_k_dequant", 0)
    assert gemv.linear_kernel(x, p) is None
    monkeypatch.setitem(selection.SELECT, "small_k_dequant", 1)
    # N % 128 != 0 past the qmv rows: dequantize + GEMM in fp32 too (MLX's GEMM failed to launch there)
    p96 = make_params(rng, 96, 256, 4, 128, mx.float32)
    w96 = mx.dequantize(p96.weight, p96.scales, p96.biases, group_size=128, bits=4)
    x33 = mx.array(rng.standard_normal((33, 256)).astype(np.float32))
    np.testing.assert_allclose(np.array(gemv.linear_kernel(x33, p96)), np.array(x33 @ w96.T), rtol=1e-5, atol=1e-5)
    monkeypatch.setitem(selection.SELECT, "small_n_dequant", 0)
    assert gemv.linear_kernel(x33, p96) is None
    monkeypatch.setattr(gemv, "gpu_backend", lambda: "metal")
    assert gemv.linear_kernel(x, p) is None


def test_projection_groups_dequantize_in_one_launch(monkeypatch):
    """Prefill rows (dequant_gemm_min_rows+) on the dequantize + GEMM path: linear_multi's projections dequantize
    in one stacked launch with every matrix in order, gate+up too (then one GEMM and the SwiGLU over its
    halves); outputs as the reference's. Fewer rows, mixed bits, or the row off: no stack."""
    from mtlqwen.kernels.qmatmul import dequant, gemv  # noqa: PLC0415

    calls = []

    def stack_on_cpu(ps, dtype):  # the kernel's result, computed by MLX on the CPU; records each launch
        calls.append([p.out_features for p in ps])
        return mx.concatenate([mx.dequantize(p.weight, p.scales, p.biases, group_size=p.group_size, bits=p.bits)
                               for p in ps]).astype(dtype)

    monkeypatch.setattr(gemv, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(gemv.qgemm, "available", lambda: False)
    monkeypatch.setattr(dequant, "dequantize_stack", stack_on_cpu)
    rng = np.random.default_rng(5)
    bf = mx.bfloat16
    ps = [make_params(rng, n, 256, 4, 64, bf) for n in (256, 128, 32, 32)]  # a GDN layer's four, scaled down
    gate, up = (make_params(rng, 128, 256, 4, 64, bf) for _ in range(2))
    rows = selection.SELECT["dequant_gemm_min_rows"]
    x = mx.array(rng.standard_normal((rows, 256)).astype(np.float32)).astype(bf)
    ys = gemv.linear_multi_kernel(x, ps)
    assert calls == [[256, 128, 32, 32]]
    for y, p in zip(ys, ps):
        want = x @ p.dequantized().T
        assert y.shape == (rows, p.out_features)
        np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=2e-2, atol=2e-2)
    y = gemv.swiglu_linear_kernel(x, gate, up)
    assert calls[1:] == [[128, 128]] and y.shape == (rows, 128)
    g, u = ((x @ q.dequantized().T).astype(mx.float32) for q in (gate, up))
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(g * mx.sigmoid(g) * u), rtol=3e-2, atol=3e-2)
    calls.clear()
    # dequantize + GEMM per matrix, no stack: one row fewer (MLX's GEMM: declined), mixed bits, the row off
    assert gemv.linear_multi_kernel(x[:rows - 1], ps) is None and gemv.swiglu_linear_kernel(x[:rows - 1], gate, up) is None
    mixed = [ps[0], make_params(rng, 128, 256, 8, 64, bf)]
    assert gemv.linear_multi_kernel(x, mixed) is None
    monkeypatch.setitem(selection.SELECT, "dequant_stack", 0)
    assert gemv.linear_multi_kernel(x, ps) is None and gemv.swiglu_linear_kernel(x, gate, up) is None
    assert calls == []


# ---------------------------------------------------------------- GPU: kernels against references
def _poisoned(npair: int | None = None):
    """The qmatmul module with outputs poisoned; npair sets the 4-bit nibble-pair unpack for this example."""
    from mtlqwen.kernels.qmatmul import gemv  # noqa: PLC0415  (GPU module)
    gemv.POISON = float("nan")
    if npair is not None:
        selection.SELECT["qmv_nibble_pairs"] = npair
    return gemv


@pytest.fixture(autouse=True)
def _restore_selection():
    """The rows an example set (npair) go back to the table's values after the test."""
    saved = dict(selection.SELECT)
    yield
    selection.SELECT.update(saved)


shape = dict(
    m=st.sampled_from([1, 2, 3, 4, 5, 7, 8]), kg=st.integers(1, 12), n=st.integers(1, 70),
    bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2**31 - 1),
)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(40), **GPU_SETTINGS)
@given(**shape, pf=st.sampled_from([0, 1]), npair=st.sampled_from([0, 1]))
def test_qmv_matches_reference(m, kg, n, bits, gs, dtype, seed, pf, npair):
    qm = _poisoned(npair)
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    k = kg * gs
    p = make_params(rng, 2 * n + 1, k, bits, gs, dt)  # odd N: a row tail in the last threadgroup
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dt)
    # the FMA kernel, also at M=8 where the dispatcher prefers MLX; with and without the weight prefetch
    y = qm.qmv(x, [p], mma=False, cfg=(*selection.qmv_config(qm.row_bucket(m), k, bits, N=2 * n + 1), pf))[0]
    assert y.shape == (m, 2 * n + 1) and y.dtype == dt
    assert rel_err(y, ref32(x, p)) < TOL[dt]
    if dt == mx.float32:  # MLX's own CPU qmm accumulates 16-bit inputs loosely (~3e-2 seen): fp32 only
        with mx.stream(mx.cpu):
            want = np.array(linear_ref(x, p).astype(mx.float32))
        assert rel_err(y, want) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(20), **GPU_SETTINGS)
@given(**shape, nproj=st.integers(2, 4), npair=st.sampled_from([0, 1]))
def test_linear_multi_and_swiglu_match_reference(m, kg, n, bits, gs, dtype, seed, nproj, npair):
    qm = _poisoned(npair)
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    k = kg * gs
    ps = [make_params(rng, n + 7 * i, k, bits, gs, dt) for i in range(nproj)]  # unequal N per projection
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dt)
    ys = qm.qmv(x, ps, mma=False)
    assert len(ys) == nproj
    for y, p in zip(ys, ps):
        assert rel_err(y, ref32(x, p)) < TOL[dt]
    up = make_params(rng, n, k, bits, gs, dt)
    y = qm.qmv(x, [ps[0], up], epi=1, mma=False)[0]
    g, u = ref32(x, ps[0]), ref32(x, up)
    assert rel_err(y, g / (1 + np.exp(-g)) * u) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(10), **GPU_SETTINGS)
@given(m=st.sampled_from([9, 15, 17, 33, 300]), bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]),
       kg=st.sampled_from([1, 2, 4]), dtype=st.sampled_from(["bfloat16", "float32"]), seed=st.integers(0, 2**31 - 1))
def test_linear_large_m_paths(m, bits, gs, kg, dtype, seed):
    """Rows past the GEMV: the tensor-core GEMM, MLX's GEMM, or dequantize + GEMM, per the selection table;
    K of one group a row included (the MoE dispatch test's shared expert failed there)."""
    _poisoned()
    from mtlqwen.kernels.qmatmul import linear, swiglu_linear  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul.reference import swiglu_linear_ref  # noqa: PLC0415
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    p, up = (make_params(rng, 96, kg * gs, bits, gs, dt) for _ in range(2))
    x = mx.array(rng.standard_normal((m, kg * gs)).astype(np.float32)).astype(dt)
    assert rel_err(linear(x, p), ref32(x, p)) < TOL[dt]
    with mx.stream(mx.cpu):
        x32 = x.astype(mx.float32)
        to32 = [LinearParams(q.weight, q.scales.astype(mx.float32), q.biases.astype(mx.float32), bits, gs) for q in (p, up)]
        want = np.array(swiglu_linear_ref(x32, *to32))
    assert rel_err(swiglu_linear(x, p, up), want) < 2 * TOL[dt]


def _add_norm32(h, delta, w, eps):
    """fp32 reference of the residual epilogue, with the dtype roundings the kernel and add_rms_norm keep."""
    dt = h.dtype
    with mx.stream(mx.cpu):
        hs = (h.astype(mx.float32) + mx.array(delta).astype(dt).astype(mx.float32)).astype(dt).astype(mx.float32)
        y = hs * mx.rsqrt(mx.mean(hs * hs, axis=-1, keepdims=True) + eps) * w.astype(mx.float32)
        return np.array(hs), np.array(y)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**shape, layers=st.integers(1, 3), pf=st.sampled_from([0, 1]), npair=st.sampled_from([0, 1]),
       chunk=st.sampled_from([0, 1, 8]))
def test_qmv_residual_norm_matches_reference(m, kg, n, bits, gs, dtype, seed, layers, pf, npair, chunk):
    """qmv + residual add + RMSNorm epilogue (qmatmul/residual.py): `layers` dependent launches on one counter
    per projection in one graph, each against the fp32 reference from the previous launch's outputs; the
    counters are back at zero after the graph ran (the last threadgroup resets them). chunk 1 / 8: the two-pass
    epilogue, 1 or 8 columns a pass (8: the default where it divides a thread's columns)."""
    _poisoned(npair)
    selection.SELECT["qmv_residual_chunk"] = chunk  # put back by _restore_selection
    from mtlqwen.kernels.qmatmul import residual as qmv_residual  # noqa: PLC0415  (GPU module)
    dt = DTYPES[dtype]
    _check_residual_chain(lambda x, p, hh, w: qmv_residual.qmv_add_rms(x, p, hh, w, 1e-6, pf=pf),
                          np.random.default_rng(seed), m, kg * gs, 2 * n + 1, bits, gs, dt, layers)


def _check_residual_chain(launch, rng, m: int, k: int, N: int, bits: int, gs: int, dt, layers: int):
    """`layers` dependent residual-epilogue launches (launch(x, p, h, w) -> (h', y)) on one counter per
    projection in one graph, each against the fp32 reference from the previous launch's outputs; the
    counters back at zero after the graph ran. N odd: the last threadgroup has a row tail."""
    from mtlqwen.kernels.qmatmul import residual as qmv_residual  # noqa: PLC0415  (GPU module)

    ps = [make_params(rng, N, k, bits, gs, dt) for _ in range(layers)]
    w = mx.array(1.0 + 0.1 * rng.standard_normal(N).astype(np.float32)).astype(dt)
    h = mx.array(rng.standard_normal((m, N)).astype(np.float32)).astype(dt)
    xs = [mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dt) for _ in range(layers)]
    outs, hh = [], h
    for x, p in zip(xs, ps):  # the normed output is not fed on (its K differs); the residual is
        hh, y = launch(x, p, hh, w)
        outs += [hh, y]
    mx.eval(outs)
    hh = h
    for i, (x, p) in enumerate(zip(xs, ps)):
        want_h, want_y = _add_norm32(hh, ref32(x, p), w, 1e-6)
        assert outs[2 * i].shape == (m, N) and outs[2 * i].dtype == dt
        assert rel_err(outs[2 * i], want_h) < TOL[dt]
        assert rel_err(outs[2 * i + 1], want_y) < TOL[dt]
        hh = outs[2 * i]  # the next launch's residual is what this one wrote
    for p in ps:
        assert int(qmv_residual.arrival_counter(p)[0].item()) == 0


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(24), **GPU_SETTINGS)
@given(m=st.integers(1, 8), kg=st.integers(1, 12), n=st.integers(1, 300), gs=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(["bfloat16", "float16"]), seed=st.integers(0, 2**31 - 1), layers=st.integers(1, 3),
       chunk=st.sampled_from([0, 1, 8]), cfg=st.sampled_from([None, (1, 4, 0), (2, 2, 1), (4, 2, 1), (3, 1, 0)]))
def test_qmv_mma_residual_norm_matches_reference(m, kg, n, gs, dtype, seed, layers, chunk, cfg):
    """The tensor-core qmv with the residual + RMSNorm epilogue (residual.qmv_mma_add_rms, 256-lane
    threadgroups): `layers` dependent launches, each against the fp32 reference from the previous launch's
    outputs, over odd N (a row tail, threadgroups past N under RT tiles); counters back at zero."""
    _poisoned()
    if backend.gpu_backend() != "cuda":
        pytest.skip("the mma variant is CUDA-only")
    selection.SELECT["qmv_residual_chunk"] = chunk  # put back by _restore_selection
    from mtlqwen.kernels.qmatmul import residual as qmv_residual  # noqa: PLC0415  (GPU module)
    _check_residual_chain(lambda x, p, hh, w: qmv_residual.qmv_mma_add_rms(x, p, hh, w, 1e-6, cfg=cfg),
                          np.random.default_rng(seed), m, kg * gs, 2 * n + 1, 4, gs, DTYPES[dtype], layers)


@pytest.mark.gpu
@needs_gpu
def test_mma_residual_norm_serves_the_tensor_core_rows():
    """The op's dispatch with qmv_mma_residual_norm on: 5..8 rows of 4-bit bf16 take the tensor-core
    epilogue (the FMA one serves fewer), both equal to the reference's add + norm of the projection."""
    _poisoned()
    if backend.gpu_backend() != "cuda":
        pytest.skip("the mma variant is CUDA-only")
    from mtlqwen.kernels.qmatmul import residual as qmv_residual  # noqa: PLC0415  (GPU module)
    from mtlqwen.kernels.qmatmul.ops import linear_add_rms_norm  # noqa: PLC0415
    rng = np.random.default_rng(3)
    dt = mx.bfloat16
    p = make_params(rng, 300, 512, 4, 64, dt)
    w = mx.array(1.0 + 0.1 * rng.standard_normal(300).astype(np.float32)).astype(dt)
    selection.SELECT.update(qmv_residual_norm=1, qmv_mma_residual_norm=1, qmv_mma_min_rows=5)
    for m in (4, 5, 8):
        x = mx.array(rng.standard_normal((m, 512)).astype(np.float32)).astype(dt)
        h = mx.array(rng.standard_normal((m, 300)).astype(np.float32)).astype(dt)
        assert qmv_residual.covers(x, p, h) == (m < 5)
        assert qmv_residual.mma_covers(x, p, h) == (m >= 5)
        hs, y = linear_add_rms_norm(x, p, h, w, 1e-6)
        want_h, want_y = _add_norm32(h, ref32(x, p), w, 1e-6)
        assert rel_err(hs, want_h) < TOL[dt] and rel_err(y, want_y) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(24), **GPU_SETTINGS)
@given(m=st.integers(1, 8), kg=st.integers(1, 12), n=st.integers(1, 70), gs=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(["bfloat16", "float16"]), nproj=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       cfg=st.sampled_from([None, (1, 4, 0), (1, 1, 1), (2, 2, 1), (2, 3, 0), (4, 2, 1), (4, 1, 0), (3, 2, 0)]))
def test_qmv_mma_matches_reference(m, kg, n, gs, dtype, nproj, seed, cfg):
    """The CUDA tensor-core variant (4-bit, 16-bit activations): plain, several projections, SwiGLU; under
    the table's blocking (None) and drawn (RT, UG, CG) ones: tiles past N, passes past the last group."""
    qm = _poisoned()
    if backend.gpu_backend() != "cuda":
        pytest.skip("the mma variant is CUDA-only")
    dt = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    k = kg * gs
    ps = [make_params(rng, 2 * n + 1 + 5 * i, k, 4, gs, dt) for i in range(nproj)]
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dt)
    for y, p in zip(qm.qmv(x, ps, cfg=cfg, mma=True), ps):
        assert y.shape == (m, p.out_features) and y.dtype == dt
        assert rel_err(y, ref32(x, p)) < TOL[dt]
    up = make_params(rng, 2 * n + 1, k, 4, gs, dt)
    y = qm.qmv(x, [ps[0], up], epi=1, cfg=cfg, mma=True)[0]
    g, u = ref32(x, ps[0]), ref32(x, up)
    assert rel_err(y, g / (1 + np.exp(-g)) * u) < TOL[dt]
