"""Paged decode attention: the reference against dense numpy attention (CPU), the kernel against the
reference (GPU). Random block tables (shuffled, with unused and garbage blocks), odd context lengths,
contexts ending on / just past block boundaries, empty last blocks, GQA 1/2/4, 1..5 query tokens per
sequence, several sequences packed, bf16 and fp32, single-pass and split-context paths, gated output."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels.attention import paged_attention_gated_ref, paged_attention_ref
from mtlqwen.kernels.seqs import SeqLayout

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu

TOL = {mx.float32: 1e-4, mx.bfloat16: 1.5e-2}


def make_batch(rng, bt, nkv, rep, hd, past, qlens, dtype, extra_blocks=3):
    """Pools with every block filled with random data (unused blocks are garbage the kernel must skip),
    a shuffled block table per sequence (one spare, empty block at its end when `extra` is drawn)."""
    need = [(p + t + bt - 1) // bt for p, t in zip(past, qlens)]
    spare = [int(rng.integers(0, 2)) for _ in past]
    nblocks = sum(need) + sum(spare) + extra_blocks
    ids = rng.permutation(nblocks).tolist()
    tables, o = [], 0
    for n, s in zip(need, spare):
        tables.append(ids[o:o + n + s])
        o += n + s
    k_pool = mx.array(rng.standard_normal((nblocks, bt, nkv, hd)).astype(np.float32)).astype(dtype)
    v_pool = mx.array(rng.standard_normal((nblocks, bt, nkv, hd)).astype(np.float32)).astype(dtype)
    qsl = [0]
    for t in qlens:
        qsl.append(qsl[-1] + t)
    layout = SeqLayout(query_start_loc=qsl, kv_valid=list(past), block_tables=tables,
                       state_rows=list(range(len(past))), block_tokens=bt)
    q = mx.array(rng.standard_normal((qsl[-1], nkv * rep, hd)).astype(np.float32)).astype(dtype)
    return q, k_pool, v_pool, layout


def dense_attention(q, k_pool, v_pool, layout, scale) -> np.ndarray:
    """Plain numpy: gather each sequence's keys through its table, causal softmax per query token."""
    q, kp, vp = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k_pool, v_pool))
    nH, nKV = q.shape[1], kp.shape[2]
    out = np.zeros_like(q)
    bt = layout.block_tokens
    for i in range(layout.num_seqs):
        s0, past = layout.query_start_loc[i], layout.kv_valid[i]
        for t in range(layout.q_len(i)):
            L = past + t + 1
            pos = np.arange(L)
            blocks = np.array(layout.block_tables[i])[pos // bt]
            for h in range(nH):
                g = h // (nH // nKV)
                k, v = kp[blocks, pos % bt, g], vp[blocks, pos % bt, g]
                s = k @ q[s0 + t, h] * scale
                p = np.exp(s - s.max())
                out[s0 + t, h] = p @ v / p.sum()
    return out


def rel_err(out, ref) -> float:
    out = np.array(out.astype(mx.float32))
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def contexts(bt):
    """Context lengths around the interesting places: empty, odd, block boundaries (+-1), several blocks."""
    return st.one_of(st.sampled_from([0, 1, bt - 1, bt, bt + 1, 2 * bt - 1, 2 * bt, 3 * bt + 1]),
                     st.integers(0, 5 * bt))


def drawn_batch(data, bt, nkv, rep, hd, nseq, dtype: str, seed: int):
    """A GPU test's batch: kernel outputs poisoned, contexts and 1-5 query tokens per sequence drawn."""
    from mtlqwen.kernels.attention import kernels as pa  # noqa: PLC0415

    pa.POISON = float("nan")
    dt = {"bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    rng = np.random.default_rng(seed)
    past = [data.draw(contexts(bt)) for _ in range(nseq)]
    qlens = [data.draw(st.integers(1, 5)) for _ in range(nseq)]
    return rng, dt, make_batch(rng, bt, nkv, rep, hd, past, qlens, dt)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), bt=st.sampled_from([4, 16]), nkv=st.integers(1, 2), rep=st.sampled_from([1, 2, 4]),
       nseq=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_reference_matches_dense_attention(data, bt, nkv, rep, nseq, seed):
    rng = np.random.default_rng(seed)
    past = [data.draw(contexts(bt)) for _ in range(nseq)]
    qlens = [data.draw(st.integers(1, 5)) for _ in range(nseq)]
    q, kp, vp, layout = make_batch(rng, bt, nkv, rep, 8, past, qlens, mx.float32)
    out = paged_attention_ref(q, kp, vp, layout, 8**-0.5)
    assert rel_err(out, dense_attention(q, kp, vp, layout, 8**-0.5)) < 1e-5


def test_gated_reference_is_attention_times_sigmoid():
    rng = np.random.default_rng(1)
    q, kp, vp, layout = make_batch(rng, 4, 2, 2, 8, [5, 9], [2, 1], mx.float32)
    gate = mx.array(rng.standard_normal((3, 4 * 8)).astype(np.float32))
    want = dense_attention(q, kp, vp, layout, 0.3) / (1 + np.exp(-np.array(gate).reshape(3, 4, 8)))
    assert rel_err(paged_attention_gated_ref(q, kp, vp, layout, 0.3, gate), want) < 1e-5
    # the q|gate projection [T, nH, 2*hd] as the gate: each head's second half gates
    qg = mx.concatenate([mx.zeros((3, 4, 8)), gate.reshape(3, 4, 8)], axis=-1)
    assert rel_err(paged_attention_gated_ref(q, kp, vp, layout, 0.3, qg), want) < 1e-5


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(40), **GPU_SETTINGS)
@given(data=st.data(), bt=st.sampled_from([16, 128]), nkv=st.integers(1, 2), rep=st.sampled_from([1, 2, 4]),
       hd=st.sampled_from([64, 128, 256]), nseq=st.integers(1, 4), dtype=st.sampled_from(["bfloat16", "float32"]),
       splits=st.sampled_from([None, 1, 3, 8]), gated=st.sampled_from([0, 1, 2]), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_reference(data, bt, nkv, rep, hd, nseq, dtype, splits, gated, seed):
    """gated: 0 no gate, 1 a compact gate [T, nH*hd], 2 the q|gate projection [T, nH, 2*hd] read in place."""
    from mtlqwen.kernels.attention import kernels as pa  # noqa: PLC0415
    rng, dt, (q, kp, vp, layout) = drawn_batch(data, bt, nkv, rep, hd, nseq, dtype, seed)
    scale = hd**-0.5
    gate = mx.array(rng.standard_normal((q.shape[0], q.shape[1] * hd)).astype(np.float32)).astype(dt) if gated else None
    if gated == 2:
        gate = mx.concatenate([mx.array(rng.standard_normal(q.shape).astype(np.float32)).astype(dt),
                               gate.reshape(q.shape)], axis=-1)
    out = pa.paged_attention_gpu(q, kp, vp, layout, scale, gate=gate, splits=splits)
    assert out is not None and out.shape == q.shape and out.dtype == dt
    with mx.stream(mx.cpu):  # the GPU's fp32 matmuls may use TF32 (~3e-4): keep the reference exact
        ref = (paged_attention_gated_ref(q, kp, vp, layout, scale, gate) if gated
               else paged_attention_ref(q, kp, vp, layout, scale))
        ref = np.array(ref.astype(mx.float32))
    assert rel_err(out, ref) < TOL[dt]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(25), **GPU_SETTINGS)
