"""Runtime safety of the dispatch layer (kernels/dispatch.py), on the CPU through injected fake kernels: a
kernel that fails to build or launch, or (self-check on) disagrees with its reference, is switched off with
one warning and its op runs the fallback; a request through the Engine still returns the reference's
tokens."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from mtlqwen.kernels import dispatch, rms_norm
from mtlqwen.kernels.norms import rms_norm_ref
from mtlqwen.runtime import Engine

from engine_checks import greedy
from hf_checkpoints import random_token_ids

PROMPTS = [random_token_ids(n, 512, seed=n) for n in (19, 6, 41)]


class FakeKernel:
    """A kernel object for the dispatch layer: counts its calls; `build_error` raises as a failed build
    would; otherwise returns the reference's result times `factor` (1: a correct kernel)."""

    def __init__(self, ref, factor: float = 1.0, build_error: bool = False):
        self.ref, self.factor, self.build_error, self.calls = ref, factor, build_error, 0

    def __call__(self, *args):
        self.calls += 1
        if self.build_error:
            raise RuntimeError("[metal_kernel] Unable to build metal library from source")
        return self.ref(*args) * self.factor


def kernel_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mtlqwen.kernels" and r.levelno == logging.WARNING]


def run_engine(model, compile_decode: bool) -> list[list[int]]:
    eng = Engine(model, slots=2, step_tokens=32, block_tokens=16, num_blocks=24, compile_decode=compile_decode)
    outs = eng.generate(PROMPTS, greedy(6))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference_tokens(model):
    return run_engine(model, compile_decode=False)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_a_kernel_that_fails_to_build_leaves_the_request_on_the_reference(model, reference_tokens, caplog,
                                                                          compile_decode):
    fake = FakeKernel(rms_norm_ref, build_error=True)
    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"), dispatch.inject("rms_norm", fake) as op:
        tokens = run_engine(model, compile_decode)
        assert op.failed is not None and "failed to build or launch" in op.failed
    assert tokens == reference_tokens
    assert fake.calls == 1  # switched off after its first failure: every later call took the fallback
    (warning,) = kernel_warnings(caplog)
    assert "'rms_norm'" in warning and "Unable to build metal library" in warning


@pytest.mark.parametrize("compile_decode", [False, True])
def test_a_wrong_kernel_is_caught_by_its_first_use_check(model, reference_tokens, caplog, monkeypatch,
                                                         compile_decode):
    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "1")
    fake = FakeKernel(rms_norm_ref, factor=1.5)
    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"), dispatch.inject("rms_norm", fake) as op:
        tokens = run_engine(model, compile_decode)
        assert op.failed is not None and "disagrees with its reference" in op.failed
    assert tokens == reference_tokens
    assert fake.calls == 1
    (warning,) = kernel_warnings(caplog)
    assert "'rms_norm'" in warning and "relative error 0.5" in warning


def _case(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    w = mx.array(1 + 0.1 * rng.standard_normal(64).astype(np.float32))
    return x, w


def test_a_correct_kernel_is_checked_once_then_trusted(caplog, monkeypatch):
    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "1")
    x, w = _case()
    fake = FakeKernel(lambda *a: rms_norm_ref(*a) + 1e-6)  # within the check's tolerance, not the reference
    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"), dispatch.inject("rms_norm", fake) as op:
        for _ in range(3):
            out = rms_norm(x, w, 1e-6)
            assert mx.array_equal(out, rms_norm_ref(x, w, 1e-6) + 1e-6).item()  # the kernel's result
        assert op.failed is None and len(op.checked) == 1
    assert fake.calls == 3 and kernel_warnings(caplog) == []


@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_first_use_inside_a_compile_trace_checks_a_concrete_copy(caplog, monkeypatch, factor):
    """Nothing derived from a traced input can be evaluated: the check runs the kernel and the reference on
    random inputs of the same shapes; a wrong kernel is switched off and the trace records the fallback."""
    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "1")
    x, w = _case(1)
    fake = FakeKernel(rms_norm_ref, factor=factor)
    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"), dispatch.inject("rms_norm", fake) as op:
        out = mx.compile(lambda a: rms_norm(a, w, 1e-6))(x)
        assert (op.failed is None) == (factor == 1.0)
    assert fake.calls == 2  # the traced call and its concrete probe
    ref = rms_norm_ref(x, w, 1e-6)
    assert float(mx.max(mx.abs(out - ref)).item()) <= 1e-6  # right either way: the kernel, or the fallback
    assert len(kernel_warnings(caplog)) == (0 if factor == 1.0 else 1)


