"""MoE routing and expert kernels (kernels/moe) against their references.

CPU: the routing reference against a brute-force top-k softmax; the grouped-by-expert (sorted) path
against the reference; the kernels' Metal renderings on the emulator (check_metal's) against an fp32
reference. GPU: the kernels and every dispatcher path against the fp32 reference, outputs poisoned with
NaN before the kernels write. Random expert counts, top-k, tokens per expert including none and every
token on the same experts, the shared expert on and off, 4 / 8 bits, groups of 32 / 64 / 128, odd T.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend, selection
from mtlqwen.kernels.moe import (moe_experts, moe_experts_add_rms_norm, moe_experts_ref, moe_experts_sorted, moe_route,
                                 moe_route_ref)
from mtlqwen.kernels.moe.reference import moe_route_exact_ref
from mtlqwen.kernels.norms.reference import add_rms_norm_ref
from mtlqwen.kernels.qmatmul import LinearParams

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu

TOL = {mx.float32: 1e-4, mx.bfloat16: 2e-2}  # ||out - ref|| / ||ref||: the output dtype's rounding
CPU_SETTINGS = dict(deadline=None, max_examples=12, database=None)


def rel_err(out, ref) -> float:
    out = np.array(out.astype(mx.float32)) if isinstance(out, mx.array) else out
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def quantized(rng, shape, bits, gs, dtype) -> LinearParams:
    """Random weights of `shape` ([E, N, K] or [N, K]) quantized on the CPU stream, scales in dtype."""
    w = mx.array(rng.standard_normal(shape).astype(np.float32) * 0.05)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits, stream=mx.cpu)
    return LinearParams(wq, s.astype(dtype), b.astype(dtype), bits, gs)


def to32(p: LinearParams) -> LinearParams:
    return LinearParams(p.weight, p.scales.astype(mx.float32), p.biases.astype(mx.float32), p.bits, p.group_size)


def routing(rng, T, E, k, spread):
    """inds [T, k] int32 (distinct experts per token) and weights [T, k + 1] fp32. spread "one": every
    token on experts 0..k-1 (one expert takes all T tokens); "random": a fresh draw per token (with E > T*k
    some experts get none)."""
    if spread == "one":
        inds = np.tile(np.arange(k), (T, 1))
    else:
        inds = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    w = rng.random((T, k + 1)).astype(np.float32) + 0.1
    w[:, :k] /= w[:, :k].sum(-1, keepdims=True)
    return mx.array(inds.astype(np.int32)), mx.array(w)


def moe_case(seed, T, E, k, H, Im, bits, gs, dtype, shared, spread):
    rng = np.random.default_rng(seed)
    gate, up = (quantized(rng, (E, Im, H), bits, gs, dtype) for _ in range(2))
    down = quantized(rng, (E, H, Im), bits, gs, dtype)
    sh = (quantized(rng, (Im, H), bits, gs, dtype), quantized(rng, (Im, H), bits, gs, dtype),
          quantized(rng, (H, Im), bits, gs, dtype)) if shared else None
    x = mx.array(rng.standard_normal((T, H)).astype(np.float32)).astype(dtype)
    inds, w = routing(rng, T, E, k, spread)
    return x, gate, up, down, inds, w if shared else w[:, :k], sh


def ref32(x, gate, up, down, inds, w, sh) -> np.ndarray:
    """The reference on the CPU in fp32 (scales and activations fp32)."""
    with mx.stream(mx.cpu):
        s32 = tuple(to32(p) for p in sh) if sh else None
        return np.array(moe_experts_ref(x.astype(mx.float32), to32(gate), to32(up), to32(down), inds, w, s32))


def residual_case(seed, T, H, dtype):
    """The residual stream h [T, H] and the next norm's weight w [H] for the add + norm epilogue."""
    rng = np.random.default_rng(seed + 7)
    h = mx.array(rng.standard_normal((T, H)).astype(np.float32)).astype(dtype)
    w = mx.array((1 + 0.2 * rng.standard_normal(H)).astype(np.float32)).astype(dtype)
    return h, w


