"""Gated DeltaNet: the reference twins against a naive float64 numpy recurrence (CPU, CI), and the GPU
kernels against the references over random packed batches (`-m gpu`, on Metal or CUDA)."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend, dispatch
from mtlqwen.kernels.gdn.reference import _chunked, _recurrent
from mtlqwen.kernels.gdn import (
    gated_delta,
    gated_delta_candidates,
    gated_delta_candidates_ref,
    gated_delta_packed,
    gated_delta_packed_candidates,
    gated_delta_packed_candidates_normed,
    gated_delta_packed_candidates_normed_ref,
    gated_delta_packed_normed,
    gated_delta_packed_normed_ref,
    gated_delta_ref,
)
from mtlqwen.kernels.norms.reference import gated_rms_norm_ref
from mtlqwen.kernels.selection import SELECT
from mtlqwen.kernels.seqs import SeqLayout

from gpu_checks import n_examples

NEEDS_GPU = "needs a GPU back-end (Metal or CUDA); CPU runs the reference"
needs_gpu = pytest.mark.skipif(backend.gpu_backend() is None, reason=NEEDS_GPU)
# segment lengths around the 16-token recurrence threshold and the 32 / 64-token chunks
LENGTHS = st.one_of(st.sampled_from([1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65]), st.integers(1, 80))


def short_or_long(short: int, long: tuple[int, int], most: int = 4):
    """Segment lengths of a batch: each up to `short` (decode rows, short verifications) or in `long`."""
    return st.lists(st.one_of(st.integers(1, short), st.integers(*long)), min_size=1, max_size=most)


# (Hk, r, dk, dv): r = Hv / Hk in {1, 2, 3}, dk != dv, and the Qwen3.5 head shape
GEOMS = [(2, 3, 32, 48), (2, 2, 64, 32), (1, 1, 128, 128), (3, 1, 48, 16), (1, 2, 128, 128)]
TOL = {mx.float32: 1e-4, mx.bfloat16: 1e-2}
# device time is scarce: no shrinking (a failure reports the drawn example as is)
GPU_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


def make_case(seed: int, lens: list[int], Hk: int, r: int, dk: int, dv: int, dtype=mx.float32):
    """Fresh random inputs for a packed batch; state rows are a random subset of a larger pool."""
    rng = np.random.default_rng(seed)
    T, Hv, B = sum(lens), Hk * r, len(lens)
    S = B + 2
    layout = SeqLayout(
        query_start_loc=[0] + [int(x) for x in np.cumsum(lens)],
        kv_valid=[0] * B,
        block_tables=[[0]] * B,
        state_rows=[int(x) for x in rng.permutation(S)[:B]],
    )

    def rand(*shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32))

    args = dict(
        q=rand(T, Hk, dk).astype(dtype),
        k=rand(T, Hk, dk).astype(dtype),
        v=rand(T, Hv, dv).astype(dtype),
        a=rand(T, Hv).astype(dtype),
        b=rand(T, Hv).astype(dtype),
        A_log=mx.array(np.log(rng.uniform(1, 16, Hv)).astype(np.float32)),  # HF-like decay range
        dt_bias=rand(Hv, scale=0.5),
        state_pool=rand(S, Hv, dv, dk, scale=0.1),
    )
    return args, layout


def naive_gdn(args, layout):
    """float64 numpy, straight from §2.4-2.7, one token at a time: (o [T,Hv,dv], final [B,...], all [T,...])."""
    f = {k: np.array(v.astype(mx.float32), dtype=np.float64) for k, v in args.items()}
    q, k, v, a, b = f["q"], f["k"], f["v"], f["a"], f["b"]
    Hk, dk = q.shape[1], q.shape[2]
    Hv = v.shape[1]
    r = Hv // Hk
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(f["A_log"]) * np.logaddexp(a + f["dt_bias"], 0)
    o = np.zeros(v.shape)
    every = np.zeros((q.shape[0],) + f["state_pool"].shape[1:])
    finals = []
    for i in range(layout.num_seqs):
        S = f["state_pool"][layout.state_rows[i]].copy()  # [Hv, dv, dk]
        for t in range(layout.query_start_loc[i], layout.query_start_loc[i + 1]):
            for j in range(Hv):
                kk = k[t, j // r] / math.sqrt((k[t, j // r] ** 2).sum() + 1e-6)
                qq = q[t, j // r] / math.sqrt((q[t, j // r] ** 2).sum() + 1e-6) / math.sqrt(dk)
                S[j] *= math.exp(g[t, j])
                delta = beta[t, j] * (v[t, j] - S[j] @ kk)
                S[j] += np.outer(delta, kk)
                o[t, j] = S[j] @ qq
            every[t] = S
        finals.append(S)
    return o, np.stack(finals), every


def rel(out, ref) -> float:
    out = np.array(out.astype(mx.float32), dtype=np.float64) if isinstance(out, mx.array) else out
    ref = np.array(ref.astype(mx.float32), dtype=np.float64) if isinstance(ref, mx.array) else ref
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "non-finite (unwritten?) elements"
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


# ---- CPU: reference twins vs float64 ---------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), lens=st.lists(LENGTHS, min_size=1, max_size=3), geom=st.sampled_from(GEOMS[:4]))
def test_reference_matches_float64(seed, lens, geom):
    args, layout = make_case(seed, lens, *geom)
    with mx.stream(mx.cpu):
        o, states = gated_delta_ref(**args, layout=layout)
    no, nstates, _ = naive_gdn(args, layout)
    assert rel(o, no) < 1e-4
    assert rel(states, nstates) < 1e-4


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), T=LENGTHS, dk=st.sampled_from([16, 32]), dv=st.sampled_from([8, 24]))
def test_chunked_matches_recurrent(seed, T, dk, dv):
    """The 64-token chunked scan and the recurrence are one function, incl. across chunk boundaries."""
    rng = np.random.default_rng(seed)
    Hv = 2

    def rand(*s):
        return mx.array(rng.standard_normal(s).astype(np.float32))

    kn = rand(Hv, T, dk)
    kn = kn / mx.sqrt((kn * kn).sum(-1, keepdims=True))
    qn = rand(Hv, T, dk) / math.sqrt(dk)
    g = -mx.array(rng.uniform(0.0, 2.0, (Hv, T)).astype(np.float32))
    beta = mx.array(rng.uniform(0, 1, (Hv, T)).astype(np.float32))
    S0 = rand(Hv, dv, dk) * 0.1
    with mx.stream(mx.cpu):
        v = rand(Hv, T, dv)
        o1, s1 = _recurrent(qn, kn, v, g, beta, S0)
        o2, s2 = _chunked(qn, kn, v, g, beta, S0)
    assert rel(o2, o1) < 1e-4 and rel(s2, s1) < 1e-4


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), geom=st.sampled_from(GEOMS[:4]))
def test_candidate_states_reference(seed, lens, geom):
    """Candidate states = the states of the token-by-token recurrence; last one = the committed state."""
    args, layout = make_case(seed, lens, *geom)
    with mx.stream(mx.cpu):
        o, states, every = gated_delta_candidates_ref(**args, layout=layout)
        o_ref, states_ref = gated_delta_ref(**args, layout=layout)
    no, nstates, nevery = naive_gdn(args, layout)
    assert rel(every, nevery) < 1e-4 and rel(o, no) < 1e-4 and rel(states, nstates) < 1e-4
    ends = [layout.query_start_loc[i + 1] - 1 for i in range(layout.num_seqs)]
    assert rel(every[mx.array(ends)], states_ref) < 1e-5
    assert rel(o, o_ref) < 1e-5


# ---- GPU: kernels vs references ---------------------------------------------------------------------


def on_cpu(fn, *args, **kw):
    """References run on the CPU stream: exact fp32 (GPU matmuls may use TF32)."""
    with mx.stream(mx.cpu):
        out = fn(*args, **kw)
        mx.eval(out)
    return out


# random packed batches for the kernel tests: segment lengths, head geometry, activation dtype, kernel choice
KERNEL_CASES = dict(
    seed=st.integers(0, 2**31),
    lens=st.lists(LENGTHS, min_size=1, max_size=4),
    geom=st.sampled_from(GEOMS),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    chunk=st.sampled_from([None, True, False]),
)


def _check(out, ref, dtype, what):
    assert len(out) == len(ref)
    tol = TOL[dtype]
    assert rel(out[0], ref[0]) < tol, f"{what}: o"
    for got, want in zip(out[1:], ref[1:]):  # states are fp32 whatever the activation dtype
        assert got.dtype == mx.float32
        assert rel(got, want) < (1e-4 if dtype == mx.float32 else 1e-3), f"{what}: states"


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=20, **GPU_SETTINGS)
@given(**KERNEL_CASES, tpr=st.sampled_from([None, None, 4, 8, 16, 32]))  # lanes per state row (None: default)
def test_gdn_kernel_matches_reference(seed, lens, geom, dtype, chunk, tpr):
    from mtlqwen.kernels.gdn.kernels import run_gdn  # noqa: PLC0415

    args, layout = make_case(seed, lens, *geom, dtype=dtype)
    out = run_gdn(**args, layout=layout, chunk=chunk, tpr=tpr, init_value=float("nan"))  # poisoned outputs
    assume(out is not None or tpr is None)  # an explicit split this kernel or dk cannot take
    assert out is not None
    mx.eval(out)
    _check(out, on_cpu(gated_delta_ref, **args, layout=layout), dtype, f"chunk={chunk} tpr={tpr}")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=5, deadline=None, database=None)
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       geom=st.sampled_from([g for g in GEOMS if g[2] <= 64 and g[3] <= 64]),
       dtype=st.sampled_from([mx.float32, mx.bfloat16]), inplace=st.booleans())
def test_gdn_chunk_kernel_metal_emulated(seed, lens, geom, dtype, inplace):
    """The chunk scan's Metal rendering (16-token chunks) on the emulator, outputs NaN there until written:
    segments shorter and longer than a chunk, GQA ratios, dk != dv (small heads keep the emulator fast)."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.gdn.kernels import run_gdn  # noqa: PLC0415

    args, layout = make_case(seed, lens, *geom, dtype=dtype)
    ref = on_cpu(gated_delta_ref, **args, layout=layout)
    pool = args["state_pool"] + 0  # the in-place variant writes the pool's rows
    mx.eval(pool)
    with metal_emulator.emulating() as launches:
        out = run_gdn(**{**args, "state_pool": pool}, layout=layout, chunk=True, inplace=inplace)
        mx.eval(out)
    assert [ln.kernel for ln in launches] == ["gdn_chunk_inplace" if inplace else "gdn_chunk"]
    states = pool[layout.array("state_rows")] if inplace else out[1]
    _check([out[0], states], ref, dtype, f"emulated chunk, inplace={inplace}")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