@given(data=st.data(), bt=st.sampled_from([16, 128]), nkv=st.integers(1, 4), rep=st.sampled_from([1, 2, 4]),
       hd=st.sampled_from([64, 128, 256]), nseq=st.integers(1, 4), dtype=st.sampled_from(["bfloat16", "float32"]),
       splits=st.sampled_from([None, 1, 3]), seed=st.integers(0, 2**31 - 1))
def test_inplace_kv_write_then_attention_matches_functional(data, bt, nkv, rep, hd, nseq, dtype, splits, seed):
    """write_kv_inplace + attention ordered after it (one evaluation) == the functional scatter +
    reference; every pool element outside the written slots is unchanged."""
    from mtlqwen.kernels.attention import kernels as pa  # noqa: PLC0415
    from mtlqwen.kernels.attention.kv_write import write_kv_inplace_kernel  # noqa: PLC0415
    from mtlqwen.kernels.attention import write_kv  # noqa: PLC0415

    rng, dt, (q, kp, vp, layout) = drawn_batch(data, bt, nkv, rep, hd, nseq, dtype, seed)
    T = q.shape[0]
    k = mx.array(rng.standard_normal((T, nkv, hd)).astype(np.float32)).astype(dt)
    v = mx.array(rng.standard_normal((T, nkv, hd)).astype(np.float32)).astype(dt)
    with mx.stream(mx.cpu):  # functional reference on copies of the pools
        rk, rv = write_kv(kp + 0, vp + 0, k, v, layout)  # new buffers: the kernel below writes kp, vp
        ref = np.array(paged_attention_ref(q, rk, rv, layout, hd**-0.5).astype(mx.float32))
        rk, rv = np.array(rk.astype(mx.float32)), np.array(rv.astype(mx.float32))
    done = write_kv_inplace_kernel(kp, vp, k, v, layout)
    out = pa.paged_attention_gpu(q, kp, vp, layout, hd**-0.5, splits=splits, after=done)
    mx.eval(out)
    assert rel_err(out, ref) < TOL[dt]
    assert np.array_equal(np.array(kp.astype(mx.float32)), rk) and np.array_equal(np.array(vp.astype(mx.float32)), rv)


def test_traced_reference_equals_the_reference():
    """The compile-safe reference (padded block tables, keys masked by kv_valid) == the exact-length one."""
    from mtlqwen.kernels.attention.reference import _paged_attention_traced  # noqa: PLC0415

    rng = np.random.default_rng()
    q, kp, vp, layout = make_batch(rng, 16, 2, 2, 64, [0, 17, 40], [1, 1, 3], mx.float32)
    width = max(len(t) for t in layout.block_tables) + 2
    layout._arrays["block_tables"] = mx.array([t + [0] * (width - len(t)) for t in layout.block_tables])
    want = dense_attention(q, kp, vp, layout, 0.2)
    assert rel_err(_paged_attention_traced(q, kp, vp, layout, 0.2), want) < 1e-5