def add_norm_ref32(case, h, w, eps=1e-6):
    """(h + moe, rms_norm(h + moe) * w) in fp32 from the fp32 reference's MoE output rounded to x's dtype,
    as the kernel stores its delta before the add."""
    moe = mx.array(ref32(*case)).astype(case[0].dtype)
    with mx.stream(mx.cpu):
        hs, y = add_rms_norm_ref(h.astype(mx.float32), moe.astype(mx.float32), w.astype(mx.float32), eps)
    return np.array(hs), np.array(y)


def router_case(seed, T, E, H, bits, dtype, shared):
    """x [T, H], the router [E, H] and the shared gate [1, H] (or None), quantized g64."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((T, H)).astype(np.float32)).astype(dtype)
    return x, quantized(rng, (E, H), bits, 64, dtype), quantized(rng, (1, H), bits, 64, dtype) if shared else None


def check_router_launch(outs, x, router, sg, k, renorm):
    """The launch's logits against fp32 (relative), and its routing exactly the reference's on those logits
    (bf16 logits can tie: the picked logits are compared position by position, not the ids)."""
    from mtlqwen.kernels.qmatmul.reference import linear_ref  # noqa: PLC0415

    logits, sgl = outs[0], (outs[1] if sg is not None else None)
    inds, w = outs[-2], outs[-1]
    with mx.stream(mx.cpu):
        want = np.array(linear_ref(x.astype(mx.float32), to32(router)))
        ri, rw = moe_route_ref(logits, k, renorm, sgl)
        if sg is not None:
            assert rel_err(sgl, np.array(linear_ref(x.astype(mx.float32), to32(sg)))) < TOL[x.dtype]
    assert rel_err(logits, want) < TOL[x.dtype]
    lg32 = np.array(logits.astype(mx.float32))
    np.testing.assert_array_equal(np.take_along_axis(lg32, np.array(inds), -1), np.take_along_axis(lg32, np.array(ri), -1))
    assert all(len(set(r)) == k for r in np.array(inds).tolist())
    np.testing.assert_allclose(np.array(w), np.array(rw), rtol=1e-5, atol=1e-6)


router_shape = dict(T=st.sampled_from([1, 2, 3, 5, 8]), E=st.sampled_from([8, 60, 256]), k=st.integers(1, 10),
                    hg=st.integers(1, 4), bits=st.sampled_from([4, 8]), shared=st.booleans(), renorm=st.booleans(),
                    seed=st.integers(0, 2**31 - 1))


moe_shape = dict(
    T=st.sampled_from([1, 2, 3, 5, 7, 8]), E=st.integers(1, 24), k=st.integers(1, 8), hg=st.integers(1, 3),
    img=st.integers(1, 3), bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]),
    shared=st.booleans(), spread=st.sampled_from(["random", "one"]), seed=st.integers(0, 2**31 - 1),
)


# ---------------------------------------------------------------- CPU: the references
@settings(**CPU_SETTINGS)
@given(T=st.integers(1, 9), E=st.integers(1, 300), k=st.integers(1, 10), renorm=st.booleans(), shared=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_route_reference_is_the_top_k_softmax(T, E, k, renorm, shared, seed):
    k = min(k, E)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    sg = rng.standard_normal((T, 1)).astype(np.float32)
    inds, w = moe_route_ref(mx.array(logits), k, renorm, mx.array(sg) if shared else None)
    assert inds.dtype == mx.int32 and inds.shape == (T, k) and w.shape == (T, k + shared)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.argsort(-p, axis=-1, kind="stable")[:, :k]  # decreasing probability
    np.testing.assert_array_equal(np.array(inds), want)
    pw = np.take_along_axis(p, want, -1)
    if renorm:
        pw /= pw.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.array(w[:, :k]), pw, rtol=1e-5, atol=1e-7)
    if shared:
        np.testing.assert_allclose(np.array(w[:, k]), 1 / (1 + np.exp(-sg[:, 0])), rtol=1e-5)


@settings(**CPU_SETTINGS)
@given(**moe_shape)
def test_sorted_path_matches_reference(T, E, k, hg, img, bits, gs, shared, spread, seed):
    """Pairs grouped by expert (sorted ids, gather_qmm sorted_indices) = the unsorted reference, fp32."""
    k = min(k, E)
    T = T * 5  # prefill-like row counts, odd ones included
    case = moe_case(seed, T, E, k, hg * gs, img * gs, bits, gs, mx.float32, shared, spread)
    with mx.stream(mx.cpu):
        got = moe_experts_sorted(*case)
    assert got.shape == (T, hg * gs)
    assert rel_err(got, ref32(*case)) < 1e-5


@pytest.mark.skipif(backend.use_kernels(), reason="the GPU back-end runs the kernels (the GPU tests below)")
def test_moe_experts_op_runs_the_reference_on_cpu():
    case = moe_case(1, 3, 6, 2, 64, 64, 4, 64, mx.float32, True, "random")
    np.testing.assert_array_equal(np.array(moe_experts(*case)), np.array(moe_experts_ref(*case)))


def test_route_refuses_what_the_kernel_does_not_cover():
    from mtlqwen.kernels.moe import kernels  # noqa: PLC0415

    lg = mx.zeros((2, 8))
    assert kernels.route(lg, 9) is None  # k > E
    assert kernels.route(mx.zeros((2, 2048)), 8) is None  # E > 1024
    assert kernels.route(lg, 2, shared_logit=mx.zeros((3, 1))) is None  # shared logit of other rows


def test_router_route_runs_the_projection_then_the_routing_on_cpu():
    from mtlqwen.kernels.moe import moe_router_route  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul.reference import linear_ref  # noqa: PLC0415

    x, rt, sg = router_case(1, 3, 60, 128, 8, mx.float32, True)
    inds, w = moe_router_route(x, rt, sg, 8, True)
    ri, rw = moe_route_ref(linear_ref(x, rt), 8, True, linear_ref(x, sg))
    np.testing.assert_array_equal(np.array(inds), np.array(ri))
    np.testing.assert_array_equal(np.array(w), np.array(rw))


def test_router_route_kernel_covers_decode_sizes_only(monkeypatch):
    from mtlqwen.kernels.moe import router  # noqa: PLC0415

    monkeypatch.setattr(router, "gpu_backend", lambda: "cuda")
    x, rt, sg = router_case(0, 8, 256, 128, 8, mx.bfloat16, True)
    assert router.supported(x, rt, sg, 8) and router.supported(x, rt, None, 8)
    assert not router.supported(mx.concatenate([x, x]), rt, sg, 8)  # 16 rows: past the qmv
    assert not router.supported(x, rt, sg, 17)  # top-k past the routing kernel's
    _, _, sg4 = router_case(0, 8, 256, 128, 4, mx.bfloat16, True)
    assert not router.supported(x, rt, sg4, 8)  # router and shared gate quantized apart: not one qmv
    with selection.selected({"moe_route_in_router": 0}):
        assert not router.supported(x, rt, sg, 8)
    monkeypatch.setattr(router, "gpu_backend", lambda: None)
    assert not router.supported(x, rt, sg, 8)


def test_moe_add_norm_runs_the_experts_then_the_norm_on_cpu():
    """On the CPU the op is the composition it replaces in the model: moe_experts, then add_rms_norm."""
    case = moe_case(3, 5, 8, 2, 128, 64, 4, 64, mx.float32, True, "random")
    h, w = residual_case(3, 5, 128, mx.float32)
    hs, y = moe_experts_add_rms_norm(*case, h, w, 1e-6)
    rh, ry = add_rms_norm_ref(h, moe_experts_ref(*case), w, 1e-6)
    np.testing.assert_array_equal(np.array(hs), np.array(rh))
    np.testing.assert_array_equal(np.array(y), np.array(ry))


def test_moe_add_norm_kernel_covers_decode_sizes_only():
    """The fused epilogue serves where the fused expert kernels do, with a residual of x's shape and dtype,
    the shared expert fusable, and the residual-norm row on."""
    from mtlqwen.kernels.moe import kernels  # noqa: PLC0415

    x, gate, up, down, inds, w, sh = moe_case(0, 4, 8, 2, 128, 64, 4, 64, mx.bfloat16, True, "random")
    h, nw = residual_case(0, 4, 128, mx.bfloat16)
    ok = kernels.fused_add_norm_supported
    with selection.selected({"qmv_residual_norm": 1, "moe_fused_max_tokens": 8}):
        assert ok(x, gate, up, down, inds, sh, h, nw) and ok(x, gate, up, down, inds, None, h, nw)
        assert not ok(x, gate, up, down, inds, sh, h.astype(mx.float32), nw)  # residual of another dtype
        assert not ok(x, gate, up, down, inds, sh, h[:3], nw)  # another shape
        sh8 = (sh[0], sh[1], LinearParams(sh[2].weight, sh[2].scales, sh[2].biases, 8, 64))
        assert not ok(x, gate, up, down, inds, sh8, h, nw)  # a shared expert that cannot ride as a slot
    with selection.selected({"qmv_residual_norm": 1, "moe_fused_max_tokens": 3}):
        assert not ok(x, gate, up, down, inds, sh, h, nw)  # 4 tokens: past the fused kernels
    with selection.selected({"qmv_residual_norm": 0, "moe_fused_max_tokens": 8}):
        assert not ok(x, gate, up, down, inds, sh, h, nw)


# ---------------------------------------------------------------- CPU: the Metal renderings, emulated
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")


@needs_gxx
@settings(deadline=None, max_examples=6, database=None)
@given(**moe_shape, dtype=st.sampled_from(["float32", "bfloat16"]))
def test_fused_experts_metal_emulated(T, E, k, hg, img, bits, gs, shared, spread, seed, dtype):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.moe import kernels  # noqa: PLC0415

    k = min(k, E)
    dt = getattr(mx, dtype)
    case = moe_case(seed, T, E, k, hg * gs, img * gs, bits, gs, dt, shared, spread)
    with metal_emulator.emulating() as launches:  # outputs start as NaN bytes there
        got = kernels.fused_experts(*case)
    assert {ln.kernel for ln in launches} == {f"mtl_moe_gate_up_s{int(shared)}", f"mtl_moe_down_s{int(shared)}"}
    assert rel_err(got, ref32(*case)) < TOL[dt]


@needs_gxx
@settings(deadline=None, max_examples=4, database=None)
@given(**moe_shape, dtype=st.sampled_from(["float32", "bfloat16"]))
def test_fused_experts_add_rms_norm_metal_emulated(T, E, k, hg, img, bits, gs, shared, spread, seed, dtype):
    """The down launch with the residual add + norm epilogue: both outputs, and its arrival counter back
    at zero (the last threadgroup resets it for the next launch)."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.moe import kernels  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul.residual import arrival_counter  # noqa: PLC0415

    k = min(k, E)
    dt = getattr(mx, dtype)
    case = moe_case(seed, T, E, k, hg * gs, img * gs, bits, gs, dt, shared, spread)
    h, w = residual_case(seed, T, hg * gs, dt)
    with metal_emulator.emulating() as launches:
        hs, y = kernels.fused_experts_add_rms_norm(*case, h, w, 1e-6)
        cnt = arrival_counter(case[3]) + 0
    assert [ln.kernel for ln in launches] == [f"mtl_moe_gate_up_s{int(shared)}", f"mtl_moe_down_rms_s{int(shared)}"]
    rh, ry = add_norm_ref32(case, h, w)
    assert rel_err(hs, rh) < TOL[dt] and rel_err(y, ry) < TOL[dt]
    assert np.array(cnt).tolist() == [0] * 8


