"""The encoder thread (kernels/encode_thread.py, Engine(encode_thread=True)): groups of an eager forward's layers
are evaluated on a worker thread, in order, while this thread builds the next; the engine drains it before
anything is read back. Outputs, groups and failures are those of the single-thread path (a failing group:
tests/test_prefill_eval.py, with the thread and without)."""

import gc
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from mtlqwen.kernels.selection import selected
from mtlqwen.kernels import encode_thread
from mtlqwen.kernels.encode_thread import EncodeThread, eval_group, scope
from mtlqwen.runtime import Engine, EngineConfig

from engine_checks import assert_idle, assert_reference, greedy, packed_forward
from hf_checkpoints import random_token_ids

ROWS = {"prefill_eval_layers": 2, "prefill_eval_min_rows": 16, "prefill_eval_tail": 0, "prefill_eval_first": 0}


def test_groups_run_in_order_and_drain_waits_for_them():
    enc = EncodeThread()
    try:
        with mx.stream(enc.stream):
            a = mx.arange(6, dtype=mx.float32)
            steps = []
            for k in range(5):  # each group reads the one before it
                a = a * 2 + k
                steps.append(a)
                enc.submit(a)
            enc.drain()
        assert enc.groups == 5
        assert np.array(steps[-1]).tolist() == [((((x * 2) * 2 + 1) * 2 + 2) * 2 + 3) * 2 + 4 for x in range(6)]
    finally:
        enc.close()


def test_a_worker_error_is_raised_at_drain_and_drops_the_groups_after_it():
    """An array built on this thread's own stream is one the worker cannot evaluate (MLX: no such stream in
    its thread): the protocol's one way to go wrong, and it raises rather than racing."""
    enc = EncodeThread()
    try:
        enc.submit(mx.ones((3,)) * 2)  # built outside mx.stream(enc.stream)
        with mx.stream(enc.stream):
            later = mx.ones((3,)) * 5
            enc.submit(later)
            with pytest.raises(RuntimeError, match="in current thread"):
                enc.drain()
            assert enc.groups == 0  # neither group counted: the second was dropped, not encoded
            enc.drain()  # the error was handed over once
            enc.submit(later)  # the worker goes on with the next step's groups
            enc.drain()
        assert enc.groups == 1 and np.array(later).tolist() == [5, 5, 5]
    finally:
        enc.close()


def test_scope_routes_groups_to_the_worker_and_restores_everything():
    """Outside a scope eval_group evaluates here (mx.async_eval); inside, on the worker; on exit the worker
    is drained and the switch interval and routing are back, also when the body raises."""
    enc = EncodeThread()
    interval = sys.getswitchinterval()
    wrong = mx.ones((2,)) * 0  # on this thread's stream: the worker raises on it
    try:
        with mx.stream(enc.stream):
            eval_group(mx.ones((2,)))
            assert enc.groups == 0 and not encode_thread.threaded()
            with scope(enc):
                assert encode_thread.threaded() and sys.getswitchinterval() <= encode_thread.SWITCH_INTERVAL_S
                x = mx.full((4,), 3.0)
                eval_group(x)
                eval_group(x + 1)
            assert enc.groups == 2 and not encode_thread.threaded()
            assert sys.getswitchinterval() == interval
            with pytest.raises(KeyError):
                with scope(enc):
                    eval_group(wrong)
                    raise KeyError("built wrong")  # the body's error wins; the worker's is dropped
            assert not encode_thread.threaded() and sys.getswitchinterval() == interval
            with scope(None):  # no encoder: groups evaluate on this thread
                eval_group(mx.ones((2,)))
            assert enc.groups == 2
    finally:
        enc.close()


def test_overlapping_scopes_on_two_threads_restore_the_switch_interval():
    """The first scope to open shortens the interval, the last to close restores it, whatever the order."""
    interval = sys.getswitchinterval()
    encs = [EncodeThread(), EncodeThread()]
    entered, release = threading.Barrier(2), threading.Event()
    inside = []

    def body(enc):
        with mx.stream(enc.stream), scope(enc):
            entered.wait()
            inside.append(sys.getswitchinterval())
            release.wait(5)

    try:
        threads = [threading.Thread(target=body, args=(e,)) for e in encs]
        for t in threads:
            t.start()
        threads[0].join(0.2)  # both are inside
        release.set()
        for t in threads:
            t.join(5)
        assert inside and all(v <= encode_thread.SWITCH_INTERVAL_S for v in inside)
        assert sys.getswitchinterval() == interval
    finally:
        for e in encs:
            e.close()


def test_quiesce_waits_for_the_workers_groups(monkeypatch):
    """quiesce(): nothing outside a scope; inside, it returns once the worker has encoded what it holds."""
    real, done = mx.async_eval, []

    def slow(*arrays):
        time.sleep(0.2)
        real(*arrays)
        done.append(time.perf_counter())

    encode_thread.quiesce()  # no scope: returns at once
    enc = EncodeThread()
    try:
        with mx.stream(enc.stream):
            monkeypatch.setattr(mx, "async_eval", slow)  # the worker looks it up at each group
            with scope(enc):
                eval_group(mx.ones((3,)) * 2)
                encode_thread.quiesce()
                back = time.perf_counter()
                assert done and done[0] <= back and enc._pending == 0
    finally:
        monkeypatch.undo()
        enc.close()


