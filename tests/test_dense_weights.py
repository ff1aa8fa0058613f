"""Dequantized copies of the decoder's projections kept in memory (runtime/dense_weights.py) for the GEMMs past
qgemm's rows. CPU: which projections are copied and in what stacks, the copies' values, the engine's switch,
and gemv's use of a kept stack only for exactly its projections in order. GPU: a prefill forward with the
copies gives bit for bit the logits and states of one that dequantizes every step, and launches no
dequantize."""

from __future__ import annotations

import re
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mtlqwen.kernels import SeqLayout, backend
from mtlqwen.kernels.qmatmul import dequant, gemv
from mtlqwen.kernels.selection import SELECT, selected
from mtlqwen.model import QuantSpec
from mtlqwen.model.builtin import random_model
from mtlqwen.model.qwen35 import GDNMixer
from mtlqwen.runtime import Engine, dense_weights

from engine_checks import assert_idle, greedy
from gpu_checks import needs_gpu
from hf_checkpoints import random_token_ids
from test_moe_model import moe_35b_shape


@pytest.fixture
def qmodel():
    return random_model(quantize=QuantSpec(4, 64), seed=3)


def test_groups_follow_the_layers_call_order(qmodel):
    """Per GDN layer [qkv, z, b, a], [out]; per attention layer [q, k, v], [o]; per dense MLP [gate, up], [down]."""
    groups = dense_weights.projection_groups(qmodel)
    assert len(groups) == 4 * len(qmodel.layers)
    for layer, (mix, out, gu, down) in zip(qmodel.layers, zip(*[iter(groups)] * 4)):
        m = layer.mixer
        want = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a] if isinstance(m, GDNMixer) else \
            [m.q_proj, m.k_proj, m.v_proj]
        assert all(a is b for a, b in zip(mix, want)) and len(mix) == len(want)
        assert out == [m.out_proj] and out[0] is m.out_proj
        assert gu[0] is layer.mlp.gate_proj and gu[1] is layer.mlp.up_proj and down[0] is layer.mlp.down_proj


def test_an_moe_model_copies_only_its_mixers():
    model = random_model(moe_35b_shape(layers=4, experts=8), quantize=QuantSpec(4, 64))
    groups = dense_weights.projection_groups(model)
    assert len(groups) == 2 * 4
    mixers = {id(p) for layer in model.layers for p in vars(layer.mixer).values() if hasattr(p, "scales")}
    assert {id(p) for g in groups for p in g} == mixers


def test_copies_are_the_dequantized_weights_and_stacks_share_one_buffer(qmodel):
    held = dense_weights.keep_dense_weights(qmodel, True)
    assert held == dense_weights.dense_bytes(qmodel) == dense_weights.kept_bytes(qmodel) > 0
    for g in dense_weights.projection_groups(qmodel):
        for i, p in enumerate(g):
            want = mx.dequantize(p.weight, p.scales, p.biases, group_size=p.group_size, bits=p.bits)
            assert p.dense.dtype == p.scales.dtype and mx.array_equal(p.dense, want).item()
            if len(g) > 1:  # one matrix for the group, its rows in the group's order
                w, j = p.dense_stack
                assert j == i and w is g[0].dense_stack[0]
                r = sum(q.out_features for q in g[:i])
                assert mx.array_equal(w[r:r + p.out_features], p.dense).item()
            else:
                assert p.dense_stack is None
            # the transposes, evaluated once: views of the same buffers
            assert mx.array_equal(p.dense_t, p.dense.T).item() and p.dense_t.shape == (p.in_features, p.out_features)
            if len(g) > 1:
                assert p.dense_stack_t is g[0].dense_stack_t and mx.array_equal(p.dense_stack_t, w.T).item()
    # again: nothing rebuilt (the same arrays)
    before = [p.dense for g in dense_weights.projection_groups(qmodel) for p in g]
    assert dense_weights.keep_dense_weights(qmodel, True) == held
    assert all(a is b for a, b in zip(before, [p.dense for g in dense_weights.projection_groups(qmodel) for p in g]))
    assert dense_weights.keep_dense_weights(qmodel, False) == 0
    assert all(p.dense is None and p.dense_stack is None and p.dense_t is None and p.dense_stack_t is None
               for g in dense_weights.projection_groups(qmodel) for p in g)


