"""conv1d + SiLU, RMSNorm, gated RMSNorm, fused add + RMSNorm and RoPE: reference twins against float64
numpy (CPU, CI) and the GPU kernels against the twins (`-m gpu`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import mlx.core as mx
from mtlqwen.kernels import backend, dispatch
from mtlqwen.kernels.conv import causal_conv1d, causal_conv1d_ref
from mtlqwen.kernels.norms import add_rms_norm_ref, gated_rms_norm_ref, rms_norm, rms_norm_ref
from mtlqwen.kernels.rope import RopeTables, apply_rope_ref, head_norm_rope, head_norm_rope_ref
from mtlqwen.kernels.selection import SELECT
from mtlqwen.kernels.seqs import SeqLayout

from gpu_checks import n_examples

NEEDS_GPU = "needs a GPU back-end (Metal or CUDA); CPU runs the reference"
needs_gpu = pytest.mark.skipif(backend.gpu_backend() is None, reason=NEEDS_GPU)
DTYPES = st.sampled_from([mx.float32, mx.bfloat16])
TOL = {mx.float32: 1e-5, mx.bfloat16: 1e-2}  # bf16: one rounding of the output (2^-8) and some slack
NAN = float("nan")


def f64(x) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def rel(out, ref) -> float:
    out, ref = (f64(t) if isinstance(t, mx.array) else t for t in (out, ref))
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "non-finite (unwritten?) elements"
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def rand(rng, *shape, dtype=mx.float32, scale=1.0):
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def conv_case(seed, lens, C, K, xdt, pdt):
    rng = np.random.default_rng(seed)
    B, S = len(lens), len(lens) + 2
    layout = SeqLayout([0] + [int(x) for x in np.cumsum(lens)], [0] * B, [[0]] * B,
                       [int(x) for x in rng.permutation(S)[:B]])
    return rand(rng, sum(lens), C, dtype=xdt), rand(rng, C, K, dtype=xdt), rand(rng, S, K - 1, C, dtype=pdt), layout


def naive_conv(x, w, pool, layout):
    x, w, pool = f64(x), f64(w), f64(pool)
    K = w.shape[1]
    ys, states = [], []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        xs = np.concatenate([pool[layout.state_rows[i]], x[s:e]])
        acc = np.stack([(xs[t : t + K] * w.T).sum(0) for t in range(e - s)])
        ys.append(acc / (1 + np.exp(-acc)))
        states.append(xs[e - s :])
    return np.concatenate(ys), np.stack(states)


# ---- CPU: references vs float64 ---------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 9), min_size=1, max_size=4), K=st.sampled_from([2, 4]))
def test_conv_reference(seed, lens, K):
    x, w, pool, layout = conv_case(seed, lens, 24, K, mx.float32, mx.float32)
    y, st_ = causal_conv1d_ref(x, w, pool, layout)
    ny, nst = naive_conv(x, w, pool, layout)
    assert rel(y, ny) < 1e-5 and rel(st_, nst) == 0.0


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), lens=st.lists(st.integers(1, 9), min_size=1, max_size=4), K=st.sampled_from([2, 4]),
       on=st.booleans())
def test_conv_inplace_op_runs_the_reference_on_cpu(seed, lens, K, on):
    """The conv op asked to write its states, in-place switch on or off, is the reference on the CPU: it
    returns the new states (for the caller's scatter) and leaves the pool alone."""
    x, w, pool, layout = conv_case(seed, lens, 24, K, mx.float32, mx.bfloat16)
    before = f64(pool)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SELECT, "conv_state_inplace", int(on))
        y, states = causal_conv1d(x, w, pool, layout, write_state=True)
    ry, rst = causal_conv1d_ref(x, w, pool, layout)
    assert states is not None and mx.array_equal(y, ry).item() and mx.array_equal(states, rst).item()
    assert np.array_equal(f64(pool), before)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), N=st.integers(1, 9), D=st.sampled_from([8, 48, 256]))
