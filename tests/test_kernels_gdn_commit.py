"""The in-place "candidates" commit (gdn/commit.py) against the commit's rule computed in NumPy: the kept
candidate state and the last K-1 conv inputs (from the slot's own old rows and the raw verify rows) land in
the verifying slots' pool rows, and every other row is untouched. Random slot subsets, verification lengths
1..6 with k from 0 (anchor only: old conv rows survive) to all drafts, odd channel counts, bf16 / fp32 conv
pools. Metal emulator on the CPU; the CUDA rendering on a GPU (skipped on the CPU)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend
from mtlqwen.kernels.gdn.commit import pick_inplace

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu

shapes = dict(data=st.data(), S=st.integers(1, 4), Hv=st.integers(1, 3), dv=st.sampled_from([2, 5, 8]),
              dk=st.sampled_from([4, 8]), C=st.integers(1, 70), K1=st.integers(1, 3),
              dtype=st.sampled_from(["bfloat16", "float32"]), seed=st.integers(0, 2**31 - 1))


def case(data, S, Hv, dv, dk, C, K1, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = {"bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    n_slots = S + 3
    lens = [data.draw(st.integers(1, 6)) for _ in range(S)]
    ks = [data.draw(st.integers(0, n - 1)) for n in lens]
    slots = rng.permutation(n_slots)[:S]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    Tv = sum(lens)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    rec, conv, cand, raw = f32(n_slots, Hv, dv, dk), f32(n_slots, K1, C), f32(Tv, Hv, dv, dk), f32(Tv, C)
    conv, raw = (np.array(mx.array(a).astype(dt).astype(mx.float32)) for a in (conv, raw))  # representable
    want_rec, want_conv = rec.copy(), conv.copy()
    for s in range(S):
        want_rec[slots[s]] = cand[starts[s] + ks[s]]
        window = np.concatenate([conv[slots[s]], raw[starts[s] : starts[s] + lens[s]]])  # [K-1 + len, C]
        want_conv[slots[s]] = window[ks[s] + 1 : ks[s] + 1 + K1]
    arrays = [mx.array(rec), mx.array(conv).astype(dt), mx.array(cand), mx.array(raw).astype(dt),
              mx.array(ks, dtype=mx.int32), mx.array(starts), mx.array(slots.astype(np.int32))]
    mx.eval(arrays)
    return arrays, want_rec, want_conv


def check(arrays, done, want_rec, want_conv):
    mx.eval(done)
    assert done.tolist() == [1]
    rec, conv = arrays[0], arrays[1]
    assert np.array_equal(np.array(rec), want_rec)
    assert np.array_equal(np.array(conv.astype(mx.float32)), want_conv)  # copies: exact


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=8, deadline=None, database=None)
@given(**shapes)
def test_commit_metal_emulated(data, S, Hv, dv, dk, C, K1, dtype, seed):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    arrays, want_rec, want_conv = case(data, S, Hv, dv, dk, C, K1, dtype, seed)
    with metal_emulator.emulating() as launches:
        done = pick_inplace(*arrays, backend="metal")
        check(arrays, done, want_rec, want_conv)
    assert [ln.kernel for ln in launches] == ["gdn_commit_inplace"]


def test_off_by_row_or_without_gpu_kernels():
    """The row is off, or the CPU runs the references: None, and the caller commits with MLX ops."""
    z = mx.zeros((2, 1, 2, 4))
    args = (z, mx.zeros((2, 3, 5)), mx.zeros((3, 1, 2, 4)), mx.zeros((3, 5)),
            mx.zeros((1,), dtype=mx.int32), mx.zeros((1,), dtype=mx.int32), mx.zeros((1,), dtype=mx.int32))
    if backend.gpu_backend() is None:
        assert pick_inplace(*args) is None


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**shapes)
def test_commit_matches_the_rule(data, S, Hv, dv, dk, C, K1, dtype, seed):
    arrays, want_rec, want_conv = case(data, S, Hv, dv, dk, C, K1, dtype, seed)
    check(arrays, pick_inplace(*arrays, backend=backend.gpu_backend()), want_rec, want_conv)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
def test_the_models_commit_through_the_kernel_equals_its_mlx_ops(model, monkeypatch):
    """Qwen35Model.pick_candidates with every GDN layer's commit launched on the Metal emulator (the pools
    written through their buffers, the handles following the token) leaves the same pools, bit for bit, as
    its MLX ops: two verifications of 3 and 5 tokens after prompts of 13 and 20, accepted counts by device array."""
    from mtlqwen.kernels import SeqLayout, metal_emulator  # noqa: PLC0415
    from mtlqwen.model import verify  # noqa: PLC0415

    from hf_checkpoints import random_token_ids  # noqa: PLC0415

    bt, prompts = 16, [random_token_ids(n, 512, seed=n) for n in (13, 20)]

    def verified():
        c = model.make_cache(6, 3, bt)
        model.hidden(mx.array(prompts[0] + prompts[1], dtype=mx.int32), SeqLayout([0, 13, 33], [0, 0], [[0], [2, 3]], [2, 0], bt), c)
        vl = SeqLayout([0, 3, 8], [13, 20], [[0], [2, 3]], [2, 0], bt, verify=[True, True])
        _, _, stash = model.forward_verifying(mx.array([5, 6, 7, 8, 9, 10, 11, 12], dtype=mx.int32), vl, c,
                                              verify_commit="candidates")
        mx.eval(c.arrays(), [a for p in stash.layers.values() for a in p.tree() if isinstance(a, mx.array)])
        return c, stash

    launches = []
    for k in ([0, 4], [2, 1]):
        want, ws = verified()
        model.commit_candidates(want, ws, mx.array(k, dtype=mx.int32))
        got, gs = verified()
        with metal_emulator.emulating() as ln, monkeypatch.context() as m:
            m.setattr(verify, "pick_inplace", lambda *a: pick_inplace(*a, backend="metal"))
            model.commit_candidates(got, gs, mx.array(k, dtype=mx.int32))
            mx.eval(got.arrays())
            launches += ln
        for g, w in zip((*got.conv_states, *got.rec_states), (*want.conv_states, *want.rec_states)):
            assert np.array_equal(np.array(g), np.array(w))
    assert [x.kernel for x in launches] == ["gdn_commit_inplace"] * (2 * len(model.gdn_mixers))