def test_the_engine_switch(qmodel, monkeypatch):
    """Never on the CPU references (they read the quantized weights), True or not; where the kernels run (faked
    here) True keeps them (engine.dense_bytes, stats' dense_weight_bytes), False drops them; bad values are
    refused."""
    if backend.use_kernels():
        pytest.skip("the CPU references' rule")
    for setting in (None, True):
        eng = Engine(qmodel, slots=1, num_blocks=8, block_tokens=16, dense_weights=setting)
        assert eng.dense_bytes == eng.stats()["dense_weight_bytes"] == dense_weights.kept_bytes(qmodel) == 0
    monkeypatch.setattr(dense_weights, "use_kernels", lambda: True)
    on = Engine(qmodel, slots=1, num_blocks=8, block_tokens=16, dense_weights=True)
    assert on.dense_bytes == on.stats()["dense_weight_bytes"] == dense_weights.dense_bytes(qmodel) > 0
    assert dense_weights.kept_bytes(qmodel) == on.dense_bytes
    assert Engine(qmodel, slots=1, num_blocks=8, block_tokens=16, dense_weights=False).dense_bytes == 0
    assert dense_weights.kept_bytes(qmodel) == 0 == on.dense_bytes  # read from the model the engines share
    with pytest.raises(ValueError, match="dense_weights must be true or false"):
        Engine(qmodel, slots=1, num_blocks=8, block_tokens=16, dense_weights="yes")


def test_a_kept_stack_serves_exactly_its_projections_in_order(qmodel):
    dense_weights.keep_dense_weights(qmodel, True)
    g = dense_weights.projection_groups(qmodel)[0]  # qkv, z, b, a of layer 0
    dt = g[0].scales.dtype
    w = g[0].dense_stack[0]
    assert gemv.kept_stack(g, dt) is w
    assert gemv.kept_stack([g[0], g[1], g[3], g[2]], dt) is None  # b and a swapped (same shapes)
    assert gemv.kept_stack(g[:2], dt) is None  # a part of the stack
    assert gemv.kept_stack(g, mx.float32) is None  # another dtype
    other = dense_weights.projection_groups(qmodel)[2]
    assert gemv.kept_stack([g[0], other[0]], dt) is None
    x = mx.zeros((SELECT["dequant_gemm_min_rows"] + 1, g[0].in_features), dtype=dt)
    wt, parts = gemv._stacked_t(x, g)  # the kept views: no slice, no transpose
    assert wt is g[0].dense_stack_t and all(a is b.dense_t for a, b in zip(parts, g))
    dense_weights.keep_dense_weights(qmodel, False)
    assert gemv.kept_stack(g, dt) is None


def nodes(a: mx.array, tmp_path) -> dict:
    """a's graph down to evaluated arrays, by primitive."""
    return nodes_of([a], tmp_path)


def nodes_of(arrays: list[mx.array], tmp_path) -> dict:
    """The graph of all of arrays (a node they share counted once), by primitive."""
    path = tmp_path / "g.dot"
    mx.export_to_dot(str(path), *arrays)
    return dict(Counter(re.findall(r'label ="([A-Za-z_]+)', path.read_text())))


@pytest.mark.parametrize("one_gemm", [0, 1])
def test_past_qgemm_rows_the_gemms_read_the_copies(qmodel, tmp_path, one_gemm):
    """CPU (qgemm unavailable, so 129+ bf16 rows take dequantize + GEMM): linear_multi, swiglu_linear and
    linear run on the kept matrices, never the dequantize kernel, with the products of the dequantized weights
    (with dequant_stack_one_gemm, linear_multi's outputs are the column ranges of one product)."""
    dense_weights.keep_dense_weights(qmodel, True)
    groups = dense_weights.projection_groups(qmodel)
    mix, gu, down = groups[0], groups[2], groups[3][0]
    rows = SELECT["dequant_gemm_min_rows"] + 7
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((rows, mix[0].in_features)).astype(np.float32)).astype(mx.bfloat16)
    mx.eval(x)
    calls = []
    real = dequant.dequantize_stack
    dequant.dequantize_stack = lambda *a: calls.append(a) or real(*a)
    try:
        with selected({"dequant_stack_one_gemm": one_gemm}):
            ys = gemv.linear_multi_kernel(x, mix)
        h = gemv.swiglu_linear_kernel(x, *gu)
        graphs = [nodes(a, tmp_path) for a in (*ys, h)]
        mx.eval(h)
        y_down = gemv.linear_kernel(h, down)
        graphs.append(nodes(y_down, tmp_path))
    finally:
        dequant.dequantize_stack = real
    assert calls == []
    # the kept views go into the GEMMs as they are: no transpose or slice of a weight in the graph
    assert all(g.pop("Matmul") == 1 and "Transpose" not in g for g in graphs), graphs
    # one GEMM a projection, or one for all whose outputs are its column ranges (a slice each, one shared GEMM)
    assert graphs[-1] == {} and all(g == ({"Slice": 1} if one_gemm else {}) for g in graphs[: len(ys)])
    assert nodes_of(ys, tmp_path)["Matmul"] == (1 if one_gemm else len(ys))  # shared by the outputs, or one each
    assert graphs[-2].pop("Slice") == 2 and list(graphs[-2]) == [next(iter(graphs[-2]))]  # the halves, fused SwiGLU
    for y, p in zip(ys, mix):
        want = x @ p.dense.T
        assert y.shape == want.shape
        assert np.allclose(np.array(y.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=1e-2, atol=1e-2)
        assert one_gemm or mx.array_equal(y, want).item()
    g, u = x @ gu[0].dense.T, x @ gu[1].dense.T
    assert np.allclose(np.array(h.astype(mx.float32)), np.array(((g * mx.sigmoid(g)) * u).astype(mx.float32)),
                       atol=2e-2, rtol=2e-2)  # the fused SwiGLU rounds once
    assert mx.array_equal(y_down, h @ down.dense.T).item()


def _prefill(model, ids, lens):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    cache = model.make_cache(64, len(lens), 16)
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(lens))]
    layout = SeqLayout(qsl, [0] * len(lens), tables, list(range(len(lens))), 16)
    # each sequence's last row, as the engine scores a prefill step (the LM head has no copy)
    out = model.forward(mx.array(ids, dtype=mx.int32), layout, cache, logits_rows=mx.array([q - 1 for q in qsl[1:]]))
    mx.eval(out, cache.arrays())
    return np.array(out.astype(mx.float32)), [np.array(a.astype(mx.float32)) for a in cache.arrays()]