@needs_gxx
@settings(deadline=None, max_examples=4, database=None)
@given(**router_shape, dtype=st.sampled_from(["float32", "bfloat16"]))
def test_router_route_metal_emulated(T, E, k, hg, bits, shared, renorm, seed, dtype):
    """The router projection with the routing in its last threadgroup (moe/router.py), and its arrival
    counter back at zero."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.moe import router  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul.residual import arrival_counter  # noqa: PLC0415

    k = min(k, E)
    x, rt, sg = router_case(seed, T, E, 64 * hg, bits, getattr(mx, dtype), shared)
    with metal_emulator.emulating() as launches:
        outs = router.launch(x, rt, sg, k, renorm)
        cnt = arrival_counter(rt) + 0
    assert [ln.kernel for ln in launches] == [f"mtl_moe_router_route_s{int(shared)}"]
    check_router_launch(outs, x, rt, sg, k, renorm)
    assert np.array(cnt).tolist() == [0] * 8


@needs_gxx
@settings(deadline=None, max_examples=4, database=None)
@given(T=st.sampled_from([1, 3, 8]), E=st.sampled_from([8, 60, 256, 512]), k=st.integers(1, 10),
       renorm=st.booleans(), shared=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_route_metal_emulated(T, E, k, renorm, shared, seed):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.moe import kernels  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    lg = mx.array(rng.standard_normal((T, E)).astype(np.float32))
    sg = mx.array(rng.standard_normal((T, 1)).astype(np.float32)) if shared else None
    if k > E:  # more experts asked than exist: not the kernel's (the op's reference then refuses it)
        assert kernels.route(lg, k, renorm, sg) is None
        with pytest.raises(ValueError, match=f"needs 1 <= k <= experts, got k={k} for {E} experts"):
            moe_route_ref(lg, k, renorm, sg)
        return
    with metal_emulator.emulating():
        inds, w = kernels.route(lg, k, renorm, sg)
    ri, rw = moe_route_ref(lg, k, renorm, sg)
    np.testing.assert_array_equal(np.array(inds), np.array(ri))
    np.testing.assert_allclose(np.array(w), np.array(rw), rtol=1e-5, atol=1e-7)
    # bf16 logits tie: the kernel takes the lower id first, as the self-checks' exact reference does
    lb = lg.astype(mx.bfloat16)
    with metal_emulator.emulating():
        inds, w = kernels.route(lb, k, renorm, sg)
    ei, ew = moe_route_exact_ref(lb, k, renorm, sg)
    np.testing.assert_array_equal(np.array(inds), np.array(ei))
    np.testing.assert_allclose(np.array(w), np.array(ew), rtol=1e-5, atol=1e-7)


def test_exact_route_reference_orders_equal_logits_by_lower_id():
    lg = mx.array([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0, 5.0, 0.0]])
    inds, w = moe_route_exact_ref(lg, 4, True, None)
    assert np.array(inds).tolist() == [[1, 2, 4, 3], [4, 0, 1, 2]]
    np.testing.assert_allclose(np.array(w).sum(-1), [1.0, 1.0], rtol=1e-6)
    rng = np.random.default_rng(4)  # no ties: the same routing as moe_route_ref
    lg = mx.array(rng.standard_normal((5, 60)).astype(np.float32))
    sg = mx.array(rng.standard_normal((5, 1)).astype(np.float32))
    for a, b in zip(moe_route_exact_ref(lg, 8, False, sg), moe_route_ref(lg, 8, False, sg)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)


@needs_gxx
@pytest.mark.parametrize("T, path", [(1, "fused"), (8, "fused"), (9, "reference"), (40, "sorted")])
def test_expert_paths_by_token_count_emulated(T, path):
    """The table's rows pick the path for T (k = 4: 9 tokens = 36 pairs, under moe_sort_min_pairs); a shared
    expert of another width beside the fused kernels runs on the dense ops. fp32: MLX's CPU quantized matmul
    is inexact with bf16 inputs (test_gpu_model.py)."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.moe import ops  # noqa: PLC0415

    x, gate, up, down, inds, w, _ = moe_case(T, T, 16, 4, 128, 64, 4, 64, mx.float32, True, "random")
    rng = np.random.default_rng(T)
    sh = (quantized(rng, (96, 128), 8, 64, mx.float32), quantized(rng, (96, 128), 8, 64, mx.float32),
          quantized(rng, (128, 96), 8, 32, mx.float32))
    assert selection.SELECT["moe_fused_max_tokens"] == 8 and selection.SELECT["moe_sort_min_pairs"] == 64
    with metal_emulator.emulating() as launches:
        got = ops._experts_gpu(x, gate, up, down, inds, w, sh)
    moe = sorted({ln.kernel for ln in launches if "moe" in ln.kernel})
    assert moe == (["mtl_moe_down_s0", "mtl_moe_gate_up_s0"] if path == "fused" else [])
    if path == "reference":  # not covered: the dispatcher runs the reference
        assert got is None
    else:
        assert rel_err(got, ref32(x, gate, up, down, inds, w, sh)) < 1e-4


