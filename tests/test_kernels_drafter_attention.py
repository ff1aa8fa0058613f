"""DFlash drafter attention in its decode form (kernels/attention/drafter.py): the block written into the pools
at its own positions, then one decode row per block query, against `drafter_attention_ref`. The form's
arithmetic on the CPU references (host and traced layouts), and the op's GPU path (write kernel + decode
kernel) with the blocks' pool rows poisoned, so a row the write misses shows as NaN."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import dispatch
from mtlqwen.kernels.attention import drafter_attention, paged_attention_ref
from mtlqwen.kernels.attention.drafter import decode_form
from mtlqwen.kernels.attention.reference import drafter_attention_ref, write_kv
from mtlqwen.kernels.seqs import SeqLayout

from gpu_checks import GPU_SETTINGS, needs_gpu
from test_kernels_attention import TOL, contexts, make_batch, rel_err


def drafter_case(data, bt, nkv, rep, hd, nseq, dt, seed):
    """Pools, block tables and queries of `nseq` drafter blocks (1-17 rows each) after drawn contexts, and the
    blocks' own k, v [T, nKV, hd]."""
    rng = np.random.default_rng(seed)
    past = [data.draw(contexts(bt)) for _ in range(nseq)]
    blocks = [data.draw(st.sampled_from([1, 2, 4, 8, 16, 3, 17])) for _ in range(nseq)]
    q, kp, vp, layout = make_batch(rng, bt, nkv, rep, hd, past, blocks, dt)
    T = layout.num_tokens
    k_blk = mx.array(rng.standard_normal((T, nkv, hd)).astype(np.float32)).astype(dt)
    v_blk = mx.array(rng.standard_normal((T, nkv, hd)).astype(np.float32)).astype(dt)
    return q, k_blk, v_blk, kp, vp, layout


def poisoned_pools(kp, vp, layout: SeqLayout, dt):
    """The pools with the rows the layout's tokens occupy (the blocks' own rows, which a write fills) set to
    NaN, so a row a write misses shows."""
    bt = layout.block_tokens
    mask = np.zeros(kp.shape[:2], dtype=bool)  # [num_blocks, bt]
    for i, (table, P) in enumerate(zip(layout.block_tables, layout.kv_valid)):
        for pos in range(P, P + layout.q_len(i)):
            mask[table[pos // bt], pos % bt] = True
    m = mx.array(mask)[:, :, None, None]
    kp, vp = mx.where(m, mx.nan, kp).astype(dt), mx.where(m, mx.nan, vp).astype(dt)
    mx.eval(kp, vp)
    return kp, vp


def traced(layout: SeqLayout) -> SeqLayout:
    """The layout as CompiledDraft's trace builds it: arrays only (positions, kv_valid, padded tables)."""
    return SeqLayout.for_trace(list(layout.query_start_loc), {n: layout.array(n) for n in ("positions", "kv_valid",
                                                                                         "block_tables")},
                               layout.block_tokens)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), bt=st.sampled_from([4, 16]), nkv=st.integers(1, 2), rep=st.sampled_from([1, 2, 4]),
       nseq=st.integers(1, 3), causal=st.booleans(), trace=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_decode_form_is_drafter_attention(data, bt, nkv, rep, nseq, causal, trace, seed):
    """Writing the blocks at their positions, then decode rows reaching P + B - 1 (causal: P + j), through the
    references == the drafter attention's reference (fp32)."""
    q, k_blk, v_blk, kp, vp, layout = drafter_case(data, bt, nkv, rep, 8, nseq, mx.float32, seed)
    with mx.stream(mx.cpu):  # exact fp32 (a GPU's fp32 matmuls may run as TF32)
        want = drafter_attention_ref(q, k_blk, v_blk, kp, vp, layout, 8**-0.5, causal)
        write, rows = decode_form(traced(layout) if trace else layout, causal)
        assert rows.num_seqs == layout.num_tokens and all(rows.q_len(i) == 1 for i in range(rows.num_seqs))
        kp2, vp2 = write_kv(kp + 0, vp + 0, k_blk, v_blk, write)
        got = paged_attention_ref(q, kp2, vp2, rows, 8**-0.5)
    assert rel_err(got, np.array(want, dtype=np.float64)) < 1e-5


def test_decode_form_rows_reach():
    """Exact rows: two blocks (3 and 2 queries) after contexts 5 and 0, block_tokens 4."""
    layout = SeqLayout([0, 3, 5], [5, 0], [[2, 0], [1]], [0, 1], 4)
    write, rows = decode_form(layout, causal=False)
    assert write.array("positions").tolist() == [5, 6, 7, 0, 1]
    assert write.array("write_blocks").tolist() == [0, 0, 0, 1, 1]
    assert write.array("write_offsets").tolist() == [1, 2, 3, 0, 1]
    assert rows.array("kv_valid").tolist() == [7, 7, 7, 1, 1]
    assert rows.array("block_tables").tolist() == [[2, 0], [2, 0], [2, 0], [1, 0], [1, 0]]
    assert rows.longest() == 8  # the padded table's reach: two blocks of 4
    _, causal_rows = decode_form(layout, causal=True)
    assert causal_rows.array("kv_valid").tolist() == [5, 6, 7, 0, 1]


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=20, **GPU_SETTINGS)
@given(data=st.data(), bt=st.sampled_from([16, 128]), nkv=st.integers(1, 4), rep=st.sampled_from([1, 2, 4]),
       hd=st.sampled_from([64, 128]), nseq=st.integers(1, 4), causal=st.booleans(), trace=st.booleans(),
       dtype=st.sampled_from(["bfloat16", "float32"]), seed=st.integers(0, 2**31 - 1))