def test_gdn_chunk_min_t_picks_the_kernel_by_the_longest_segment():
    """SELECT["gdn_chunk_min_t"]: a batch whose longest segment exceeds it runs the chunk scan, otherwise the
    recurrence; candidates always the recurrence. Segments of 20 and 33 tokens against thresholds 32 / 33 / 16."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415
    from mtlqwen.kernels.gdn.kernels import run_gdn  # noqa: PLC0415
    from mtlqwen.kernels.selection import selected  # noqa: PLC0415

    args, layout = make_case(3, [20, 33], 1, 2, 16, 16)
    picked = {}
    with metal_emulator.emulating() as launches:
        for row, cand in ((32, False), (33, False), (16, True)):
            with selected({"gdn_chunk_min_t": row}):
                mx.eval(run_gdn(**args, layout=layout, candidates=cand))
            picked[(row, cand)] = launches[-1].kernel
    assert picked == {(32, False): "gdn_chunk", (33, False): "gdn_recurrent", (16, True): "gdn_recurrent_cand"}


def packed_case(args: dict) -> tuple[mx.array, tuple]:
    """The conv-output layout of a case: y [T, 2*Hk*dk + Hv*dv] = q | k | v channels, and its heads."""
    q, k, v = args["q"], args["k"], args["v"]
    T, Hk, dk = q.shape
    heads = (Hk, dk, v.shape[1], v.shape[2])
    return mx.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1), heads


def test_packed_reference_is_the_reference_on_split_channels():
    args, layout = make_case(7, [3, 1, 20], 2, 3, 32, 48)
    y, heads = packed_case(args)
    rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}
    got = gated_delta_packed(y, **rest, layout=layout, heads=heads)
    want = gated_delta_ref(**args, layout=layout)
    assert all(np.array_equal(np.array(g), np.array(w)) for g, w in zip(got, want))
    got = gated_delta_packed_candidates(y, **rest, layout=layout, heads=heads)
    want = gated_delta_candidates_ref(**args, layout=layout)
    assert len(got) == 3 and all(np.array_equal(np.array(g), np.array(w)) for g, w in zip(got, want))


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=20, **GPU_SETTINGS)
@given(**KERNEL_CASES, inplace=st.booleans())
def test_gdn_kernel_reads_packed_qkv(seed, lens, geom, dtype, chunk, inplace):
    """The kernels reading q, k, v in place from the conv output (strided rows) == the reference. With
    inplace=True (the gate for SELECT["gdn_state_inplace"]) the sequences' pool rows must then hold the
    reference's new states and every other pool row must be untouched."""
    from mtlqwen.kernels.gdn.kernels import run_gdn  # noqa: PLC0415

    args, layout = make_case(seed, lens, *geom, dtype=dtype)
    before = np.array(args["state_pool"])
    ref = on_cpu(gated_delta_ref, **{**args, "state_pool": mx.array(before)}, layout=layout)
    y, heads = packed_case(args)
    rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}
    out = run_gdn(y, y, y, **rest, layout=layout, chunk=chunk, heads=heads, inplace=inplace, init_value=float("nan"))
    assert out is not None
    mx.eval(out)
    if not inplace:
        _check(out, ref, dtype, f"packed chunk={chunk}")
        return
    assert rel(out[0], ref[0]) < TOL[dtype]
    after = np.array(args["state_pool"])
    rows = layout.state_rows
    assert rel(mx.array(after[rows]), ref[1]) < (1e-4 if dtype == mx.float32 else 1e-3)
    others = [i for i in range(after.shape[0]) if i not in rows]
    assert np.array_equal(after[others], before[others])