def test_norm_references(seed, N, D):
    rng = np.random.default_rng(seed)
    x, z, d, w = rand(rng, N, D), rand(rng, N, D), rand(rng, N, D), 1 + rand(rng, D, scale=0.2)
    xf, zf, wf = f64(x), f64(z), f64(w)
    y = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * wf
    assert rel(rms_norm_ref(x, w, 1e-6), y) < 1e-5
    assert rel(gated_rms_norm_ref(x, z, w, 1e-6), y * zf / (1 + np.exp(-zf))) < 1e-5
    hs, yn = add_rms_norm_ref(x, d, w, 1e-6)
    hf = xf + f64(d)
    assert rel(hs, hf) < 1e-6
    assert rel(yn, hf / np.sqrt((hf**2).mean(-1, keepdims=True) + 1e-6) * wf) < 1e-5


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 7), D=st.sampled_from([64, 256]))
def test_rope_reference(seed, T, D):
    rng = np.random.default_rng(seed)
    tables = RopeTables(64, 1e7, initial=64)
    x = rand(rng, T, 3, D)
    pos = rng.integers(0, 1000, T)
    tables.ensure(int(pos.max()))
    out = apply_rope_ref(x, mx.array(pos.astype(np.int32)), tables)
    xf = f64(x)
    phase = pos[:, None, None] * 1e7 ** (-np.arange(0, 64, 2) / 64)[None, None, :]
    x1, x2 = xf[..., :32], xf[..., 32:64]
    want = np.concatenate([x1 * np.cos(phase) - x2 * np.sin(phase), x2 * np.cos(phase) + x1 * np.sin(phase),
                           xf[..., 64:]], axis=-1)
    assert rel(out, want) < 1e-4  # fp32 angles of positions up to 1000


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 6), H=st.sampled_from([1, 3]), D=st.sampled_from([64, 128]),
       extra=st.sampled_from([0, 1]))
def test_head_norm_rope_reference(seed, T, H, D, extra):
    """Per-head RMSNorm of each head's first D values (rows of D * (1 + extra): q inside q|gate), then
    partial RoPE: against a float64 version, and the dispatcher (off or on CPU) equals the reference."""
    rng = np.random.default_rng(seed)
    tables = RopeTables(32, 1e6, initial=64)
    x, w = rand(rng, T, H, D * (1 + extra)), 1 + rand(rng, D, scale=0.2)
    pos = rng.integers(0, 500, T)
    tables.ensure(int(pos.max()))
    p = mx.array(pos.astype(np.int32))
    out = head_norm_rope_ref(x, w, 1e-6, p, tables, D)
    xf = f64(x)[..., :D]
    n = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * f64(w)
    phase = pos[:, None, None] * 1e6 ** (-np.arange(0, 32, 2) / 32)[None, None, :]
    x1, x2 = n[..., :16], n[..., 16:32]
    want = np.concatenate([x1 * np.cos(phase) - x2 * np.sin(phase), x2 * np.cos(phase) + x1 * np.sin(phase),
                           n[..., 32:]], axis=-1)
    assert out.shape == (T, H, D) and rel(out, want) < 1e-4
    assert mx.array_equal(head_norm_rope(x, w, 1e-6, p, tables, D), out).item()


# ---- GPU: kernels vs references -----------------------------------------------------------------------

# device time is scarce: no shrinking (a failure reports the drawn example as is)
GPU_SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                        phases=[Phase.explicit, Phase.reuse, Phase.generate])


def on_cpu(fn, *args):
    """References run on the CPU stream (exact fp32 whatever the GPU's matmul mode)."""
    with mx.stream(mx.cpu):
        out = fn(*args)
        mx.eval(out)
    return out


