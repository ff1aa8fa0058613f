"""The MoE experts grouped by expert on the tensor-core GEMM (kernels/moe/grouped.py).

CPU: the layout's exact offsets, destination rows, source rows and tile experts for hand-made ids
(experts with no pairs, every pair on one expert, segments of exact tile multiples) and against a
brute-force oracle on random ids; the whole path on the kernel's reference twin against the fp32
reference. GPU (CUDA): the grouped qgemm launches and the grouped path against the fp32 reference,
outputs poisoned with NaN (unused tiles are not written: only the pairs' rows are checked), random T, E,
k, bits, groups, spreads "one" / "random" (experts with no tokens), bf16 / fp16; and the dispatcher
taking the grouped path.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import selection
from mtlqwen.kernels.moe import grouped

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu
from test_kernels_moe import CPU_SETTINGS, TOL, moe_case, poisoning, quantized, ref32, rel_err, routing, to32


def layout_np(lay: grouped.GroupLayout) -> dict:
    return {f: np.array(getattr(lay, f)).tolist() for f in grouped.GroupLayout._fields}


# ---------------------------------------------------------------- CPU: the layout, exact
def test_layout_hand_made_ids():
    """Pairs p = t*k + j; segments padded to MB = 2: expert 3 has no pair, expert 0 three (one pad row)."""
    lay = grouped.group_layout(mx.array([[2, 0], [0, 1], [2, 0]], dtype=mx.int32), 4, 2)
    assert grouped.padded_rows(6, 4, 2) == 10
    assert layout_np(lay) == dict(
        counts=[3, 1, 2, 0], offsets=[0, 4, 6, 8],
        dest=[6, 0, 1, 4, 7, 2],                      # expert 0: pairs 1, 2, 5; expert 1: 3; expert 2: 0, 4
        src=[0, 1, 2, -1, 1, -1, 0, 2, -1, -1],
        tile_expert=[0, 0, 1, 2, -1])


def test_layout_all_pairs_on_one_expert():
    lay = grouped.group_layout(mx.array([[3], [3], [3]], dtype=mx.int32), 5, 4)
    assert grouped.padded_rows(3, 5, 4) == 12            # 3 pairs + 3 experts at most x 3 pad rows
    assert layout_np(lay) == dict(
        counts=[0, 0, 0, 3, 0], offsets=[0, 0, 0, 0, 4], dest=[0, 1, 2], src=[0, 1, 2] + [-1] * 9,
        tile_expert=[3, -1, -1])


def test_layout_exact_tile_multiples():
    lay = grouped.group_layout(mx.array([[0, 1], [1, 0]], dtype=mx.int32), 2, 2)
    assert layout_np(lay) == dict(counts=[2, 2], offsets=[0, 2], dest=[0, 2, 3, 1], src=[0, 1, 0, 1, -1, -1],
                                  tile_expert=[0, 1, -1])


def test_layout_refuses_an_overflowing_key():
    with pytest.raises(ValueError, match="overflow the int32 sort key"):
        grouped.group_layout(mx.zeros((2**16, 8), dtype=mx.int32), 2**12, 16)


@settings(**CPU_SETTINGS)
@given(T=st.integers(1, 70), E=st.integers(1, 40), k=st.integers(1, 8), mb=st.sampled_from([1, 2, 16, 32, 64]),
       spread=st.sampled_from(["random", "one"]), seed=st.integers(0, 2**31 - 1))
def test_layout_matches_brute_force(T, E, k, mb, spread, seed):
    k = min(k, E)
    inds, _ = routing(np.random.default_rng(seed), T, E, k, spread)
    lay = layout_np(grouped.group_layout(inds, E, mb))
    flat = np.array(inds).reshape(-1).tolist()
    R = grouped.padded_rows(T * k, E, mb)
    counts = [flat.count(e) for e in range(E)]
    offsets, dest, src, row = [], [0] * (T * k), [-1] * R, 0
    tiles = [-1] * (R // mb)
    for e in range(E):
        offsets.append(row)
        for p in [p for p in range(T * k) if flat[p] == e]:  # the expert's pairs in pair order
            dest[p], src[row] = row, p // k
            row += 1
        row = offsets[e] + -(-counts[e] // mb) * mb
        for i in range(offsets[e] // mb, row // mb):
            tiles[i] = e
    assert row <= R and R % mb == 0
    assert lay == dict(counts=counts, offsets=offsets, dest=dest, src=src, tile_expert=tiles)


def test_tile_rows_by_mean_pairs_per_expert():
    assert selection.SELECT["moe_grouped_tile_rows"] == 0
    assert [grouped.tile_rows(p, 256) for p in (64, 4096, 8192, 8193, 32768)] == [16, 16, 32, 64, 64]
    with selection.selected({"moe_grouped_tile_rows": 16}):
        assert grouped.tile_rows(32768, 256) == 16


# ---------------------------------------------------------------- CPU: the path on the reference twin
@settings(**CPU_SETTINGS)
@given(T=st.sampled_from([1, 5, 24, 70]), E=st.integers(1, 40), k=st.integers(1, 8), bits=st.sampled_from([4, 8]),
       gs=st.sampled_from([32, 64, 128]), mb=st.sampled_from([16, 32]), shared=st.booleans(),
       spread=st.sampled_from(["random", "one"]), seed=st.integers(0, 2**31 - 1))
def test_grouped_path_on_reference_gemm(T, E, k, bits, gs, mb, shared, spread, seed):
    """The layout, the gathers and the routed sum around the GEMM = the reference, fp32 on the CPU."""
    k = min(k, E)
    case = moe_case(seed, T, E, k, 256, 256, bits, gs, mx.float32, shared, spread)
    with mx.stream(mx.cpu):
        got = grouped.grouped_experts(*case, mb=mb, gemm=grouped.grouped_qgemm_ref)
    assert got.shape == (T, 256)
    assert rel_err(got, ref32(*case)) < 1e-5


def test_supported_is_cuda_only_and_shape_bound():
    x, gate, up, down, inds, _, _ = moe_case(0, 8, 4, 2, 256, 256, 4, 64, mx.bfloat16, False, "random")
    assert grouped.supported(x, gate, up, down, inds) == (grouped.available())
    rng = np.random.default_rng(0)
    g128, u128 = (quantized(rng, (4, 128, 256), 4, 64, mx.bfloat16) for _ in range(2))
    assert not grouped.supported(x, g128, u128, quantized(rng, (4, 256, 128), 4, 64, mx.bfloat16), inds)  # Im 128
    assert not grouped.supported(x.astype(mx.float32), gate, up, down, inds)


# ---------------------------------------------------------------- GPU: kernels and dispatcher
@pytest.fixture
def poisoned():
    yield from poisoning(grouped)


cuda_only = pytest.mark.skipif(not grouped.available(), reason="the grouped GEMM is CUDA-only (mma.sync)")


@pytest.mark.gpu
@needs_gpu
@cuda_only
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(T=st.sampled_from([1, 3, 17, 64, 130]), E=st.sampled_from([1, 5, 64, 256]), k=st.integers(1, 8),
       N=st.sampled_from([256, 320, 512]), K=st.sampled_from([256, 768]), bits=st.sampled_from([4, 8]),
       gs=st.sampled_from([32, 64, 128]), mb=st.sampled_from([16, 32, 64]), dtype=st.sampled_from(["bfloat16", "float16"]),
       spread=st.sampled_from(["random", "one"]), gather=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_grouped_qgemm_matches_reference(poisoned, T, E, k, N, K, bits, gs, mb, dtype, spread, gather, seed):
    """Both launches (SwiGLU gate+up, plain) at the pairs' rows against fp32 on the CPU (N not a multiple
    of the block's rows: a row tail), activations from the buffer or gathered in the kernel (`src`)."""
    k, K = min(k, E), 256 if E == 256 else K  # 256 experts at the smallest K: the CPU quantizes them
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(seed)
    w = [quantized(rng, (E, N, K), bits, gs, dt) for _ in range(2)]
    inds, _ = routing(rng, T, E, k, spread)
    lay = grouped.group_layout(inds, E, mb)
    x = mx.array(rng.standard_normal((T, K)).astype(np.float32)).astype(dt)
    xp = x[mx.maximum(lay.src, 0)]
    xin, src = (x, lay.src) if gather else (xp, None)
    h = poisoned.grouped_qgemm(xin, w, lay.tile_expert, mb, epi=1, src=src)[0]
    y = poisoned.grouped_qgemm(xin, w[:1], lay.tile_expert, mb, src=src)[0]
    assert h.shape == y.shape == (xp.shape[0], N) and h.dtype == dt
    if gather:  # padding rows of used tiles read zeros: exactly zero out
        used = np.repeat(np.array(lay.tile_expert) >= 0, mb)
        pad = mx.array(np.nonzero(used & (np.array(lay.src) < 0))[0].astype(np.int32))
        assert (np.array(h[pad].astype(mx.float32)) == 0).all() and (np.array(y[pad].astype(mx.float32)) == 0).all()
    # the reference at the pairs' rows only, in buffer order (experts ascending: one-row tiles)
    rows = mx.array(np.sort(np.array(lay.dest)))
    ids = lay.tile_expert[rows // mb]
    with mx.stream(mx.cpu):
        xr = xp[rows].astype(mx.float32)
        hr = grouped.grouped_qgemm_ref(xr, [to32(p) for p in w], ids, 1, epi=1)[0]
        yr = grouped.grouped_qgemm_ref(xr, [to32(w[0])], ids, 1)[0]
    assert (np.array(ids) >= 0).all()
    assert rel_err(h[rows], np.array(hr)) < TOL[mx.bfloat16]
    assert rel_err(y[rows], np.array(yr)) < TOL[mx.bfloat16]


@pytest.mark.gpu
@needs_gpu
@cuda_only
@settings(max_examples=n_examples(24), **GPU_SETTINGS)
@given(T=st.sampled_from([8, 9, 40, 64, 101, 300]), E=st.sampled_from([1, 8, 33, 256]), k=st.integers(1, 8),
       H=st.sampled_from([256, 512]), Im=st.sampled_from([256, 512]), bits=st.sampled_from([4, 8]),
       gs=st.sampled_from([32, 64, 128]), mb=st.sampled_from([None, 16, 32, 64]), shared=st.booleans(),
       spread=st.sampled_from(["random", "one"]), seed=st.integers(0, 2**31 - 1))
def test_grouped_experts_match_reference(poisoned, T, E, k, H, Im, bits, gs, mb, shared, spread, seed):
    k = min(k, E)
    H, Im = (256, 256) if E == 256 else (H, Im)  # 256 experts at the smallest widths: the CPU quantizes them
    case = moe_case(seed, T, E, k, H, Im, bits, gs, mx.bfloat16, shared, spread)
    assert poisoned.supported(*case[:4], case[4])
    got = poisoned.grouped_experts(*case, mb=mb)
    assert got.shape == (T, H) and got.dtype == mx.bfloat16
    assert rel_err(got, ref32(*case)) < TOL[mx.bfloat16]


@pytest.mark.gpu
@needs_gpu
@cuda_only
@pytest.mark.parametrize("T, path", [(8, "fused"), (16, "grouped"), (101, "grouped")])
def test_moe_experts_dispatch_serves_grouped(poisoned, monkeypatch, T, path):
    """From moe_grouped_min_pairs pairs the dispatcher runs the grouped path (pinned at 64 here, where k = 4
    makes 16 tokens 64 pairs, so the test's small cases cross it)."""
    from mtlqwen.kernels import dispatch  # noqa: PLC0415
    from mtlqwen.kernels.moe import moe_experts  # noqa: PLC0415

    calls = []
    real = grouped.grouped_experts
    monkeypatch.setattr(grouped, "grouped_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setitem(selection.SELECT, "moe_grouped_min_pairs", 64)
    case = moe_case(T, T, 64, 4, 512, 256, 4, 64, mx.bfloat16, True, "random")
    got = moe_experts(*case)
    assert dispatch.OPS["moe_experts"].failed is None
    assert bool(calls) == (path == "grouped")
    assert rel_err(got, ref32(*case)) < TOL[mx.bfloat16]