# ---------------------------------------------------------------- GPU: kernels and dispatchers
def poisoning(module):
    """Yields `module` with its kernels' outputs starting as NaN (module.POISON); the selection rows an
    example changes are restored after."""
    saved = dict(selection.SELECT)
    module.POISON = float("nan")
    yield module
    module.POISON = None
    selection.SELECT.update(saved)


@pytest.fixture
def poisoned():
    from mtlqwen.kernels.moe import kernels  # noqa: PLC0415

    yield from poisoning(kernels)


@pytest.fixture
def poisoned_router():
    from mtlqwen.kernels.moe import router  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul import gemv  # noqa: PLC0415

    for _ in poisoning(gemv):  # the router's launch starts its outputs from gemv.POISON
        yield router


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(40), **GPU_SETTINGS)
@given(T=st.integers(1, 40), E=st.sampled_from([1, 8, 33, 128, 256, 512]), k=st.integers(1, 10),
       renorm=st.booleans(), shared=st.booleans(), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 2**31 - 1))
def test_route_kernel_matches_reference(poisoned, T, E, k, renorm, shared, dtype, seed):
    k = min(k, E)
    rng = np.random.default_rng(seed)
    lg = mx.array(rng.standard_normal((T, E)).astype(np.float32)).astype(getattr(mx, dtype))
    sg = mx.array(rng.standard_normal((T, 1)).astype(np.float32)).astype(lg.dtype) if shared else None
    inds, w = poisoned.route(lg, k, renorm, sg)
    with mx.stream(mx.cpu):
        ri, rw = moe_route_ref(lg, k, renorm, sg)
    assert np.isfinite(np.array(w)).all()
    # bf16 logits can tie: compare the picked logits (and weights) position by position, not the ids
    lg32 = np.array(lg.astype(mx.float32))
    np.testing.assert_array_equal(np.take_along_axis(lg32, np.array(inds), -1), np.take_along_axis(lg32, np.array(ri), -1))
    assert (np.array(inds) >= 0).all() and (np.array(inds) < E).all()
    assert all(len(set(r)) == k for r in np.array(inds).tolist())  # k distinct experts per token
    np.testing.assert_allclose(np.array(w), np.array(rw), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(40), **GPU_SETTINGS)