def norm_inputs(seed: int, T: int, Hv: int, dv: int, dtype, wdt=mx.float32):
    """The gated norm's z [T, Hv*dv] (the in_proj_z output), weight [dv] and eps for a case."""
    rng = np.random.default_rng(seed + 1)
    z = mx.array(rng.standard_normal((T, Hv * dv)).astype(np.float32)).astype(dtype)
    w = mx.array((1 + 0.2 * rng.standard_normal(dv)).astype(np.float32)).astype(wdt)
    return z, w, float(rng.choice([1e-6, 1e-5]))


def normed_case(seed: int, lens, geom):
    """An fp32 case for the normed ops: (args, layout, the packed conv output y, heads, z, norm w, eps, the
    ops' other inputs by name)."""
    args, layout = make_case(seed, lens, *geom)
    y, heads = packed_case(args)
    z, w, eps = norm_inputs(seed, y.shape[0], heads[2], heads[3], mx.float32)
    return args, layout, y, heads, z, w, eps, {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}


def normed_want(args, layout, z, w, eps: float, Hv: int, dv: int):
    """float64 (from naive_gdn): the normed output [T, Hv*dv] of o rounded to fp32 as the op returns it, the
    final states and every token's state."""
    no, nstates, nall = naive_gdn(args, layout)
    T = no.shape[0]
    o = np.array(mx.array(no.astype(np.float32))).astype(np.float64).reshape(T * Hv, dv)  # fp32, like the op
    zf = np.array(z, dtype=np.float64).reshape(T * Hv, dv)
    want = o / np.sqrt((o**2).mean(-1, keepdims=True) + eps) * np.array(w, dtype=np.float64) * zf / (1 + np.exp(-zf))
    return want.reshape(T, Hv * dv), nstates, nall


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       geom=st.sampled_from(GEOMS[:4]), fused=st.booleans(), inplace=st.booleans())
def test_packed_normed_reference(seed, lens, geom, fused, inplace):
    """The fused op's reference against float64 (delta rule, then o rounded as the op returns it, then the
    gated RMSNorm), and the op itself on the CPU, with its switches on or off: exactly the reference."""
    args, layout, y, heads, z, w, eps, rest = normed_case(seed, lens, geom)
    T, Hv, dv = y.shape[0], heads[2], heads[3]
    with mx.stream(mx.cpu):
        ref = gated_delta_packed_normed_ref(y, z, w, eps, **rest, layout=layout, heads=heads)
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(SELECT, "gdn_fused_norm", int(fused))
            mp.setitem(SELECT, "gdn_state_inplace", int(inplace))
            got = gated_delta_packed_normed(y, z, w, eps, **rest, layout=layout, heads=heads, write_state=True)
    assert got[1] is not None  # the CPU never writes the pool itself
    assert all(mx.array_equal(g, r).item() for g, r in zip(got, ref))
    want, nstates, _ = normed_want(args, layout, z, w, eps, Hv, dv)
    assert ref[0].shape == (T, Hv * dv)
    assert rel(ref[0], want) < 1e-4 and rel(ref[1], nstates) < 1e-4


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       geom=st.sampled_from(GEOMS[:4]), fused=st.booleans())
def test_packed_candidates_normed_reference(seed, lens, geom, fused):
    """A verification's fused op: its reference against float64 (the normed output as the unfused ops return
    it, the final and every token's state), and the op on the CPU with its switch on or off: exactly the
    candidates op followed by the gated norm (what the model ran before the fusion)."""
    args, layout, y, heads, z, w, eps, rest = normed_case(seed, lens, geom)
    T, Hv, dv = y.shape[0], heads[2], heads[3]
    with mx.stream(mx.cpu):
        ref = gated_delta_packed_candidates_normed_ref(y, z, w, eps, **rest, layout=layout, heads=heads)
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(SELECT, "gdn_fused_norm_candidates", int(fused))
            got = gated_delta_packed_candidates_normed(y, z, w, eps, **rest, layout=layout, heads=heads)
        o, states, cand = gated_delta_packed_candidates(y, rest["a"], rest["b"], rest["A_log"], rest["dt_bias"],
                                                        rest["state_pool"], layout, heads)
        unfused = gated_rms_norm_ref(o.reshape(T * Hv, dv), z.reshape(T * Hv, dv), w, eps).reshape(T, Hv * dv)
    assert all(mx.array_equal(g, r).item() for g, r in zip(got, ref))
    assert mx.array_equal(ref[0], unfused).item() and mx.array_equal(ref[2], cand).item()
    want, nstates, nall = normed_want(args, layout, z, w, eps, Hv, dv)
    assert ref[0].shape == (T, Hv * dv) and ref[2].shape == (T, Hv, dv, heads[1])
    assert rel(ref[0], want) < 1e-4
    assert rel(ref[1], nstates) < 1e-4 and rel(ref[2], nall) < 1e-4