def test_self_check_defaults_to_the_unverified_back_ends(monkeypatch):
    monkeypatch.delenv("MTLQWEN_SELF_CHECK", raising=False)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "metal")
    assert dispatch.self_check()
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    assert not dispatch.self_check()
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "metal")
    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "0")
    assert not dispatch.self_check()


def test_an_op_unverified_on_a_verified_back_end_checks_itself(monkeypatch):
    """An op's own `unverified` back-ends self-check its kernel although the back-end is verified (a kernel
    newer than the last GPU run); the env override still wins; kernel_op records the marker on the op."""
    monkeypatch.delenv("MTLQWEN_SELF_CHECK", raising=False)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    assert dispatch.self_check(("cuda",)) and not dispatch.self_check(("metal",))
    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "0")
    assert not dispatch.self_check(("cuda",))

    @dispatch.kernel_op("test_fresh_kernel", None, unverified=("cuda",))
    def fresh(x):
        return x

    try:
        assert dispatch.OPS["test_fresh_kernel"].unverified == ("cuda",)
        assert dispatch.OPS["rms_norm"].unverified == ()
    finally:
        del dispatch.OPS["test_fresh_kernel"]


def test_a_kernel_that_declines_a_shape_is_not_switched_off(caplog):
    x, w = _case(2)
    calls = []
    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"), \
            dispatch.inject("rms_norm", lambda *a: calls.append(a) and None) as op:
        out = rms_norm(x, w, 1e-6)
        assert op.failed is None
    assert len(calls) == 1 and mx.array_equal(out, rms_norm_ref(x, w, 1e-6)).item()
    assert kernel_warnings(caplog) == []


def test_inject_refuses_an_unknown_op():
    with pytest.raises(KeyError, match="no op 'rms_nrom'"), dispatch.inject("rms_nrom", lambda *a: None):
        pass


@pytest.fixture
def metal_rms(monkeypatch):
    """The real rms_norm kernel path on a pretend Metal back-end whose compiled kernel is a stand-in (the
    reference's rows, times `factor[D]`): what the dispatcher sees of PortableKernel launches."""
    from mtlqwen.kernels.norms import kernels as nk  # noqa: PLC0415

    monkeypatch.setattr(nk, "gpu_backend", lambda: "metal")
    launches, factor = [], {}

    def compiled(inputs, template, **kw):
        launches.append(dict(template)["D"])
        x, w, eps = inputs
        return [rms_norm_ref(x, w, float(eps[0].item())) * factor.get(x.shape[-1], 1.0)]

    monkeypatch.setattr(nk.RMS, "build", lambda backend: compiled)
    with dispatch.inject("rms_norm", nk.rms_norm_kernel) as op:
        yield op, launches, factor


def test_each_instantiation_is_checked_once(metal_rms, caplog, monkeypatch):
    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "1")
    op, launches, factor = metal_rms
    factor[2048] = 2.0  # the D=2048 instantiation (256 threads a row) is wrong, the D=64 one right
    rng = np.random.default_rng(3)
    w64, w2k = (mx.array(rng.standard_normal(d).astype(np.float32)) for d in (64, 2048))
    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"):
        for rows in (3, 5):  # one instantiation (rows come from x_shape): checked at the first call only
            x = mx.array(rng.standard_normal((rows, 64)).astype(np.float32))
            assert mx.allclose(rms_norm(x, w64, 1e-6), rms_norm_ref(x, w64, 1e-6)).item()
        assert op.failed is None and [k[0] for k in op.checked] == ["rms_norm"] and launches == [64, 64]
        x = mx.array(rng.standard_normal((2, 2048)).astype(np.float32))
        assert mx.array_equal(rms_norm(x, w2k, 1e-6), rms_norm_ref(x, w2k, 1e-6)).item()
    assert op.failed is not None and launches == [64, 64, 2048]
    (warning,) = kernel_warnings(caplog)
    assert "'rms_norm'" in warning and "relative error 1" in warning


def test_a_real_portable_kernel_that_cannot_build_falls_back(caplog):
    """No stand-in: on the CPU, MLX refuses to build a Metal kernel -- a genuine build failure."""
    from mtlqwen.kernels.norms import kernels as nk  # noqa: PLC0415

    x, w = _case(4)
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"):
        mp.setattr(nk, "gpu_backend", lambda: "metal")
        with dispatch.inject("rms_norm", nk.rms_norm_kernel) as op:
            out = rms_norm(x, w, 1e-6)
            assert op.failed is not None
    assert mx.array_equal(out, rms_norm_ref(x, w, 1e-6)).item()
    (warning,) = kernel_warnings(caplog)
    assert "'rms_norm'" in warning and "metal_kernel" in warning


