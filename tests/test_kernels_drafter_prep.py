"""The DFlash drafter's fused preparation (attention/ops.py `drafter_attention_prep`, `drafter_context_write`):
q and k norm + RoPE and the K/V write in one launch (attention/prep.py), k and v read in place from packed
projection rows [T, W] at drawn offsets.

CPU: the ops are the composed references exactly (fp32). Metal emulator and GPU: through the ops' kernels
against the CPU references, the pool rows the write must fill NaN-poisoned beforehand and the kernels'
outputs poisoned; random GQA ratios, head dims, rotary dims, block sizes, contexts around block boundaries,
1-17 rows a block, causal and not, host and traced layouts, bf16 and fp32. The prep launch alone with packed
rows, with and without q: the Metal emulator's trials (kernels/metal_cases.py, test_metal_emulator.py).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import dispatch
from mtlqwen.kernels.attention import drafter_attention_prep, drafter_context_write
from mtlqwen.kernels.attention.reference import drafter_attention_ref, write_kv
from mtlqwen.kernels.rope.reference import RopeTables, head_norm_rope_ref

from gpu_checks import GPU_SETTINGS, n_examples, needs_gpu
from test_kernels_attention import TOL, rel_err
from test_kernels_drafter_attention import drafter_case, poisoned_pools, traced


def packed_case(data, bt, nkv, rep, hd, nseq, dt, seed):
    """drafter_case's batch with the block's k and v as slots of packed rows [T, S * nkv * hd] (S of 2 or 5
    slots, k and v at two drawn distinct slots, of one array or of two), norm weights and RoPE tables."""
    q, _, _, kp, vp, layout = drafter_case(data, bt, nkv, rep, hd, nseq, dt, seed)
    rng = np.random.default_rng(seed + 1)
    T, w = layout.num_tokens, nkv * hd
    slots = data.draw(st.sampled_from([2, 5]))  # few row widths: each (width, offsets) is one more kernel build
    ks, vs = data.draw(st.permutations(range(slots)))[:2]
    k_src = mx.array(rng.standard_normal((T, slots * w)).astype(np.float32)).astype(dt)
    v_src = k_src if data.draw(st.booleans()) else mx.array(rng.standard_normal((T, slots * w)).astype(np.float32)).astype(dt)
    qn, kn = (mx.array((1 + 0.2 * rng.standard_normal(hd)).astype(np.float32)).astype(dt) for _ in range(2))
    tables = RopeTables(data.draw(st.sampled_from([hd // 2, hd])), 1_000_000.0)
    tables.ensure(max(p + layout.q_len(i) for i, p in enumerate(layout.kv_valid)) + 1)
    return q, (k_src, ks * w, v_src, vs * w), qn, kn, tables, kp, vp, layout


def slot(src, off, nkv, hd):
    return src[:, off:off + nkv * hd].reshape(src.shape[0], nkv, hd)


def reference_attention(q, kv, qn, kn, tables, kp, vp, layout, scale, causal):
    """The references composed, on the CPU: norms and RoPE, then the drafter attention."""
    k_src, ko, v_src, vo = kv
    nkv, hd = kp.shape[2], kp.shape[3]
    pos = layout.array("positions")
    with mx.stream(mx.cpu):
        qr = head_norm_rope_ref(q, qn, 1e-6, pos, tables, hd)
        kr = head_norm_rope_ref(slot(k_src, ko, nkv, hd), kn, 1e-6, pos, tables, hd)
        return drafter_attention_ref(qr, kr, slot(v_src, vo, nkv, hd), kp, vp, layout, scale, causal)


def reference_write(kv, kn, tables, kp, vp, layout):
    k_src, ko, v_src, vo = kv
    nkv, hd = kp.shape[2], kp.shape[3]
    with mx.stream(mx.cpu):
        kr = head_norm_rope_ref(slot(k_src, ko, nkv, hd), kn, 1e-6, layout.array("positions"), tables, hd)
        return write_kv(kp + 0, vp + 0, kr, slot(v_src, vo, nkv, hd), layout)


shapes = dict(data=st.data(), nkv=st.integers(1, 3), rep=st.sampled_from([1, 2, 4]), nseq=st.integers(1, 3),
              causal=st.booleans(), trace=st.booleans(), seed=st.integers(0, 2**31 - 1))


@settings(max_examples=15, deadline=None, database=None)
@given(bt=st.sampled_from([4, 16]), **shapes)
def test_ops_on_cpu_are_the_references(data, bt, nkv, rep, nseq, causal, trace, seed):
    """No GPU: the attention and the pools after the context write equal the composed references exactly."""
    q, kv, qn, kn, tables, kp, vp, layout = packed_case(data, bt, nkv, rep, 32, nseq, mx.float32, seed)
    lay = traced(layout) if trace else layout
    want = reference_attention(q, kv, qn, kn, tables, kp, vp, layout, 32**-0.5, causal)
    got = drafter_attention_prep(q, *kv, qn, kn, 1e-6, lay.array("positions"), tables, 32, kp, vp, lay, 32**-0.5,
                                 causal)
    assert mx.array_equal(got, want).item()
    wk, wv = reference_write(kv, kn, tables, kp, vp, layout)
    gk, gv = drafter_context_write(*kv, kn, 1e-6, layout.array("positions"), tables, 32, kp, vp, layout, q.shape,
                                   q.dtype)
    assert mx.array_equal(gk, wk).item() and mx.array_equal(gv, wv).item()


def check_kernels(data, bt, nkv, rep, hd, nseq, causal, trace, dt, seed):
    """Both ops through their kernels (the caller's back-end) against the CPU references."""
    from mtlqwen.kernels.attention import kernels as pa  # noqa: PLC0415

    pa.POISON = float("nan")
    q, kv, qn, kn, tables, kp, vp, layout = packed_case(data, bt, nkv, rep, hd, nseq, dt, seed)
    scale = hd**-0.5
    want = np.array(reference_attention(q, kv, qn, kn, tables, kp, vp, layout, scale, causal).astype(mx.float32),
                    dtype=np.float64)
    wk, wv = reference_write(kv, kn, tables, kp, vp, layout)
    lay = traced(layout) if trace else layout
    for name in ("drafter_attention_prep", "drafter_context_write"):
        dispatch.reset(name)
        assert dispatch.kernel_for(name) is not None
    kp1, vp1 = poisoned_pools(kp, vp, layout, dt)
    got = drafter_attention_prep(q, *kv, qn, kn, 1e-6, lay.array("positions"), tables, hd, kp1, vp1, lay, scale,
                                 causal)
    mx.eval(got)
    assert dispatch.OPS["drafter_attention_prep"].failed is None
    assert rel_err(got, want) < TOL[dt]
    kp2, vp2 = poisoned_pools(kp, vp, layout, dt)
    gk, gv = drafter_context_write(*kv, kn, 1e-6, layout.array("positions"), tables, hd, kp2, vp2, layout, q.shape,
                                   q.dtype)
    mx.eval(gk, gv)
    assert dispatch.OPS["drafter_context_write"].failed is None
    # v is copied: exact; k is the kernel's norm + RoPE, within the dtype's rounding of the reference
    assert np.array_equal(np.array(gv.astype(mx.float32)), np.array(wv.astype(mx.float32)))
    assert rel_err(gk, np.array(wk.astype(mx.float32), dtype=np.float64)) < TOL[dt]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=4, deadline=None, database=None)