def check_fused_norm(seed, lens, geom, dtype, wdt, mode, stage):
    """Run the fused recurrence + gated norm (gdn/normed.py) with SELECT["gdn_normed_stage"] = stage, outputs
    poisoned with NaN, against the reference: the normed output; the states returned ("states"), or written into
    the sequences' pool rows with every other row untouched ("inplace"), or returned with every token's state
    and the pool only read ("candidates": a verification's)."""
    from mtlqwen.kernels.gdn.normed import run_gdn_normed  # noqa: PLC0415
    from mtlqwen.kernels.selection import selected  # noqa: PLC0415

    args, layout = make_case(seed, lens, *geom, dtype=dtype)
    y, heads = packed_case(args)
    _, _, Hv, dv = heads
    T = y.shape[0]
    z, w, eps = norm_inputs(seed, T, Hv, dv, dtype, wdt)
    before = np.array(args["state_pool"])
    rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias")}
    cand = mode == "candidates"
    ref = on_cpu(gated_delta_packed_candidates_normed_ref if cand else gated_delta_packed_normed_ref, y, z, w, eps,
                 **rest, state_pool=mx.array(before), layout=layout, heads=heads)
    with selected({"gdn_normed_stage": stage}):
        out = run_gdn_normed(y, z, w, eps, **rest, state_pool=args["state_pool"], layout=layout, heads=heads,
                             inplace=mode == "inplace", candidates=cand, init_value=float("nan"))
        assert out is not None
        mx.eval(out)
    assert out[0].shape == (T, Hv * dv) and out[0].dtype == dtype
    assert rel(out[0], ref[0]) < TOL[dtype]
    stol = 1e-4 if dtype == mx.float32 else 1e-3
    if mode != "inplace":
        assert out[1].dtype == mx.float32 and rel(out[1], ref[1]) < stol
        if cand:
            assert out[2].shape == (T, Hv, dv, heads[1]) and rel(out[2], ref[2]) < stol
            assert np.array_equal(np.array(args["state_pool"]), before)
        return
    after = np.array(args["state_pool"])
    rows = layout.state_rows
    assert rel(mx.array(after[rows]), ref[1]) < stol
    others = [i for i in range(after.shape[0]) if i not in rows]
    assert np.array_equal(after[others], before[others])


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=n_examples(18), **GPU_SETTINGS)  # device_run.sh runs a third of them
@given(seed=st.integers(0, 2**31), lens=short_or_long(4, (5, 64)), geom=st.sampled_from(GEOMS),
       dtype=st.sampled_from([mx.float32, mx.bfloat16]),
       wdt=st.sampled_from([mx.float32, mx.bfloat16]), mode=st.sampled_from(["states", "inplace", "candidates"]),
       stage=st.sampled_from([0, 3, 8]))