@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_the_trace_probe_of_a_paged_op_is_concrete_and_small(caplog, monkeypatch, factor):
    """A traced attention call's probe: a concrete layout (empty contexts, one pool row per sequence), pools
    cut to those rows; the kernel is judged on it against the reference."""
    from mtlqwen.kernels import SeqLayout, paged_attention  # noqa: PLC0415
    from mtlqwen.kernels.attention import paged_attention_ref  # noqa: PLC0415

    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "1")
    seen = []

    def fake(q, k_pool, v_pool, layout, scale, after=None):
        seen.append((layout.traced, k_pool.shape[0]))
        return paged_attention_ref(q, k_pool, v_pool, layout, scale) * factor

    rng = np.random.default_rng(5)
    B, bt, nblocks = 2, 16, 9
    kp, vp = (mx.array(rng.standard_normal((nblocks, bt, 2, 32)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((B, 4, 32)).astype(np.float32))
    real = SeqLayout([0, 1, 2], [20, 5], [[3, 4], [7]], [0, 1], bt)

    def step(q, kp, vp, kv_valid, tables):
        lay = SeqLayout([0, 1, 2], [0] * B, [[0, 0]] * B, [0] * B, bt, max_len=32, traced=True)
        lay._arrays.update(kv_valid=kv_valid, block_tables=tables)
        return paged_attention(q, kp, vp, lay, 0.25)

    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"), dispatch.inject("paged_attention", fake) as op:
        out = mx.compile(step)(q, kp, vp, real.array("kv_valid"), real.array("block_tables"))
        assert (op.failed is None) == (factor == 1.0)
    assert seen == [(True, nblocks), (False, B)]  # the traced call, then its probe
    assert mx.allclose(out, paged_attention_ref(q, kp, vp, real, 0.25) * factor, atol=1e-5).item() == (factor == 1.0)
    if factor != 1.0:  # switched off: the trace recorded the reference
        assert mx.allclose(out, paged_attention_ref(q, kp, vp, real, 0.25), atol=1e-5).item()
    assert len(kernel_warnings(caplog)) == (0 if factor == 1.0 else 1)


def test_the_trace_probe_of_a_long_chunk_has_blocks_for_its_tokens(caplog, monkeypatch):
    """A traced write of more rows than one block holds, under a dummy one-block table (the drafter's
    context write builds its layout so: only the arrays are real): the probe's concrete layout gives the
    sequence a table wide enough for its tokens, each entry its own block (an in-place write of one block's
    rows must not land on another's)."""
    from mtlqwen.kernels import SeqLayout, write_kv_inplace  # noqa: PLC0415

    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "1")
    seen = []

    def fake(k_pool, v_pool, k, v, layout, q_shape, q_dtype):
        seen.append((layout.traced, layout.array("write_blocks").tolist() if not layout.traced else None))
        return mx.ones((1,), dtype=mx.int32)

    bt, T = 4, 11
    kp, vp = (mx.zeros((5, bt, 1, 8)) for _ in range(2))
    k = mx.ones((T, 1, 8))

    def step(k, blocks, offsets):
        lay = SeqLayout([0, T], [0], [[0]], [0], bt, traced=True)
        lay._arrays.update(write_blocks=blocks, write_offsets=offsets)
        return write_kv_inplace(kp, vp, k, k, lay, (T, 2, 8), k.dtype)

    pos = mx.arange(T, dtype=mx.int32)
    with caplog.at_level(logging.WARNING, logger="mtlqwen.kernels"), dispatch.inject("write_kv_inplace", fake) as op:
        mx.eval(mx.compile(step)(k, pos // bt + 1, pos % bt))
        assert op.failed is None
    assert seen == [(True, None), (False, [0] * 4 + [1] * 4 + [2] * 3)]  # the traced call, then its probe: 3 blocks
    assert kernel_warnings(caplog) == []


def test_every_op_is_exported_and_dispatched():
    """Each op registered with the dispatcher is a public name of mtlqwen.kernels, and nothing calls a
    kernel around it (the exported function is the dispatching one)."""
    import mtlqwen.kernels as K  # noqa: PLC0415

    exported = {getattr(K, n).op.name: n for n in K.__all__ if hasattr(getattr(K, n), "op")}
    assert set(exported) == set(dispatch.OPS), set(dispatch.OPS) ^ set(exported)
    for name, public in exported.items():
        assert getattr(K, public).op is dispatch.OPS[name]
