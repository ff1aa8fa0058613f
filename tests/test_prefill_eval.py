"""Partial evaluations inside an eager prefill forward (SELECT "prefill_eval_layers", model/qwen35.py): the
layers launch in groups while the host builds the rest. The logits are the same, the groups are exactly
where the row puts them, and nothing inside a compiled trace or below the row threshold evaluates early."""

import mlx.core as mx
import numpy as np
import pytest

from mtlqwen.kernels import SeqLayout
from mtlqwen.kernels.selection import selected
from mtlqwen.model.qwen35 import _eval_points
from mtlqwen.runtime import Engine

from engine_checks import assert_idle, assert_reference, greedy
from hf_checkpoints import random_token_ids


def counting(monkeypatch) -> list:
    calls = []
    real = mx.async_eval

    def spy(*arrays):
        calls.append(len(arrays))
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", spy)
    return calls


def forward(model, ids, lens):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    cache = model.make_cache(12, len(lens), 8)
    tables = [[2 * i, 2 * i + 1, 8 + i] for i in range(len(lens))]
    lay = SeqLayout(qsl, [0] * len(lens), tables, list(range(len(lens))), 8)
    out = model.forward(mx.array(ids, dtype=mx.int32), lay, cache)
    mx.eval(out, cache.arrays())
    return np.array(out), [np.array(a) for a in cache.arrays()]


@pytest.mark.parametrize("every, tail, evals", [(1, 0, 7), (3, 0, 2), (8, 0, 0), (3, 1, 3), (8, 1, 3)])
def test_grouped_launches_give_the_same_logits_and_states(model, monkeypatch, every, tail, evals):
    """8 layers, 2 sequences of 13 + 6 rows (threshold 16): `evals` partial evaluations of two arrays (the
    residual stream and the normed input; with the halved tail at 3, 6, 7 or 4, 6, 7), then logits and
    cache contents equal to one evaluation's."""
    ids = random_token_ids(19, 500, seed=2)
    want, want_cache = forward(model, ids, [13, 6])
    calls = counting(monkeypatch)
    with selected({"prefill_eval_layers": every, "prefill_eval_min_rows": 16, "prefill_eval_tail": tail}):
        got, got_cache = forward(model, ids, [13, 6])
    assert len(model.layers) == 8 and calls == [2] * evals
    assert np.array_equal(got, want)
    assert all(np.array_equal(g, w) for g, w in zip(got_cache, want_cache))


def test_no_early_evaluation_below_the_rows_inside_a_trace_or_when_off():
    host = SeqLayout([0, 20], [0], [[0, 1, 2]], [0], 8)
    traced = SeqLayout.for_trace([0, 20], {"block_tables": mx.zeros((1, 3), dtype=mx.int32)}, 8)
    with selected({"prefill_eval_layers": 4, "prefill_eval_min_rows": 16, "prefill_eval_tail": 0}):
        assert _eval_points(host, 20, 12) == {4, 8} and _eval_points(host, 15, 12) == set()
        assert _eval_points(traced, 20, 12) == set()
    with selected({"prefill_eval_layers": 0, "prefill_eval_min_rows": 16}):
        assert _eval_points(host, 20, 12) == set()


@pytest.mark.parametrize("every, n, want", [(8, 32, {8, 16, 24, 28, 30, 31}), (8, 40, {8, 16, 24, 32, 36, 38, 39}),
                                            (8, 8, {4, 6, 7}), (8, 12, {8, 10, 11}), (3, 8, {3, 6, 7}),
                                            (1, 4, {1, 2, 3}), (8, 1, set())])
def test_the_last_group_is_halved_down_to_one_layer(every, n, want):
    """prefill_eval_tail: groups of `every` while more than `every` layers remain, then halves of what is left."""
    host = SeqLayout([0, 20], [0], [[0, 1, 2]], [0], 8)
    with selected({"prefill_eval_layers": every, "prefill_eval_min_rows": 16, "prefill_eval_tail": 1}):
        assert _eval_points(host, 20, n) == want


@pytest.mark.parametrize("every, first, tail, n, want", [(8, 1, 0, 32, {1, 8, 16, 24}), (8, 2, 0, 32, {2, 8, 16, 24}),
                                                   (8, 8, 0, 32, {8, 16, 24}), (8, 1, 1, 32, {1, 8, 16, 24, 28, 30, 31}),
                                                   (8, 40, 0, 32, {8, 16, 24}), (8, 1, 0, 1, set()), (0, 1, 0, 32, set())])
def test_a_first_small_group_starts_the_device_early(every, first, tail, n, want):
    """prefill_eval_first: one more evaluation after that many layers, inside the forward's layers only; none
    when grouping is off."""
    host = SeqLayout([0, 20], [0], [[0, 1, 2]], [0], 8)
    rows = {"prefill_eval_layers": every, "prefill_eval_first": first, "prefill_eval_min_rows": 16, "prefill_eval_tail": tail}
    with selected(rows):
        assert _eval_points(host, 20, n) == want


def test_engine_outputs_are_the_models_own_with_grouped_prefill(model):
    """Greedy generations through an engine whose prefill steps launch in groups of 2 layers equal the
    single-request reference, and nothing leaks."""
    prompts = [random_token_ids(n, 500, seed=n) for n in (37, 21, 50)]
    with selected({"prefill_eval_layers": 2, "prefill_eval_min_rows": 16}):
        eng = Engine(model, slots=3, step_tokens=32, block_tokens=8, num_blocks=40)
        outs = eng.generate(prompts, greedy(5))
    for p, o in zip(prompts, outs):
        assert_reference(model, p, o, 5)
    assert_idle(eng)


def test_a_device_error_in_an_early_group_fails_the_step_and_nothing_else(model, monkeypatch, caplog):
    """A layer of the first group (evaluated early by mx.async_eval) whose output fails to evaluate. The error
    surfaces while the step is still being built (a later group's evaluation waits on it), so the engine fails
    the step's requests as a build failure, without a cache reset, although part of the step ran. What that
    part wrote is the failed sequences' own (their slot's states, their new blocks' K/V): the next request
    gets its own greedy tokens, and nothing leaks."""
    layer = model.layers[0]
    real = type(layer).__call__
    armed = []

    def faulty(self, h, *args, **kw):
        h2, x2 = real(self, h, *args, **kw)
        if self is layer and armed:  # once: the next step's first layer output fails to evaluate
            armed.clear()
            bad = mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu).sum() * 0
            return h2 + bad.astype(h2.dtype), x2
        return h2, x2

    monkeypatch.setattr(type(layer), "__call__", faulty)
    with selected({"prefill_eval_layers": 2, "prefill_eval_min_rows": 16}):
        eng = Engine(model, slots=2, step_tokens=32, block_tokens=8, num_blocks=40)
        armed.append(1)
        (out,) = eng.generate([random_token_ids(30, 500, seed=4)], greedy(4))
        assert out.finish_reason == "error" and "LU factorization failed" in out.error
        assert "failed while it was built" in caplog.text
        nxt = random_token_ids(25, 500, seed=5)
        (ok,) = eng.generate([nxt], greedy(5))
    assert ok.finish_reason == "length"
    assert_reference(model, nxt, ok, 5)
    assert_idle(eng)