@example(seed=3, lens=[1, 1, 1], geom=(1, 2, 128, 128), dtype=mx.bfloat16, wdt=mx.float32, mode="inplace",
         stage=0)  # decode
@example(seed=5, lens=[8], geom=(1, 2, 128, 128), dtype=mx.bfloat16, wdt=mx.float32, mode="candidates",
         stage=0)  # 1 x 7 drafts
@example(seed=7, lens=[64, 64, 63], geom=(1, 2, 128, 128), dtype=mx.bfloat16, wdt=mx.float32, mode="inplace",
         stage=8)  # the warm prefix hit's segments, staged
def test_gdn_fused_norm_kernel(seed, lens, geom, dtype, wdt, mode, stage):
    """The gate for SELECT["gdn_fused_norm"] (mode "candidates": "gdn_fused_norm_candidates"; stage > 0:
    "gdn_normed_stage"): the recurrence with the gated RMSNorm fused in (one threadgroup per sequence and value
    head), reading q, k, v where they lie in the conv output (check_fused_norm)."""
    check_fused_norm(seed, lens, geom, dtype, wdt, mode, stage)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")
@settings(max_examples=6, deadline=None, database=None)
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 19), min_size=1, max_size=3),
       geom=st.sampled_from([g for g in GEOMS if g[2] <= 64 and g[3] <= 64]),
       dtype=st.sampled_from([mx.float32, mx.bfloat16]), mode=st.sampled_from(["states", "inplace", "candidates"]),
       stage=st.sampled_from([1, 3, 4, 8]))