@pytest.mark.gpu
@needs_gpu
@GPU_SETTINGS
@given(seed=st.integers(0, 2**31), lens=st.lists(st.one_of(st.integers(1, 4), st.integers(5, 70)), min_size=1,
                                                  max_size=5),
       C=st.sampled_from([24, 416, 300]), xdt=DTYPES, pdt=DTYPES)
def test_conv_kernel(seed, lens, C, xdt, pdt):
    from mtlqwen.kernels.conv.kernels import run_conv  # noqa: PLC0415

    x, w, pool, layout = conv_case(seed, lens, C, 4, xdt, pdt)
    y, st_ = run_conv(x, w, pool, layout, init_value=NAN)
    ry, rst = on_cpu(causal_conv1d_ref, x, w, pool, layout)
    assert y.dtype == xdt and st_.dtype == pdt
    assert rel(y, ry) < TOL[xdt]
    assert rel(st_, rst) == 0.0  # states are copies


@pytest.mark.gpu
@needs_gpu
@settings(GPU_SETTINGS, max_examples=n_examples(18))  # device_run.sh runs it with a third of them
@given(seed=st.integers(0, 2**31), lens=st.lists(st.one_of(st.integers(1, 4), st.integers(5, 70)), min_size=1,
                                                  max_size=5),
       C=st.sampled_from([24, 416, 300]), K=st.sampled_from([2, 3, 4]), xdt=DTYPES, pdt=DTYPES)
@example(seed=5, lens=[1, 2, 1, 3], C=8192, K=4, xdt=mx.bfloat16, pdt=mx.bfloat16)  # 9B decode-ish, odd T
def test_conv_inplace_kernel(seed, lens, C, K, xdt, pdt):
    """The gate for SELECT["conv_state_inplace"]: the conv kernel that writes the new states into the pool
    rows itself. y (poisoned first) == the reference; the sequences' pool rows hold the reference's new
    states bit for bit (they are copies); every other pool row is unchanged."""
    from mtlqwen.kernels.conv.kernels import run_conv  # noqa: PLC0415

    x, w, pool, layout = conv_case(seed, lens, C, K, xdt, pdt)
    before = f64(pool)
    ry, rst = on_cpu(causal_conv1d_ref, x, w, mx.array(before).astype(pdt), layout)
    y, done = run_conv(x, w, pool, layout, init_value=NAN, inplace=True)
    mx.eval(y, done)
    after = f64(pool)
    assert y.dtype == xdt and y.shape == ry.shape and done.item() == 1
    assert rel(y, ry) < TOL[xdt]
    assert np.array_equal(after[layout.state_rows], f64(rst))
    others = [i for i in range(after.shape[0]) if i not in layout.state_rows]
    assert np.array_equal(after[others], before[others])


@pytest.mark.gpu
@needs_gpu
@GPU_SETTINGS
@given(seed=st.integers(0, 2**31), shape=st.sampled_from([(1, 4096), (7, 4096), (5, 1024), (9, 48), (3, 5, 256),
                                                          (2, 3, 128), (33, 1000)]),
       dtype=DTYPES, wdt=DTYPES)
def test_norm_kernels(seed, shape, dtype, wdt):
    from mtlqwen.kernels.norms.kernels import add_rms_norm_kernel, gated_rms_norm_kernel, rms_norm_kernel  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    x, z, d = (rand(rng, *shape, dtype=dtype) for _ in range(3))
    w = 1 + rand(rng, shape[-1], dtype=wdt, scale=0.2)
    eps = float(rng.choice([1e-6, 1e-5]))
    assert rel(rms_norm_kernel(x, w, eps, init_value=NAN), on_cpu(rms_norm_ref, x, w, eps)) < TOL[dtype]
    assert rel(gated_rms_norm_kernel(x, z, w, eps, init_value=NAN), on_cpu(gated_rms_norm_ref, x, z, w, eps)) < TOL[dtype]
    hs, y = add_rms_norm_kernel(x, d, w, eps, init_value=NAN)
    rhs, ry = on_cpu(add_rms_norm_ref, x, d, w, eps)
    assert rel(hs, rhs) == 0.0 and rel(y, ry) < TOL[dtype]


