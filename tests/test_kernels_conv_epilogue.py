"""The GDN input projections with the causal conv in the qmv's epilogue (qmatmul/conv_epilogue.py), against
the path it replaces -- the projections' qmv, then the in-place conv kernel -- bit for bit (the same roundings
in the same order), and against the fp32 reference. Random M (1-8 sequences in random slots), the four
projections of odd and random widths, K groups, 4/8 bits, group sizes, conv widths 2-4, bf16 / fp32 activations and pools; outputs
start as NaN; pool rows of the batch updated, every other row untouched. Metal emulator on the CPU, the CUDA
rendering on a GPU (skipped on the CPU)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import SeqLayout, backend
from mtlqwen.kernels.conv import kernels as conv_kernels
from mtlqwen.kernels.conv.reference import causal_conv1d_ref
from mtlqwen.kernels.qmatmul import conv_epilogue, gemv, gdn_in_proj_conv
from mtlqwen.kernels.selection import selected

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu
from test_kernels_qmatmul import make_params, ref32, rel_err


def _inplace_order_check():
    """benchmarks/inplace_order_check.py as a module (its model and decode driver)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "inplace_order_check.py"
    spec = importlib.util.spec_from_file_location("inplace_order_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DT = {"bfloat16": mx.bfloat16, "float32": mx.float32}
TOL = {mx.float32: 2e-5, mx.bfloat16: 2e-2}

shapes = dict(M=st.integers(1, 8), P=st.just(4), n0=st.integers(1, 150), kg=st.integers(1, 4),
              bits=st.sampled_from([4, 8]), gs=st.sampled_from([32, 64, 128]), K=st.integers(2, 4),
              dtype=st.sampled_from(sorted(DT)), pdtype=st.sampled_from(sorted(DT)), seed=st.integers(0, 2**31 - 1))


def case(M, P, n0, kg, bits, gs, K, dtype, pdtype, seed, ns=None):
    """ns: the four projections' widths (default: 2 n0 + 1 channels, then random widths)."""
    rng = np.random.default_rng(seed)
    dt, pt = DT[dtype], DT[pdtype]
    ns = ns or [2 * n0 + 1] + [int(rng.integers(1, 80)) for _ in range(P - 1)]
    ps = [make_params(rng, n, kg * gs, bits, gs, dt) for n in ns]
    x = mx.array(rng.standard_normal((M, kg * gs)).astype(np.float32)).astype(dt)
    conv_w = mx.array(0.5 * rng.standard_normal((ns[0], K)).astype(np.float32)).astype(dt)
    S = M + 3
    pool = np.array(mx.array(rng.standard_normal((S, K - 1, ns[0])).astype(np.float32)).astype(pt).astype(mx.float32))
    slots = rng.permutation(S)[:M].astype(int).tolist()
    layout = SeqLayout(list(range(M + 1)), [5] * M, [[i] for i in range(M)], slots, 16)
    mx.eval(ps[0].weight, x, conv_w)
    return ps, x, conv_w, pool, pt, layout


def fresh(pool: np.ndarray, pt) -> mx.array:
    a = mx.array(pool).astype(pt)
    mx.eval(a)
    return a


def check_against_the_two_launches(ps, x, conv_w, pool, pt, layout, name: str):
    """qmv_conv == qmv then conv (in place), exactly; y0 and the batch's pool rows against fp32 too."""
    old = fresh(pool, pt)
    ys = gemv.qmv(x, ps, mma=False)
    y0, _ = conv_kernels.run_conv(ys[0], conv_w, old, layout, inplace=True)
    mx.eval(ys, y0)
    new = fresh(pool, pt)
    got = conv_epilogue.qmv_conv(x, ps, conv_w, new, layout, init_value=float("nan"))
    mx.eval(got)
    assert len(got) == len(ps)
    for g, w in zip(got, [y0] + ys[1:]):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.array_equal(np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32)))
    assert np.array_equal(np.array(new.astype(mx.float32)), np.array(old.astype(mx.float32)))
    untouched = [s for s in range(pool.shape[0]) if s not in layout.state_rows]
    assert np.array_equal(np.array(new.astype(mx.float32))[untouched], pool[untouched])
    with mx.stream(mx.cpu):  # fp32: the projection, rounded as `linear` returns it, then the conv reference
        mixed = mx.array(ref32(x, ps[0])).astype(x.dtype)
        want_y, want_state = causal_conv1d_ref(mixed, conv_w, mx.array(pool).astype(pt), layout)
    assert rel_err(got[0], np.array(want_y.astype(mx.float32))) < TOL[x.dtype]
    # the new raw row is stored in the pool's dtype: a bf16 pool rounds it (a one-ulp difference may flip that)
    tol = TOL[mx.bfloat16 if mx.bfloat16 in (x.dtype, pt) else mx.float32]
    assert rel_err(new[mx.array(layout.state_rows)], np.array(want_state.astype(mx.float32))) < tol
    return name


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=12, deadline=None, database=None)
@given(**shapes)
def test_conv_epilogue_metal_emulated(M, P, n0, kg, bits, gs, K, dtype, pdtype, seed):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    with metal_emulator.emulating() as launches:  # outputs start as NaN bytes there
        check_against_the_two_launches(*case(M, P, n0, kg, bits, gs, K, dtype, pdtype, seed), "metal")
    assert [ln.kernel for ln in launches][-1] == f"mtl_qmv_conv_p{P}"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