@given(**moe_shape, dtype=st.sampled_from(["float32", "bfloat16"]), rows=st.sampled_from([(2, 2), (1, 1), (2, 4)]))
def test_fused_experts_match_reference(poisoned, T, E, k, hg, img, bits, gs, shared, spread, seed, dtype, rows):
    k = min(k, E)
    dt = getattr(mx, dtype)
    case = moe_case(seed, T, E, k, hg * gs, img * gs, bits, gs, dt, shared, spread)
    got = poisoned.fused_experts(*case, rows=rows)
    assert got.shape == (T, hg * gs) and got.dtype == dt
    assert rel_err(got, ref32(*case)) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**moe_shape, dtype=st.sampled_from(["float32", "bfloat16"]), rows=st.sampled_from([(2, 2), (1, 1), (2, 4)]),
       launches=st.integers(1, 3))
def test_fused_experts_add_rms_norm_match_reference(poisoned, T, E, k, hg, img, bits, gs, shared, spread, seed, dtype,
                                                    rows, launches):
    """`launches` dependent launches on one down weight (one arrival counter), each residual the previous
    launch's output, as a decoder's layers would; the counter at zero after each."""
    from mtlqwen.kernels.qmatmul.residual import arrival_counter  # noqa: PLC0415

    k = min(k, E)
    dt = getattr(mx, dtype)
    case = moe_case(seed, T, E, k, hg * gs, img * gs, bits, gs, dt, shared, spread)
    h, w = residual_case(seed, T, hg * gs, dt)
    for _ in range(launches):
        hs, y = poisoned.fused_experts_add_rms_norm(*case, h, w, 1e-6, rows=rows)
        assert hs.shape == y.shape == (T, hg * gs) and hs.dtype == y.dtype == dt
        rh, ry = add_norm_ref32(case, h, w)
        assert rel_err(hs, rh) < TOL[dt] and rel_err(y, ry) < TOL[dt]
        assert np.array(arrival_counter(case[3])).tolist() == [0] * 8
        h = hs


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(20), **GPU_SETTINGS)
@given(T=st.sampled_from([1, 4, 8, 9, 13, 40, 101]), E=st.sampled_from([4, 16, 64]), k=st.integers(1, 8),
       bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]), shared=st.booleans(),
       spread=st.sampled_from(["random", "one"]), seed=st.integers(0, 2**31 - 1))