@given(bt=st.sampled_from([16, 128]), hd=st.sampled_from([32, 64]), dtype=st.sampled_from(["float32", "bfloat16"]),
       **shapes)
def test_kernels_metal_emulated(data, bt, nkv, rep, hd, nseq, causal, trace, dtype, seed):
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.attention import kernels as pa  # noqa: PLC0415

    # the default device stays the CPU here; no first-use reference runs, so the launches are the ops' own
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "use_kernels", lambda: True)
        mp.setattr(pa, "POISON", pa.POISON)
        mp.setenv("MTLQWEN_SELF_CHECK", "0")
        with metal_emulator.emulating() as launches:
            check_kernels(data, bt, nkv, rep, hd, nseq, causal, trace, getattr(mx, dtype), seed)
    # the prep launch, the decode rows (and their merge), the context write's prep launch: nothing else
    names = [ln.kernel for ln in launches]
    assert names[0] == names[-1] == "mtl_attn_prep_kv_write" and names.count("mtl_attn_prep_kv_write") == 2
    assert all(n.startswith("mtl_paged_attn") for n in names[1:-1])


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(18), **GPU_SETTINGS)
@given(bt=st.sampled_from([16, 128]), hd=st.sampled_from([64, 128]), dtype=st.sampled_from(["bfloat16", "float32"]),
       **shapes)
def test_kernels_on_the_gpu(data, bt, nkv, rep, hd, nseq, causal, trace, dtype, seed):
    check_kernels(data, bt, nkv, rep, hd, nseq, causal, trace, getattr(mx, dtype), seed)