def test_drafter_attention_kernel_path(data, bt, nkv, rep, hd, nseq, causal, trace, dtype, seed):
    """The op on the GPU (in-place block write + decode kernel, outputs poisoned) == the reference on the CPU;
    the pool rows the blocks occupy (kv_valid .. kv_valid + B - 1) are NaN before the op, so a row the write
    skips shows; rows past them hold random garbage the rows' reach must exclude."""
    from mtlqwen.kernels.attention import kernels as pa  # noqa: PLC0415

    pa.POISON = float("nan")
    dt = {"bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    q, k_blk, v_blk, kp, vp, layout = drafter_case(data, bt, nkv, rep, hd, nseq, dt, seed)
    scale = hd**-0.5
    with mx.stream(mx.cpu):
        want = np.array(drafter_attention_ref(q, k_blk, v_blk, kp, vp, layout, scale, causal).astype(mx.float32),
                        dtype=np.float64)
    kp, vp = poisoned_pools(kp, vp, layout, dt)
    dispatch.reset("drafter_attention")
    assert dispatch.kernel_for("drafter_attention") is not None
    got = drafter_attention(q, k_blk, v_blk, kp, vp, traced(layout) if trace else layout, scale, causal)
    mx.eval(got)
    assert dispatch.OPS["drafter_attention"].failed is None
    assert rel_err(got, want) < TOL[dt]


def test_a_table_without_room_for_the_block_keeps_the_reference(monkeypatch):
    """A host layout whose table ends before the block's last row never reaches the in-place write (it would
    land in the padding block): the op's kernel declines and the reference serves."""
    from mtlqwen.kernels.attention import ops  # noqa: PLC0415

    def no_write(*a, **k):
        raise AssertionError("the in-place write was reached")

    monkeypatch.setattr(ops, "write_kv_inplace", no_write)
    rng = np.random.default_rng(3)
    kp, vp = (mx.array(rng.standard_normal((3, 4, 1, 8)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((3, 2, 8)).astype(np.float32))
    k = mx.array(rng.standard_normal((3, 1, 8)).astype(np.float32))
    short = SeqLayout([0, 3], [6], [[2, 1]], [0], 4)  # 8 rows of table, the block needs positions 6..8
    assert ops._drafter_kernel(q, k, k, kp, vp, short, 0.5) is None
    with pytest.raises(AssertionError, match="in-place write was reached"):  # with room, the write is next
        ops._drafter_kernel(q, k, k, kp, vp, SeqLayout([0, 3], [5], [[2, 1]], [0], 4), 0.5)



def test_the_trace_probe_of_several_blocks_judges_the_kernel_on_its_own_rows(monkeypatch):
    """Inside a compiled drafter pass the op is judged at first use on a probe (dispatch.Op._probe: empty
    contexts). Its in-place write puts every sequence's block at positions 0..B-1, so the probe must give each
    sequence its own pool blocks; with one shared block the writes landed on each other and a correct kernel
    was switched off (the H200 spec trace at 8 sequences x 16 rows). On the Metal emulator: exact probe
    tables, and the kernel path agrees with the reference on them."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    monkeypatch.setenv("MTLQWEN_SELF_CHECK", "1")
    monkeypatch.setattr(dispatch, "use_kernels", lambda: True)  # the default device stays the CPU here
    rng = np.random.default_rng(11)
    bt, nkv, rep, hd, B = 16, 2, 2, 32, 16
    layout = SeqLayout([0, B, 2 * B, 3 * B], [40, 3, 17], [[4, 1, 6, 0], [2, 0, 0, 0], [5, 3, 0, 0]], [0, 1, 2], bt)
    kp, vp = (mx.array(rng.standard_normal((8, bt, nkv, hd)).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((3 * B, nkv * rep, hd)).astype(np.float32))
    k_blk, v_blk = (mx.array(rng.standard_normal((3 * B, nkv, hd)).astype(np.float32)) for _ in range(2))
    op = dispatch.OPS["drafter_attention"]
    args = (q, k_blk, v_blk, kp, vp, traced(layout), hd**-0.5)
    with metal_emulator.emulating():
        dispatch.reset("drafter_attention")
        p_args, p_kw = op._probe(args, {"causal": False})
        probe = p_args[5]
        assert not probe.traced and probe.kv_valid == [0, 0, 0]
        assert probe.block_tables == [[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2]]  # one block of 16 rows each
        assert op._check(op.kernel, p_args, p_kw) == (True, None)
