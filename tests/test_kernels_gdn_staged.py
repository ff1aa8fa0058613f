"""The GDN recurrence with a block of tokens staged in threadgroup memory (kernels/gdn/staged.py), against the
references: its Metal rendering on the CPU emulator, its CUDA rendering on a GPU (outputs poisoned with NaN)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels.gdn import gated_delta_candidates_ref, gated_delta_ref
from mtlqwen.kernels.gdn.kernels import run_gdn
from mtlqwen.kernels.selection import selected

from gpu_checks import n_examples
from test_kernels_gdn import (GEOMS, GPU_SETTINGS, _check, make_case, needs_gpu, on_cpu, packed_case,
                              short_or_long)

KERNEL = {"states": "gdn_recurrent_staged", "inplace": "gdn_recurrent_staged_inplace",
          "candidates": "gdn_recurrent_staged_cand"}


def check_staged(seed, lens, geom, dtype, mode, packed, stage, tpr=None):
    """run_gdn's recurrence (chunk scan forbidden) with SELECT["gdn_recurrent_stage"] = stage against the
    reference: o, and the states returned ("states", "candidates": with every token's, the pool only read) or
    written into the sequences' pool rows with every other row untouched ("inplace")."""
    args, layout = make_case(seed, lens, *geom, dtype=dtype)
    before = np.array(args["state_pool"])
    ref_fn = gated_delta_candidates_ref if mode == "candidates" else gated_delta_ref
    ref = on_cpu(ref_fn, **{**args, "state_pool": mx.array(before)}, layout=layout)
    rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}
    if packed:  # q | k | v read where they lie in the conv output
        y, heads = packed_case(args)
        qkv = dict(q=y, k=y, v=y, heads=heads)
    else:
        qkv = {n: args[n] for n in ("q", "k", "v")}
    with selected({"gdn_recurrent_stage": stage}):
        out = run_gdn(**qkv, **rest, layout=layout, chunk=False, candidates=mode == "candidates",
                      inplace=mode == "inplace", tpr=tpr, init_value=float("nan"))
        assert out is not None
        mx.eval(out)
    if mode == "inplace":
        after = np.array(args["state_pool"])
        rows = layout.state_rows
        _check([out[0], mx.array(after[rows])], ref, dtype, f"staged inplace stage={stage}")
        others = [i for i in range(after.shape[0]) if i not in rows]
        assert np.array_equal(after[others], before[others])
        return
    _check(list(out), ref, dtype, f"staged {mode} stage={stage}")
    assert np.array_equal(np.array(args["state_pool"]), before)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=8, deadline=None, database=None)
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 21), min_size=1, max_size=3),
       geom=st.sampled_from([g for g in GEOMS if g[2] <= 64 and g[3] <= 64]),
       dtype=st.sampled_from([mx.float32, mx.bfloat16]), mode=st.sampled_from(list(KERNEL)),
       packed=st.booleans(), stage=st.sampled_from([1, 3, 8]))
