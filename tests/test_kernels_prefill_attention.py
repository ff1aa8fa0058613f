"""Prefill attention over paged KV: the tensor-core kernel (attention/prefill.py, CUDA) against the reference
(GPU), the reference on prefill-sized chunks against dense numpy attention (CPU), and which kernel a batch
dispatches to. Packed batches of several sequences with different cached lengths, chunks crossing block and
tile boundaries, 1-query decode rows mixed in, GQA 1/2/4/8, head dims 64/128/256, bf16 and fp16, gated
output (compact gate or the q|gate projection read in place), outputs poisoned before the kernel writes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import dispatch, portable
from mtlqwen.kernels.attention import ops, paged_attention_gated, paged_attention_gated_ref, paged_attention_ref
from mtlqwen.kernels.attention import prefill
from mtlqwen.kernels.selection import SELECT, selected
from mtlqwen.kernels.seqs import SeqLayout

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu
from test_kernels_attention import contexts, dense_attention, make_batch, rel_err

DT = {"bfloat16": mx.bfloat16, "float16": mx.float16}
TOL = {mx.bfloat16: 1.5e-2, mx.float16: 5e-3}  # P is rounded to the 16-bit type before P.V


def chunk_lengths():
    """Query chunk lengths around the kernel's tiles (64 query rows = 64 / GQA tokens) and 64-key tiles, and
    the 4-16 queries (verification rows) the measured crossover would give it."""
    return st.one_of(st.sampled_from([4, 7, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200]), st.integers(4, 300))


def gate_for(rng, q, gated: int, dt):
    """0: no gate; 1: compact [T, nH*hd]; 2: the q|gate projection [T, nH, 2*hd] (gate = second halves)."""
    if not gated:
        return None
    g = mx.array(rng.standard_normal((q.shape[0], q.shape[1] * q.shape[2])).astype(np.float32)).astype(dt)
    if gated == 1:
        return g
    return mx.concatenate([mx.array(rng.standard_normal(q.shape).astype(np.float32)).astype(dt),
                           g.reshape(q.shape)], axis=-1)


def reference(q, kp, vp, layout, scale, gate):
    with mx.stream(mx.cpu):
        ref = (paged_attention_gated_ref(q, kp, vp, layout, scale, gate) if gate is not None
               else paged_attention_ref(q, kp, vp, layout, scale))
        return np.array(ref.astype(mx.float32))


@settings(max_examples=8, deadline=None)
@given(data=st.data(), bt=st.sampled_from([4, 16]), rep=st.sampled_from([1, 2, 4]), nseq=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
def test_reference_matches_dense_attention_on_prefill_chunks(data, bt, rep, nseq, seed):
    """What the kernel is held to: the reference on chunks of 17+ queries, several sequences, causal."""
    rng = np.random.default_rng(seed)
    past = [data.draw(contexts(bt)) for _ in range(nseq)]
    qlens = [data.draw(st.integers(17, 70)) for _ in range(nseq)]
    q, kp, vp, layout = make_batch(rng, bt, 1, rep, 8, past, qlens, mx.float32)
    assert rel_err(paged_attention_ref(q, kp, vp, layout, 8**-0.5), dense_attention(q, kp, vp, layout, 8**-0.5)) < 1e-5


def _layout(qlens, traced=False):
    n = len(qlens)
    qsl = [0] + list(np.cumsum(qlens).tolist())
    return SeqLayout(qsl, [5] * n, [[0, 1]] * n, list(range(n)), 16, traced=traced)


def test_dispatch_by_queries_per_sequence(monkeypatch):
    """On CUDA: the prefill kernel once some sequence has more than prefill_attn_min_queries queries (the
    whole batch, 1-query rows included), the decode kernel for decode / verification rows, fp32 and traced
    layouts; never on another back-end."""
    monkeypatch.setattr(ops, "gpu_backend", lambda: "cuda")
    pool = mx.zeros((2, 16, 2, 64), dtype=mx.bfloat16)
    lim = SELECT["prefill_attn_min_queries"]

    def uses(qlens, dt=mx.bfloat16, traced=False, p=pool):
        return ops.uses_prefill_kernel((sum(qlens), 8, 64), dt, p, p, _layout(qlens, traced))

    assert not uses([1] * 8) and not uses([lim, 1, 3])
    assert uses([lim + 1]) and uses([1, lim + 1, 1]) and uses([1024])
    assert not uses([1024], dt=mx.float32, p=pool.astype(mx.float32))  # the decode kernel takes fp32
    assert not uses([1024], traced=True)
    with selected({"prefill_attn_min_queries": 1024}):
        assert not uses([1024]) and uses([1025])
    with selected({"prefill_attn_min_queries": 0}):  # off
        assert not uses([1025])
    monkeypatch.setattr(ops, "gpu_backend", lambda: "metal")
    assert not uses([1024])


def test_prefill_covers():
    pool = mx.zeros((2, 16, 2, 256), dtype=mx.float16)
    lay = _layout([40])
    assert prefill.covers((40, 8, 256), mx.float16, pool, pool, lay)
    assert not prefill.covers((40, 8, 256), mx.bfloat16, pool, pool, lay)  # q and pool dtypes differ
    assert not prefill.covers((40, 6, 256), mx.float16, pool, pool, lay)   # 3 heads per KV head: 64 % 3
    p96 = mx.zeros((2, 16, 2, 96), dtype=mx.float16)
    assert not prefill.covers((40, 8, 96), mx.float16, p96, p96, lay)


def test_key_split_plan():
    """Splits only when the blocks with work would fill at most half the SMs, into at most one wave, each
    split a whole number of 64-key tiles of at least prefill_attn_split_keys keys, covering the longest
    context exactly once."""
    one = _layout([1024])
    one.kv_valid = [31 * 1024]
    assert prefill.plan(one, 4, 32, 8) == (1, 32 * 1024)  # 128 blocks: already about a wave at 8 warps
    assert prefill.plan(one, 4, 64, 4) == (4, 8 * 1024)  # 64 blocks of 4 warps, 264 resident: 4 splits
    assert prefill.plan(one, 1, 64, 4)[0] == 16  # 16 blocks: 16 splits
    short = _layout([40])
    short.kv_valid = [65536 - 40]
    ns, cs = prefill.plan(short, 4, 32, 8)  # 8 blocks over 64k keys
    assert ns > 1 and cs % prefill.KEYS == 0 and cs >= SELECT["prefill_attn_split_keys"]
    assert (ns - 1) * cs < 65536 <= ns * cs and 8 * ns <= prefill.NUM_SMS
    # decode rows beside a chunk: 1 tile each, not the chunk's 4 (the grid's other blocks exit at once)
    mixed = _layout([120] + [1] * 8)
    mixed.kv_valid = [32768] * 9
    assert prefill.plan(mixed, 4, 32, 8)[0] == prefill.NUM_SMS // (4 * (4 + 8))
    small = _layout([40])  # 45 keys: nothing to split
    assert prefill.plan(small, 4, 32, 8)[0] == 1
    with selected({"prefill_attn_split_keys": 0}):
        assert prefill.plan(short, 4, 32, 8)[0] == 1


@pytest.fixture
def poisoned():
    prefill.POISON = float("nan")
    yield
    prefill.POISON = None


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(60), **GPU_SETTINGS)
@given(data=st.data(), bt=st.sampled_from([16, 128]), nkv=st.integers(1, 2), rep=st.sampled_from([1, 2, 4, 8]),
       hd=st.sampled_from([64, 128, 256]), nseq=st.integers(1, 3), decode_rows=st.integers(0, 2),
       dtype=st.sampled_from(["bfloat16", "float16"]), gated=st.sampled_from([0, 1, 2]),
       splits=st.sampled_from([None, 1, 3, 8]), nw=st.sampled_from([4, 8]), seed=st.integers(0, 2**31 - 1))
def test_prefill_kernel_matches_reference(poisoned, data, bt, nkv, rep, hd, nseq, decode_rows, dtype, gated, splits,
                                          nw, seed):
    """splits: None the plan's, else forced (partials merged by the decode kernel's merge); nw: warps a block."""
    if ops.gpu_backend() != "cuda":
        pytest.skip("the tensor-core prefill kernel is CUDA-only (Metal: the decode kernel serves prefill)")
    dt = DT[dtype]
    rng = np.random.default_rng(seed)
    past = [data.draw(contexts(bt)) for _ in range(nseq + decode_rows)]
    qlens = [data.draw(chunk_lengths()) for _ in range(nseq)] + [1] * decode_rows
    order = rng.permutation(len(qlens))  # decode rows anywhere in the packed batch
    past, qlens = [past[i] for i in order], [qlens[i] for i in order]
    q, kp, vp, layout = make_batch(rng, bt, nkv, rep, hd, past, qlens, dt)
    scale = hd**-0.5
    gate = gate_for(rng, q, gated, dt)
    out = prefill.prefill_attention_gpu(q, kp, vp, layout, scale, gate=gate, splits=splits, nw=nw)
    assert out is not None and out.shape == q.shape and out.dtype == dt
    assert rel_err(out, reference(q, kp, vp, layout, scale, gate)) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(12), **GPU_SETTINGS)
@given(data=st.data(), hd=st.sampled_from([128, 256]), dtype=st.sampled_from(["bfloat16", "float16"]),
       seed=st.integers(0, 2**31 - 1))
def test_op_dispatches_prefill_chunks_to_the_prefill_kernel(poisoned, data, hd, dtype, seed):
    """paged_attention_gated over a batch past the crossover launches the prefill kernel (CUDA) and matches
    the reference; at the crossover it launches the decode kernel."""
    if ops.gpu_backend() != "cuda":
        pytest.skip("the tensor-core prefill kernel is CUDA-only (Metal: the decode kernel serves prefill)")
    dt = DT[dtype]
    rng = np.random.default_rng(seed)
    lim = SELECT["prefill_attn_min_queries"]
    for qlens, want in (([lim + 1 + data.draw(st.integers(0, 200)), 1], "mtl_prefill_attn"),
                        ([lim, 3], "mtl_paged_attn")):
        past = [data.draw(contexts(128)) for _ in qlens]
        q, kp, vp, layout = make_batch(rng, 128, 4, 4, hd, past, qlens, dt)
        gate = gate_for(rng, q, 2, dt)
        dispatch.reset("paged_attention_gated")
        out = paged_attention_gated(q, kp, vp, layout, hd**-0.5, gate)
        mx.eval(out)
        names = {k[0] for k in dispatch.OPS["paged_attention_gated"].checked if isinstance(k, tuple)}
        assert any(n.startswith(want) for n in names), names
        assert rel_err(out, reference(q, kp, vp, layout, hd**-0.5, gate)) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(12), **GPU_SETTINGS)
@given(data=st.data(), rep=st.sampled_from([2, 4]), dtype=st.sampled_from(["bfloat16", "float16"]),
       seed=st.integers(0, 2**31 - 1))
def test_inplace_kv_write_then_prefill_attention(poisoned, data, rep, dtype, seed):
    """write_kv_inplace + the prefill kernel ordered after it (one evaluation) == the functional scatter +
    reference: the chunk's own keys are read from the pools the write just filled."""
    if ops.gpu_backend() != "cuda":
        pytest.skip("the tensor-core prefill kernel is CUDA-only")
    from mtlqwen.kernels.attention import write_kv  # noqa: PLC0415
    from mtlqwen.kernels.attention.kv_write import write_kv_inplace_kernel  # noqa: PLC0415

    dt = DT[dtype]
    rng = np.random.default_rng(seed)
    past = [data.draw(contexts(128)) for _ in range(2)]
    qlens = [data.draw(chunk_lengths()) for _ in range(2)]
    q, kp, vp, layout = make_batch(rng, 128, 2, rep, 256, past, qlens, dt)
    T = q.shape[0]
    k, v = (mx.array(rng.standard_normal((T, 2, 256)).astype(np.float32)).astype(dt) for _ in range(2))
    with mx.stream(mx.cpu):
        rk, rv = write_kv(kp + 0, vp + 0, k, v, layout)
        ref = np.array(paged_attention_ref(q, rk, rv, layout, 256**-0.5).astype(mx.float32))
    done = write_kv_inplace_kernel(kp, vp, k, v, layout)
    out = prefill.prefill_attention_gpu(q, kp, vp, layout, 256**-0.5, after=done)
    mx.eval(out)
    assert rel_err(out, ref) < TOL[dt]


def test_cuda_rendering_is_in_check_cuda_set():
    """check_cuda compiles every instantiation prefill.examples() declares (the 9B shape among them)."""
    from mtlqwen.kernels import check_cuda  # noqa: PLC0415

    labels = [j[0] for j in check_cuda.cuda_only_jobs()]
    assert sum(lab.startswith("mtl_prefill_attn") for lab in labels) == len(prefill.examples())
    tmpl = [dict(ex.template) for _, ex in prefill.examples()]
    assert {"TQ": mx.bfloat16, "HD": 256, "REP": 4, "BT": 128} in [
        {k: t[k] for k in ("TQ", "HD", "REP", "BT")} for t in tmpl]
    assert portable.REGISTRY.keys().isdisjoint(k.name for k, _ in prefill.examples())  # CUDA-only: no Metal twin