def test_conv_epilogue_metal_emulated_at_the_9b_shape():
    """The Qwen3.5-9B GDN layer's projections (K 4096; qkv 8192 channels, z 4096, b and a 32), 4 rows."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    with metal_emulator.emulating():
        check_against_the_two_launches(*case(4, 4, 0, 64, 4, 64, 4, "bfloat16", "bfloat16", 4, ns=[8192, 4096, 32, 32]),
                                       "metal")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
def test_the_op_takes_one_launch_for_decode_rows_only(monkeypatch):
    """gdn_in_proj_conv with its kernel (the CPU's default device runs references, so it is injected): decode
    rows with the row on -> the one launch, the states in place (None), the reference's outputs; a two-token
    sequence, or the row off -> the fallback, which returns the states for a scatter. (No first-use self-check:
    the emulator runs a launch when it is called, so an in-place kernel has written the pool before the
    reference would read it; on a GPU both run at evaluation, the reference first.)"""
    from mtlqwen.kernels import dispatch, metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.qmatmul.ops import _in_proj_conv_ref  # noqa: PLC0415

    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "0")
    ps, x, conv_w, pool, pt, layout = case(3, 4, 40, 2, 4, 64, 4, "bfloat16", "float32", 7)
    want, want_state = _in_proj_conv_ref(x, ps, conv_w, fresh(pool, pt), layout)
    two = SeqLayout([0, 2, 3], [5, 5], [[0], [1]], layout.state_rows[:2], 16)
    with metal_emulator.emulating() as launches, dispatch.inject("gdn_in_proj_conv", conv_epilogue.gdn_in_proj_conv_kernel) as op:
        with selected({"qmv_conv_epilogue": 1}):
            p = fresh(pool, pt)
            outs, new = gdn_in_proj_conv(x, ps, conv_w, p, layout)
            mx.eval(outs)
            assert new is None and op.failed is None and [ln.kernel for ln in launches] == ["mtl_qmv_conv_p4"]
            for o, w in zip(outs, want):
                assert o.shape == w.shape and rel_err(o, np.array(w.astype(mx.float32))) < TOL[mx.bfloat16]
            assert rel_err(p[mx.array(layout.state_rows)], np.array(want_state)) < TOL[mx.bfloat16]
            outs, new = gdn_in_proj_conv(x, ps, conv_w, fresh(pool, pt), two)
            assert new is not None and new.shape == (2, 3, 81) and len(launches) == 1
        with selected({"qmv_conv_epilogue": 0}):
            outs, new = gdn_in_proj_conv(x, ps, conv_w, fresh(pool, pt), layout)
            assert new is not None and len(launches) == 1


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
def test_a_decode_step_through_the_epilogue_equals_the_two_launches(monkeypatch):
    """A one-GDN-layer 4-bit model on the Metal emulator: prefill, then two decode steps of 2 sequences with the
    projections and the conv as two launches (qmv, in-place conv) and as one (the epilogue) -> the same logits,
    bit for bit (the other ops run their references in both). No first-use self-check (see above)."""
    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "0")
    import contextlib  # noqa: PLC0415

    from mtlqwen.kernels import dispatch, metal_emulator  # noqa: PLC0415
    from mtlqwen.model.builtin import qwen35_9b_config, random_model  # noqa: PLC0415
    from mtlqwen.model.config import QuantSpec  # noqa: PLC0415

    c = qwen35_9b_config()
    c.num_hidden_layers, c.layer_types, c.vocab_size, c.hidden_size, c.intermediate_size = 1, c.layer_types[:1], 512, 512, 512
    c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim = 2, 4, 32, 32
    model = random_model(config=c, quantize=QuantSpec(4, 64))
    rng = np.random.default_rng(0)
    B, L = 2, 6
    prompt = mx.array(rng.integers(0, c.vocab_size, B * L).astype(np.int32))
    toks = [mx.array(rng.integers(0, c.vocab_size, B).astype(np.int32)) for _ in range(2)]

    def run(row: int):
        with contextlib.ExitStack() as stack:
            launches = stack.enter_context(metal_emulator.emulating())
            stack.enter_context(dispatch.inject("linear_multi", gemv.linear_multi_kernel))
            stack.enter_context(dispatch.inject("causal_conv1d", conv_kernels.causal_conv1d_kernel))
            if row:
                stack.enter_context(dispatch.inject("gdn_in_proj_conv", conv_epilogue.gdn_in_proj_conv_kernel))
            stack.enter_context(selected({"qmv_conv_epilogue": row}))
            cache = model.make_cache(B + 1, B + 1, 128)
            model.hidden(prompt, SeqLayout([0, L, 2 * L], [0, 0], [[0], [1]], [1, 2], 128), cache)
            outs = []
            for s, tok in enumerate(toks):
                lay = SeqLayout([0, 1, 2], [L + s] * B, [[0], [1]], [1, 2], 128)
                outs.append(model.forward(tok, lay, cache, logits_rows=mx.arange(B)))
                mx.eval(outs, cache.arrays())
            names = [ln.kernel for ln in launches]
            return [np.array(o.astype(mx.float32)) for o in outs] + [np.array(cache.conv_states[0].astype(mx.float32))], names

    want, off = run(0)
    got, on = run(1)
    assert on.count("mtl_qmv_conv_p4") == 2 and "mtl_qmv_conv_p4" not in off
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def test_covers_only_decode_layouts():
    ps, x, conv_w, pool, pt, layout = case(2, 4, 10, 1, 4, 64, 4, "bfloat16", "bfloat16", 3)
    p = fresh(pool, pt)
    assert conv_epilogue.one_token_each(layout)
    assert not conv_epilogue.one_token_each(SeqLayout([0, 2, 3], [0, 0], [[0], [1]], [0, 1], 16))
    assert not conv_epilogue.one_token_each(SeqLayout([0, 1, 2], [0, 0], [[0], [1]], [0, 1], 16, verify=[True, False]))
    with selected({"qmv_conv_epilogue": 1}):
        if backend.gpu_backend() is None:  # the CPU runs the references
            assert not conv_epilogue.covers(x, ps, conv_w, p, layout)
        assert not conv_epilogue.covers(x, ps, conv_w[:, :3], p, layout)  # conv width against the pool's rows


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**shapes)
def test_conv_epilogue_matches_the_two_launches(M, P, n0, kg, bits, gs, K, dtype, pdtype, seed):
    check_against_the_two_launches(*case(M, P, n0, kg, bits, gs, K, dtype, pdtype, seed), backend.gpu_backend())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("M", [1, 4])
def test_conv_epilogue_at_the_9b_shape(M):
    """The Qwen3.5-9B GDN layer's projections (K 4096 in 64-groups; qkv 8192 channels, z 4096, b and a 32),
    conv K 4, bf16 activations and pools: the shapes the hypothesis cases stop short of."""
    check_against_the_two_launches(*case(M, 4, 0, 64, 4, 64, 4, "bfloat16", "bfloat16", M, ns=[8192, 4096, 32, 32]),
                                   backend.gpu_backend())


@pytest.mark.gpu
@needs_gpu
def test_decode_logits_with_the_epilogue_match_without():
    """Qwen3.5-9B layer geometry (4 layers, 4-bit, smaller vocab): a prefill, then 6 decode steps of 4 sequences
    (the FMA qmv's rows) with the row on and off, fed the same tokens (an argmax-fed run turns one near-tie flip
    into different inputs from then on) -> logits and conv pools within bf16 rounding of each other. The prefill
    is its own evaluation, as the engine runs every step: within one evaluation MLX's CUDA graphs order kernels
    by the buffers they declare as outputs, so the decode step's conv (either form) could read the pool before
    the prefill's in-place write (docs/design.md, "In-place writes"; benchmarks/inplace_order_check.py)."""
    check = _inplace_order_check()
    model = check.toy_model()
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, model.config.vocab_size, check.B * check.L).astype(np.int32))
    toks = [mx.array(rng.integers(0, model.config.vocab_size, check.B).astype(np.int32)) for _ in range(6)]
    want, got = (check.run(model, prompt, toks, row, eval_prefill=True) for row in (0, 1))
    for g, w in zip(got, want):
        assert np.max(np.abs(g - w)) <= 2e-2 * np.max(np.abs(w))