@example(seed=11, lens=[8, 9, 1], geom=(2, 3, 32, 48), dtype=mx.float32, mode="inplace", stage=4)  # whole + partial blocks
def test_gdn_fused_norm_staged_metal_emulated(seed, lens, geom, dtype, mode, stage):
    """The staged body's Metal rendering on the emulator (outputs NaN there until written): segments of one
    block, several, and a partial last one, a decode row beside them, GQA ratios, dk != dv, a padded SIMD group
    (dv = 48); the launch is the staged kernel."""
    from mtlqwen.kernels import metal_emulator  # noqa: PLC0415

    with metal_emulator.emulating() as launches:
        check_fused_norm(seed, lens, geom, dtype, mx.float32, mode, stage)
    suffix = {"states": "", "inplace": "_inplace", "candidates": "_cand"}[mode]
    want = f"gdn_recurrent_normed_staged{suffix}" if max(lens) > 1 else f"gdn_recurrent_normed{suffix}"
    assert [ln.kernel for ln in launches] == [want]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gdn_chunk_boundaries(dtype):
    """Segments of 31/32/33/64/65 tokens packed together through the chunk kernel, vs float64."""
    from mtlqwen.kernels.gdn.kernels import run_gdn  # noqa: PLC0415

    args, layout = make_case(7, [31, 32, 33, 64, 65, 1], 2, 2, 128, 64, dtype=dtype)
    out = run_gdn(**args, layout=layout, chunk=True, init_value=float("nan"))
    no, nstates, _ = naive_gdn(args, layout)
    assert rel(out[0], no) < TOL[dtype] and rel(out[1], nstates) < 1e-3
    out8 = run_gdn(**args, layout=layout, chunk=True, tpr=8, init_value=float("nan"))
    assert rel(out8[0], no) < TOL[dtype] and rel(out8[1], nstates) < 1e-3


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=10, **GPU_SETTINGS)
@given(
    seed=st.integers(0, 2**31),
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    geom=st.sampled_from(GEOMS),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    packed=st.booleans(),
)
def test_gdn_candidates_kernel(seed, lens, geom, dtype, packed):
    """The candidates kernel (every token's state kept, as a verification runs it), reading q, k, v as
    three arrays or in place from the packed conv output, outputs poisoned == the reference."""
    from mtlqwen.kernels.gdn.kernels import run_gdn  # noqa: PLC0415

    args, layout = make_case(seed, lens, *geom, dtype=dtype)
    if packed:
        y, heads = packed_case(args)
        rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}
        out = run_gdn(y, y, y, **rest, layout=layout, heads=heads, candidates=True, init_value=float("nan"))
    else:
        out = run_gdn(**args, layout=layout, candidates=True, init_value=float("nan"))
    assert out is not None
    _check(out, on_cpu(gated_delta_candidates_ref, **args, layout=layout), dtype, f"candidates packed={packed}")