def test_moe_experts_dispatch_matches_reference(poisoned, T, E, k, bits, gs, shared, spread, seed):
    """Whatever path the table picks for T (fused kernels, unsorted gather_qmm, sorted), bf16 activations."""
    from mtlqwen.kernels import dispatch  # noqa: PLC0415

    k = min(k, E)
    case = moe_case(seed, T, E, k, 2 * gs, gs, bits, gs, mx.bfloat16, shared, spread)
    got = moe_experts(*case)
    assert dispatch.OPS["moe_experts"].failed is None
    assert rel_err(got, ref32(*case)) < TOL[mx.bfloat16]
    with selection.selected({"moe_sort_min_pairs": 1, "moe_fused_max_tokens": 0}):  # the sorted path at any T
        assert rel_err(moe_experts(*case), ref32(*case)) < TOL[mx.bfloat16]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**router_shape, dtype=st.sampled_from(["float32", "bfloat16"]), launches=st.integers(1, 3))
def test_router_route_matches_reference(poisoned_router, T, E, k, hg, bits, shared, renorm, seed, dtype, launches):
    """`launches` launches on one router (one arrival counter): each routes, and leaves the counter at zero."""
    from mtlqwen.kernels.qmatmul.residual import arrival_counter  # noqa: PLC0415

    k = min(k, E)
    x, rt, sg = router_case(seed, T, E, 64 * hg, bits, getattr(mx, dtype), shared)
    for i in range(launches):
        xi = x if i == 0 else (x * (1.0 + 0.5 * i)).astype(x.dtype)
        check_router_launch(poisoned_router.launch(xi, rt, sg, k, renorm), xi, rt, sg, k, renorm)
        assert np.array(arrival_counter(rt)).tolist() == [0] * 8