@pytest.mark.gpu
@needs_gpu
def test_gpu_prefill_with_the_copies_is_bit_identical_and_dequantizes_nothing(qmodel):
    """Two sequences of 150 + 61 rows (past qgemm's 128): the last rows' logits and every pool equal bit for
    bit with the copies kept and without, and with them no dequantize launch is built."""
    ids = random_token_ids(211, qmodel.config.vocab_size, seed=5)
    dense_weights.keep_dense_weights(qmodel, False)
    want, want_cache = _prefill(qmodel, ids, [150, 61])
    dense_weights.keep_dense_weights(qmodel, True)
    calls = []
    real = dequant.dequantize_stack
    dequant.dequantize_stack = lambda *a: calls.append(a) or real(*a)
    try:
        got, got_cache = _prefill(qmodel, ids, [150, 61])
    finally:
        dequant.dequantize_stack = real
    assert calls == []
    assert np.array_equal(got, want)
    assert all(np.array_equal(g, w) for g, w in zip(got_cache, want_cache))


@pytest.mark.gpu
@needs_gpu
def test_gpu_one_gemm_a_stack_gives_the_same_logits_within_rounding(qmodel):
    """dequant_stack_one_gemm: the stacked projections as one GEMM (its column ranges read by the layers'
    kernels, copied contiguous where a kernel needs it) against a GEMM a projection, both on the copies: logits
    within bf16 rounding of each other."""
    ids = random_token_ids(211, qmodel.config.vocab_size, seed=6)
    dense_weights.keep_dense_weights(qmodel, True)
    want, _ = _prefill(qmodel, ids, [150, 61])
    with selected({"dequant_stack_one_gemm": 1}):
        got, got_cache = _prefill(qmodel, ids, [150, 61])
    assert np.isfinite(got).all() and all(np.isfinite(c).all() for c in got_cache)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


@pytest.mark.gpu
@needs_gpu
def test_gpu_engine_outputs_with_the_copies_equal_those_without(qmodel):
    prompts = [random_token_ids(n, qmodel.config.vocab_size, seed=n) for n in (300, 140, 77)]
    outs = {}
    for on in (False, True):
        eng = Engine(qmodel, slots=3, block_tokens=16, num_blocks=96, dense_weights=on)
        assert (eng.dense_bytes > 0) == on
        outs[on] = [o.token_ids for o in eng.generate(prompts, greedy(6))]
        assert_idle(eng)
    assert outs[True] == outs[False]


def test_auto_is_off_off_cuda(qmodel):
    if backend.gpu_backend() == "cuda" and backend.use_kernels():
        pytest.skip("CUDA: the default depends on the device's memory (test_gpu_auto_keeps_them_on_cuda)")
    assert dense_weights.resolve(qmodel, None) is False
    assert dense_weights.resolve(qmodel, True) is backend.use_kernels()  # Metal: as asked; CPU: never


@pytest.mark.gpu
@pytest.mark.skipif(backend.gpu_backend() != "cuda", reason="the default keeps copies on CUDA only")
def test_gpu_auto_keeps_them_on_cuda(qmodel):
    """A small model's copies fit easily: the default keeps them, and the KV pool is sized after them."""
    assert dense_weights.resolve(qmodel, None) is True
    assert Engine(qmodel, slots=1, block_tokens=16).dense_bytes == dense_weights.dense_bytes(qmodel)


def test_the_server_flag_reaches_the_engine():
    """serve --dense-weights: auto leaves the engine's default, on / off force it; --help names it."""
    from mtlqwen.cli import build_parser  # noqa: PLC0415
    from mtlqwen.frontends.server import _engine_kwargs  # noqa: PLC0415

    parser = build_parser()
    for flag, want in (([], None), (["--dense-weights", "on"], True), (["--dense-weights", "off"], False)):
        args = parser.parse_args(["serve", *flag])
        assert _engine_kwargs(args).get("dense_weights") == want
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dense-weights", "yes"])