@pytest.mark.gpu
@needs_gpu
def test_dispatchers_use_the_kernels():
    """gated_delta / gated_delta_candidates pick the kernels on a GPU back-end and agree with the twins."""
    assert dispatch.kernel_for("gated_delta") is not None
    assert dispatch.kernel_for("gated_delta_candidates") is not None
    assert dispatch.kernel_for("gated_delta_packed") is not None
    assert dispatch.kernel_for("gated_delta_packed_candidates") is not None
    assert dispatch.kernel_for("gated_delta_packed_normed") is not None
    for lens in ([1, 1, 1], [3, 40]):
        args, layout = make_case(3, lens, 2, 3, 32, 48)
        _check(gated_delta(**args, layout=layout), on_cpu(gated_delta_ref, **args, layout=layout), mx.float32,
               "dispatch")
        _check(gated_delta_candidates(**args, layout=layout), on_cpu(gated_delta_candidates_ref, **args, layout=layout),
               mx.float32, "dispatch candidates")
        y, heads = packed_case(args)
        rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}
        _check(gated_delta_packed(y, **rest, layout=layout, heads=heads),
               on_cpu(gated_delta_ref, **args, layout=layout), mx.float32, "dispatch packed")
        _check(gated_delta_packed_candidates(y, **rest, layout=layout, heads=heads),
               on_cpu(gated_delta_candidates_ref, **args, layout=layout), mx.float32, "dispatch packed candidates")
