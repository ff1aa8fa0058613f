"""The attention layer's q / k norm + RoPE and in-place KV write in one launch (attention/prep.py).

CPU: the op's fallback is the three ops it replaces (q and k exactly the references', no token: the caller
writes functionally). Metal emulator and GPU: q and k against the references, the pools after the launch
exactly the functional write of the launch's own k and the new v (every other element unchanged), outputs
poisoned; random GQA ratios, head dims, rotary dims, block sizes, contexts ending on block boundaries,
several sequences, bf16 and fp32.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels.attention import attention_prep, write_kv
from mtlqwen.kernels.rope.reference import RopeTables, head_norm_rope_ref

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu
from test_kernels_attention import contexts, make_batch

TOL = {mx.float32: 1e-5, mx.bfloat16: 1e-2}  # ||k - ref|| / ||ref||: the output dtype's rounding


def rel_err(out, ref) -> float:
    out, ref = (np.array(a.astype(mx.float32)) for a in (out, ref))
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def prep_case(data, bt, nkv, rep, hd, rd, nseq, dtype, seed):
    """A drawn batch: contexts around block boundaries, 1-5 new tokens a sequence, norm weights in the
    activations' dtype or in fp32 (checkpoints that keep their norms in fp32: the 35B-A3B's)."""
    past = [data.draw(contexts(bt)) for _ in range(nseq)]
    qlens = [data.draw(st.integers(1, 5)) for _ in range(nseq)]
    wdtype = data.draw(st.sampled_from([dtype, mx.float32]))
    return batch_case(bt, nkv, rep, hd, rd, past, qlens, dtype, seed, wdtype)


def batch_case(bt, nkv, rep, hd, rd, past, qlens, dtype, seed, wdtype=None):
    """qg [T, nkv*rep, 2*hd], k / v [T, nkv, hd], norms, tables, pools and the layout: attention_prep's args."""
    rng = np.random.default_rng(seed)
    _, kp, vp, layout = make_batch(rng, bt, nkv, rep, hd, past, qlens, dtype)
    T = layout.query_start_loc[-1]

    def rand(*shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    qg, k, v = rand(T, nkv * rep, 2 * hd), rand(T, nkv, hd), rand(T, nkv, hd)
    qn, kn = ((1 + rand(hd, scale=0.2)).astype(wdtype or dtype) for _ in range(2))
    tables = RopeTables(rd, 10_000_000.0)
    tables.ensure(max(p + t for p, t in zip(past, qlens)) + 1)
    return qg, k, v, qn, kn, 1e-6, layout.array("positions"), tables, hd, kp, vp, layout


def check_launch(case, launch):
    """Runs `launch` (the kernel) on case and checks q, k and both pools."""
    qg, k, v, qn, kn, eps, pos, tables, hd, kp, vp, layout = case
    with mx.stream(mx.cpu):
        rq = head_norm_rope_ref(qg, qn, eps, pos, tables, hd)
        rk = head_norm_rope_ref(k, kn, eps, pos, tables, hd)
    kp0, vp0 = kp + 0, vp + 0  # copies: the launch writes kp, vp
    mx.eval(kp0, vp0)
    q, kk, done = launch(*case)
    mx.eval(q, kk, done, kp, vp)
    assert int(done[0].item()) == 1
    assert rel_err(q, rq) < TOL[qg.dtype] and rel_err(kk, rk) < TOL[qg.dtype]
    with mx.stream(mx.cpu):  # the pools: exactly the functional write of the launch's own k, and v
        wk, wv = write_kv(kp0, vp0, kk, v, layout)
    assert np.array_equal(np.array(kp.astype(mx.float32)), np.array(wk.astype(mx.float32)))
    assert np.array_equal(np.array(vp.astype(mx.float32)), np.array(wv.astype(mx.float32)))


prep_shape = dict(data=st.data(), bt=st.sampled_from([16, 128]), nkv=st.integers(1, 4), rep=st.sampled_from([1, 2, 4, 8]),
                  hd=st.sampled_from([64, 128, 256]), rd=st.sampled_from([16, 32, 64]), nseq=st.integers(1, 3),
                  seed=st.integers(0, 2**31 - 1))


@settings(max_examples=6, deadline=None, database=None)
@given(**prep_shape)
def test_prep_on_cpu_is_the_three_ops(data, bt, nkv, rep, hd, rd, nseq, seed):
    """No GPU: q and k from the references, no token (the caller writes the pools functionally)."""
    case = prep_case(data, bt, nkv, rep, hd, rd, nseq, mx.float32, seed)
    qg, k, v, qn, kn, eps, pos, tables, hd, kp, vp, layout = case
    q, kk, written = attention_prep(*case)
    assert written is None
    assert mx.array_equal(q, head_norm_rope_ref(qg, qn, eps, pos, tables, hd)).item()
    assert mx.array_equal(kk, head_norm_rope_ref(k, kn, eps, pos, tables, hd)).item()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=4, deadline=None, database=None)
@given(**prep_shape, dtype=st.sampled_from(["float32", "bfloat16"]))
def test_prep_metal_emulated(data, bt, nkv, rep, hd, rd, nseq, seed, dtype):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.attention import prep  # noqa: PLC0415

    case = prep_case(data, bt, nkv, rep, hd, rd, nseq, getattr(mx, dtype), seed)
    with metal_emulator.emulating() as launches:  # outputs start as NaN bytes there
        check_launch(case, prep.prep_kv_write)
    assert [ln.kernel for ln in launches] == ["mtl_attn_prep_kv_write"]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(30), **GPU_SETTINGS)
@given(**prep_shape, dtype=st.sampled_from(["float32", "bfloat16"]))
def test_prep_matches_reference(data, bt, nkv, rep, hd, rd, nseq, seed, dtype):
    from mtlqwen.kernels.attention import prep  # noqa: PLC0415

    case = prep_case(data, bt, nkv, rep, hd, rd, nseq, getattr(mx, dtype), seed)
    check_launch(case, lambda *a: prep.prep_kv_write(*a, init_value=float("nan")))


@pytest.mark.gpu
@needs_gpu
def test_prep_dispatch_serves_the_kernel_and_attention_follows_it():
    """Through the op: one launch, its token taken by the attention that reads the pools."""
    from mtlqwen.kernels import dispatch  # noqa: PLC0415
    from mtlqwen.kernels.attention import paged_attention_gated, paged_attention_gated_ref  # noqa: PLC0415

    case = batch_case(128, 4, 4, 256, 64, [127, 3], [1, 4], mx.bfloat16, 1)  # a context across a block boundary
    qg, k, v, qn, kn, eps, pos, tables, hd, kp, vp, layout = case
    q, kk, written = attention_prep(*case)
    assert written is not None and dispatch.OPS["attention_prep"].failed is None
    out = paged_attention_gated(q, kp, vp, layout, hd**-0.5, qg, after=written)
    mx.eval(out)  # the write has run: the pools hold the new tokens
    with mx.stream(mx.cpu):
        ref = paged_attention_gated_ref(head_norm_rope_ref(qg, qn, eps, pos, tables, hd), kp + 0, vp + 0, layout,
                                        hd**-0.5, qg)
    assert rel_err(out, ref) < 2e-2