@pytest.mark.gpu
@needs_gpu
@GPU_SETTINGS
@given(seed=st.integers(0, 2**31), T=st.integers(1, 40), H=st.sampled_from([1, 3, 16]), D=st.sampled_from([64, 256]),
       dtype=DTYPES)
def test_rope_kernel(seed, T, H, D, dtype):
    from mtlqwen.kernels.rope.kernels import rope_kernel  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    tables = RopeTables(64, 1e7, initial=256)
    x = rand(rng, T, H, D, dtype=dtype)
    pos = mx.array(rng.integers(0, 256, T).astype(np.int32))
    out = rope_kernel(x, pos, tables, init_value=NAN)
    ref = on_cpu(apply_rope_ref, x, pos, tables)
    assert rel(out, ref) < TOL[dtype]
    assert mx.array_equal(out[..., 64:], x[..., 64:]).item()  # pass-through dims are copied bit for bit


@pytest.mark.gpu
@needs_gpu
@GPU_SETTINGS
@given(seed=st.integers(0, 2**31), T=st.integers(1, 40), H=st.sampled_from([1, 3, 4, 16]), D=st.sampled_from([128, 256]),
       stride=st.sampled_from([1, 2]), rd=st.sampled_from([32, 64]), dtype=DTYPES)
def test_head_norm_rope_kernel(seed, T, H, D, stride, rd, dtype):
    """Rows read with a stride (q inside the q|gate projection when stride=2), row counts that leave a
    threadgroup part-full, bf16 / fp32; the output is poisoned first, so an unwritten element fails."""
    from mtlqwen.kernels.rope.kernels import head_norm_rope_kernel  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    tables = RopeTables(rd, 1e7, initial=256)
    x, w = rand(rng, T, H, D * stride, dtype=dtype), 1 + rand(rng, D, dtype=dtype, scale=0.2)
    pos = mx.array(rng.integers(0, 256, T).astype(np.int32))
    eps = float(rng.choice([1e-6, 1e-5]))
    out = head_norm_rope_kernel(x, w, eps, pos, tables, D, init_value=NAN)
    ref = on_cpu(head_norm_rope_ref, x, w, eps, pos, tables, D)
    assert out.shape == ref.shape == (T, H, D)
    assert rel(out, ref) < TOL[dtype]


@pytest.mark.gpu
@needs_gpu
def test_dispatchers_use_the_kernels():
    for op in ("causal_conv1d", "rms_norm", "gated_rms_norm", "rope", "add_rms_norm",
               "head_norm_rope"):
        assert dispatch.kernel_for(op) is not None, op
    x, w, pool, layout = conv_case(1, [3, 1, 20], 416, 4, mx.bfloat16, mx.bfloat16)
    want = on_cpu(causal_conv1d_ref, x, w, pool, layout)
    for got, ref in zip(causal_conv1d(x, w, pool, layout), want):
        assert rel(got, ref) < TOL[mx.bfloat16]
    with pytest.MonkeyPatch.context() as mp:  # asked to write its states: the in-place kernel does
        mp.setitem(SELECT, "conv_state_inplace", 1)
        y, states = causal_conv1d(x, w, pool, layout, write_state=True)
        mx.eval(y)
    assert states is None and rel(y, want[0]) < TOL[mx.bfloat16]
    assert np.array_equal(f64(pool)[layout.state_rows], f64(want[1]))
    rng = np.random.default_rng(2)
    x, w = rand(rng, 4, 4096, dtype=mx.bfloat16), rand(rng, 4096, dtype=mx.bfloat16)
    assert rel(rms_norm(x, w, 1e-6), on_cpu(rms_norm_ref, x, w, 1e-6)) < TOL[mx.bfloat16]