@pytest.mark.gpu
@needs_gpu
def test_moe_route_dispatch_serves_the_kernel(poisoned):
    from mtlqwen.kernels import dispatch  # noqa: PLC0415

    lg = mx.array(np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32))
    inds, w = moe_route(lg, 8, True, lg[:, :1])
    assert dispatch.kernel_for("moe_route") is not None and dispatch.OPS["moe_route"].failed is None
    ri, rw = moe_route_ref(lg, 8, True, lg[:, :1])
    np.testing.assert_array_equal(np.array(inds), np.array(ri))
    np.testing.assert_allclose(np.array(w), np.array(rw), rtol=1e-5)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(8), **GPU_SETTINGS)
@given(T=st.sampled_from([1, 3, 8]), seed=st.integers(0, 2**31 - 1))
def test_shared_expert_of_other_quantization_runs_beside_the_fused_kernels(poisoned, T, seed):
    """An 8-bit shared expert beside 4-bit experts (or Is != Im) cannot ride as a slot: the fused kernels
    take the routed experts, the shared expert runs on the dense ops."""
    x, gate, up, down, inds, w, _ = moe_case(seed, T, 16, 4, 128, 64, 4, 64, mx.bfloat16, True, "random")
    rng = np.random.default_rng(seed + 1)
    sh = (quantized(rng, (96, 128), 8, 64, mx.bfloat16), quantized(rng, (96, 128), 8, 64, mx.bfloat16),
          quantized(rng, (128, 96), 8, 32, mx.bfloat16))
    assert not poisoned.shared_fusable(sh, gate, x) and poisoned.fused_supported(x, gate, up, down, inds)
    got = moe_experts(x, gate, up, down, inds, w, sh)
    assert rel_err(got, ref32(x, gate, up, down, inds, w, sh)) < TOL[mx.bfloat16]