@example(seed=4, lens=[16, 17, 1], geom=(2, 3, 32, 48), dtype=mx.float32, mode="candidates", packed=True, stage=8)
def test_gdn_recurrent_staged_metal_emulated(seed, lens, geom, dtype, mode, packed, stage):
    """The Metal rendering on the emulator (outputs NaN there until written): whole and partial blocks, a decode
    row beside longer segments, GQA ratios, dk != dv, q, k, v as three arrays or the packed conv output. A batch
    of one-token segments keeps the unstaged kernel (nothing to read ahead)."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    with metal_emulator.emulating() as launches:
        check_staged(seed, lens, geom, dtype, mode, packed, stage)
    want = KERNEL[mode] if max(lens) > 1 else KERNEL[mode].replace("_staged", "")
    assert [ln.kernel for ln in launches] == [want]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(16), **GPU_SETTINGS)  # device_run.sh runs a third of them
@given(seed=st.integers(0, 2**31), lens=short_or_long(20, (60, 300)), geom=st.sampled_from(GEOMS),
       dtype=st.sampled_from([mx.float32, mx.bfloat16]),
       mode=st.sampled_from(list(KERNEL)), packed=st.booleans(), stage=st.sampled_from([3, 8, 16]),
       tpr=st.sampled_from([None, None, 4, 16]))
@example(seed=1, lens=[4096], geom=(1, 2, 128, 128), dtype=mx.bfloat16, mode="inplace", packed=True, stage=16,
         tpr=None)  # a long prompt's segment at the 9B head shape
@example(seed=2, lens=[8] * 8, geom=(1, 2, 128, 128), dtype=mx.bfloat16, mode="candidates", packed=True, stage=8,
         tpr=None)  # 8 verifications of 7 drafts
def test_gdn_recurrent_staged_kernel(seed, lens, geom, dtype, mode, packed, stage, tpr):
    """The gate for SELECT["gdn_recurrent_stage"]: the CUDA (or Metal) rendering against the reference, long
    segments included (the row would take prefill segments from the chunk scan), other lane splits (tpr)."""
    check_staged(seed, lens, geom, dtype, mode, packed, stage, tpr)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
def test_normed_max_t_leaves_longer_segments_to_the_staged_recurrence():
    """SELECT["gdn_normed_max_t"]: with gdn_chunk_min_t raised past the segments, the fused recurrence + norm
    declines a batch whose longest segment (20) is past the row (the op then runs the recurrence, here staged,
    and the norm apart), and takes it at 0 (no bound of its own). Outputs against the reference."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.gdn.kernels import gated_delta_packed_kernel  # noqa: PLC0415
    from mtlqwen.kernels.gdn.normed import gated_delta_packed_normed_kernel  # noqa: PLC0415

    from test_kernels_gdn import norm_inputs, normed_want, rel  # noqa: PLC0415

    args, layout = make_case(5, [20, 3], 2, 3, 32, 48)
    y, heads = packed_case(args)
    z, w, eps = norm_inputs(5, y.shape[0], heads[2], heads[3], mx.float32)
    rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}
    ref = on_cpu(gated_delta_ref, **args, layout=layout)
    want, _, _ = normed_want(args, layout, z, w, eps, heads[2], heads[3])
    rows = {"gdn_chunk_min_t": 100, "gdn_recurrent_stage": 4}
    with metal_emulator.emulating() as launches:
        with selected({**rows, "gdn_normed_max_t": 8}):
            assert gated_delta_packed_normed_kernel(y, z, w, eps, **rest, layout=layout, heads=heads) is None
            o, states = gated_delta_packed_kernel(y, **rest, layout=layout, heads=heads)
            mx.eval(o, states)
            _check([o, states], ref, mx.float32, "staged past gdn_normed_max_t")
        with selected({**rows, "gdn_normed_max_t": 0}):
            o, states = gated_delta_packed_normed_kernel(y, z, w, eps, **rest, layout=layout, heads=heads)
            mx.eval(o, states)
            assert rel(o, want) < 1e-4 and rel(states, ref[1]) < 1e-4
    assert [ln.kernel for ln in launches] == ["gdn_recurrent_staged", "gdn_recurrent_normed"]


def test_a_block_past_threadgroup_memory_keeps_the_unstaged_kernels():
    """The staged kernels' rule, exactly: on when the row is >= 1, some segment has 2+ tokens and the block fits the
    back-end's static threadgroup memory (Metal 32 KiB, CUDA 48 KiB); else the unstaged kernel."""
    from mtlqwen.kernels.gdn import normed, staged  # noqa: PLC0415

    # unfused, 9B head (dk 128, BV 16): 4 * TB * (2 * 128 + 16 + 2) bytes
    for row, backend, longest, want in ((16, "cuda", 8, 16), (16, "cuda", 1, None), (0, "cuda", 8, None),
                                        (44, "cuda", 8, 44), (45, "cuda", 8, None), (29, "metal", 8, 29),
                                        (30, "metal", 8, None)):
        with selected({"gdn_recurrent_stage": row}):
            got = staged.staged_kernel(backend, 128, 16, longest, candidates=False, inplace=False)
        assert (got[1] if got else None) == want, (row, backend, longest)
    with selected({"gdn_recurrent_stage": 8}):
        assert staged.staged_kernel("cuda", 128, 16, 4, candidates=True, inplace=False)[0] is staged.STAGED_CAND
        assert staged.staged_kernel("cuda", 128, 16, 4, candidates=False, inplace=True)[0] is staged.STAGED_INPLACE
    # fused, 9B head (dk = BV = 128): 4 * (TB * (2 * 128 + 2 * 128 + 2) + 64) bytes
    for row, backend, longest, want in ((8, "cuda", 64, 8), (23, "cuda", 64, 23), (24, "cuda", 64, 0),
                                        (15, "metal", 64, 15), (16, "metal", 64, 0), (8, "cuda", 1, 0)):
        with selected({"gdn_normed_stage": row}):
            assert normed.stage_tokens(backend, 128, 128, longest) == want, (row, backend, longest)