def test_a_kernels_first_use_inside_a_threaded_forward_waits_for_the_worker(model, monkeypatch):
    """A kernel's first use evaluates on the building thread (dispatch.py's check): from layer 5 on, after the
    worker took the groups of layers 1-2 and 3-4, it runs only with the worker idle; the logits are unchanged."""
    from mtlqwen.kernels import dispatch  # noqa: PLC0415

    ids = random_token_ids(19, 500, seed=3)
    want, _ = packed_forward(model, ids, [13, 6])
    layer5, real_layer = model.layers[5], type(model.layers[5]).__call__
    enc = EncodeThread()
    seen = []
    real_quiesce = encode_thread.quiesce

    def spy():
        real_quiesce()
        seen.append((enc.groups, enc._pending))

    def reset_at_5(self, *a, **kw):
        if self is layer5:
            dispatch.reset("add_rms_norm")  # the op's next use (this layer's) is a first use again
        return real_layer(self, *a, **kw)

    monkeypatch.setattr(encode_thread, "quiesce", spy)
    monkeypatch.setattr(type(layer5), "__call__", reset_at_5)
    try:
        fallback = dispatch.OPS["add_rms_norm"].fallback  # as the op's "kernel": it runs on the CPU too
        with mx.stream(enc.stream), selected(ROWS), dispatch.inject("add_rms_norm", fallback):
            got, _ = packed_forward(model, ids, [13, 6], enc)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
        assert any(groups >= 2 for groups, _ in seen) and all(pending == 0 for _, pending in seen)
    finally:
        enc.close()


def test_a_threaded_forward_gives_the_same_logits_and_states(model):
    """8 layers in groups of 2 (threshold 16 rows): the worker evaluates the groups after layers 2, 4, 6 and the
    last one (8), while this thread builds; logits and cache contents equal one evaluation's, bit for bit."""
    ids = random_token_ids(19, 500, seed=2)
    want, want_cache = packed_forward(model, ids, [13, 6])
    enc = EncodeThread()
    try:
        with mx.stream(enc.stream), selected(ROWS):
            got, got_cache = packed_forward(model, ids, [13, 6], enc)
        assert len(model.layers) == 8 and enc.groups == 4
        assert np.array_equal(got, want)
        assert all(np.array_equal(g, w) for g, w in zip(got_cache, want_cache))
    finally:
        enc.close()


def test_engine_outputs_with_the_encoder_thread_are_the_models_own(model):
    """Greedy generations of prompts that prefill in grouped chunks, with prefix-cache hits (a shared prompt),
    equal the single-request reference; the worker evaluated groups; nothing leaks."""
    shared = random_token_ids(40, 500, seed=7)
    prompts = [random_token_ids(n, 500, seed=n) for n in (37, 21, 50)] + [shared + random_token_ids(9, 500, seed=s)
                                                                          for s in (8, 9)]
    with selected(ROWS):
        eng = Engine(model, slots=3, step_tokens=32, block_tokens=8, num_blocks=60, prefix_interval=16,
                     encode_thread=True)
        outs = eng.generate(prompts[:3], greedy(5)) + eng.generate(prompts[3:4], greedy(5))
        outs += eng.generate(prompts[4:], greedy(5))
    assert eng.encoder.groups > 0 and outs[-1].cached_tokens == 32  # the snapshot at 2 x 16 of the shared 40
    for p, o in zip(prompts, outs):
        assert_reference(model, p, o, 5)
    assert_idle(eng)


def test_the_engine_settles_what_the_model_built_lazily(model):
    """An array the model holds unevaluated, built on this thread's stream, is one the worker could not run:
    the engine evaluates every array the model reaches at construction (settle)."""
    lazy = mx.ones((3,)) * 2
    model.layers[0].probe = lazy
    try:
        eng = Engine(model, slots=1, block_tokens=8, num_blocks=8, encode_thread=True)
        with mx.stream(eng.encoder.stream):
            y = lazy * 3
        eng.encoder.submit(y)
        eng.encoder.drain()  # "no Stream(...) in current thread" if `lazy` were still a graph
        assert np.array(y).tolist() == [6.0, 6.0, 6.0]
    finally:
        del model.layers[0].probe


def test_the_worker_ends_with_its_engine(model):
    eng = Engine(model, slots=1, block_tokens=8, num_blocks=8, encode_thread=True)
    name = eng.encoder._thread.name
    assert any(t.name == name and t.is_alive() for t in threading.enumerate())
    thread = eng.encoder._thread
    del eng
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_config_checks():
    assert EngineConfig().encode_thread is None
    with pytest.raises(ValueError, match="encode_thread must be true or false"):
        EngineConfig(encode_thread="yes")
    with pytest.raises(ValueError, match="without a drafter"):
        EngineConfig(encode_thread=True, draft="some/drafter")


def test_the_server_flag_reaches_the_engine():
    """serve --encode-thread turns it on; left out, the engine's default stands."""
    from mtlqwen.cli import build_parser  # noqa: PLC0415
    from mtlqwen.frontends.server import _engine_kwargs  # noqa: PLC0415

    parser = build_parser()
    assert "encode_thread" not in _engine_kwargs(parser.parse_args(["serve"]))
    assert _engine_kwargs(parser.parse_args(["serve", "--encode-thread"]))["encode_thread"] is True
