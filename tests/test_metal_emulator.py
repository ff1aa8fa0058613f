"""The Metal emulator (check_metal --run): every registered kernel's Metal rendering runs on the CPU and
matches its reference twin; the emulator's execution model (partial threadgroups, SIMD-group functions
among active lanes, barriers, faults) behaves as Metal's; it catches a kernel copy with a barrier removed
or a shuffle sent to the wrong lane; Apple's limits are checked."""

from __future__ import annotations

import dataclasses
import io
import shutil
from contextlib import redirect_stdout

import numpy as np
import pytest

import mlx.core as mx
from mtlqwen.kernels import check_metal, metal_cases, metal_emulator, portable
from mtlqwen.kernels.metal_emulator import EmulatedKernel, EmulatorError, Launch, limit_violations
from mtlqwen.kernels.portable import PortableKernel

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal emulator")


def test_every_registered_kernel_runs_on_the_emulator():
    results, launches, violations = check_metal.run_trials(trials=metal_cases.trials(edges=False))
    failed = [r for r in results if not r[1]]
    assert not failed, failed
    assert not violations, [v.what for v in violations]
    launched = {ln.kernel for ln in launches}
    assert launched == set(portable.REGISTRY), set(portable.REGISTRY) - launched
    # most registered instantiations ran exactly as declared (same template values)
    declared = [(n, i) for n, k in portable.REGISTRY.items() for i in range(len(k.examples))]
    missed = sorted(set(declared) - set(check_metal.declared_ran(launches)))
    # mtl_paged_attn_s0_g0's examples declare the q|gate row stride (GST 512) that no ungated launch uses
    assert missed == [("mtl_paged_attn_s0_g0", 0), ("mtl_paged_attn_s0_g0", 1)], missed


def test_run_exits_zero_and_counts_the_declared_instantiations():
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = check_metal.main(["--run", "rope_tables"])
    out = buf.getvalue()
    assert rc == 0, out
    assert "ran  rope_tables[bfloat16 H=16]" in out
    assert "emulated: 2 passed, 0 failed, 2 launches, 2 of 2 registered instantiations run as declared" in out


def test_covered_shapes_past_the_examples_fit_apples_limits():
    """The widest shapes paged attention covers on Metal fit Apple's limits. At head_dim 512, 16 query rows
    a threadgroup would need 34,944 bytes of threadgroup memory (over Metal's 32 KiB: the pipeline would
    fail to build on a Mac), so on Metal the op declines it and the reference runs; CUDA keeps 512."""
    edges = metal_cases.edge_trials()
    results, _, violations = check_metal.run_trials([k for t in edges for k in t.kernels], trials=edges)
    assert all(ok for _, ok, _ in results), results
    assert not violations, [v.what for v in violations]
    from mtlqwen.kernels.attention.kernels import covers  # noqa: PLC0415
    from mtlqwen.kernels.metal_emulator import emulating  # noqa: PLC0415

    rng = np.random.default_rng(0)
    q, kp, vp, layout = metal_cases._attn_batch(rng, mx.bfloat16, past=[40], qlens=[4], nkv=1, rep=4, hd=512, bt=16)
    with emulating():
        assert not covers(q.shape, q.dtype, kp, vp, layout)
    from mtlqwen.kernels.backend import gpu_backend  # noqa: PLC0415

    assert gpu_backend() != "metal"


def _run(body: str, inputs, out_shape, out_dtype, grid, group, template=(), header=""):
    names = [f"in{i}" for i in range(len(inputs))]
    k = PortableKernel(name="pl_emu_probe", input_names=names, output_names=["out"], body=body, header=header)
    return EmulatedKernel(k)(inputs=inputs, output_shapes=[out_shape], output_dtypes=[out_dtype], grid=grid,
                             threadgroup=group, template=list(template))[0]


def test_partial_threadgroups_and_simd_functions_among_active_lanes():
    # grid in threads (dispatchThreads): 40 threads in groups of 32 -> a second threadgroup of 8
    body = """
    const uint i = GID_X;
    const float lanes = SIMD_SUM(1.0f);
    const float top = SIMD_MAX((float)LANE);
    const float next = SIMD_SHUFFLE_XOR((float)LANE, 1);
    const float first = SIMD_BROADCAST((float)in0[i], 0);
    out[4 * i] = lanes; out[4 * i + 1] = top; out[4 * i + 2] = next; out[4 * i + 3] = first + TG_SIZE_X;
    """
    x = mx.arange(40, dtype=mx.float32)
    got = np.array(_run(body, [x], (160,), mx.float32, (40, 1, 1), (32, 1, 1))).reshape(40, 4)
    lane = np.arange(40) % 32
    assert (got[:32, 0] == 32).all() and (got[32:, 0] == 8).all()
    assert (got[:32, 1] == 31).all() and (got[32:, 1] == 7).all()
    assert (got[:, 2] == (lane ^ 1)).all()
    assert (got[:32, 3] == 0 + 32).all() and (got[32:, 3] == 32 + 8).all()


def test_barrier_orders_threadgroup_memory_and_outputs_start_poisoned():
    # thread t writes slot t, then reads slot t-1 after the barrier; only even outputs are written
    body = """
    SHARED float buf[64];
    const uint t = TID_X;
    buf[t] = in0[t] * 2.0f;
    BARRIER;
    if (t % 2 == 0) out[t] = buf[(t + 63) % 64];
    """
    x = mx.arange(64, dtype=mx.float32)
    got = np.array(_run(body, [x], (64,), mx.float32, (64, 1, 1), (64, 1, 1)))
    assert np.array_equal(got[::2], 2.0 * ((np.arange(0, 64, 2) + 63) % 64))
    assert np.isnan(got[1::2]).all()  # never written: the 0xFF poison shows
    # without the barrier a read can come before its write (threads run highest first): poisoned, NaN
    got = np.array(_run(body.replace("BARRIER;", ""), [x], (64,), mx.float32, (64, 1, 1), (64, 1, 1)))
    assert np.isnan(got[::2]).any()


def test_faults_and_divergent_barriers_are_errors():
    x = mx.zeros((16,), dtype=mx.float32)
    with pytest.raises(EmulatorError, match="signal"):  # a write far past the output's end
        _run("out[GID_X + 100000] = 1.0f;", [x], (16,), mx.float32, (16, 1, 1), (16, 1, 1))
    with pytest.raises(EmulatorError, match="different threadgroup_barrier"):
        _run("if (TID_X < 8) {\n  BARRIER;\n} else {\n  BARRIER;\n}\nout[GID_X] = 0.0f;", [x], (16,), mx.float32,
             (16, 1, 1), (16, 1, 1))
    with pytest.raises(EmulatorError, match="returned before reaching"):  # MSL: all threads reach a barrier
        _run("if (TID_X < 8) return;\nBARRIER;\nout[GID_X] = 0.0f;", [x], (16,), mx.float32, (16, 1, 1), (16, 1, 1))


def _broken_copy(name: str, old: str, new: str) -> PortableKernel:
    k = portable.REGISTRY[name]
    assert old in k.body, (name, old)
    return dataclasses.replace(k, name=name + "_broken", body=k.body.replace(old, new), _built={})


@pytest.mark.parametrize(
    "kernel, trial, old, new",
    [
        # the cross-SIMD-group reduction of a 4096-wide row without its barrier
        ("rms_norm", "rms_norm[bfloat16 D=4096]", "BARRIER;", ""),
        # the score's quad reduction shuffles with the wrong lane
        ("mtl_paged_attn_s0_g0", "paged_attention[float32 single]", "SIMD_SHUFFLE_XOR(s, 2)", "SIMD_SHUFFLE_XOR(s, 4)"),
    ],
)
def test_run_catches_a_broken_copy_of_a_kernel(monkeypatch, kernel, trial, old, new):
    broken = _broken_copy(kernel, old, new)
    monkeypatch.setitem(portable.REGISTRY, broken.name, broken)
    t = next(t for t in metal_cases.trials([kernel]) if t.label == trial)
    t.substitute, t.kernels = (kernel, broken.name), (broken.name,)
    monkeypatch.setattr(metal_cases, "trials", lambda names=None: [t])
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = check_metal.main(["--run", broken.name])
    out = buf.getvalue()
    assert rc == 1, out
    assert f"MISMATCH {trial}: output 0 at" in out, out
    # the same copy unbroken passes: the mismatch is the mutation's
    fine = dataclasses.replace(broken, body=portable.REGISTRY[kernel].body, _built={})
    monkeypatch.setitem(portable.REGISTRY, broken.name, fine)
    results, _, _ = check_metal.run_trials([broken.name], trials=[t])
    assert results == [(trial, True, "")]


def test_limits_are_reported():
    # 9000 floats of threadgroup memory (36,000 bytes > 32 KiB), measured by running the kernel
    body = "SHARED float big[9000];\nbig[TID_X] = 1.0f;\nBARRIER;\nout[GID_X] = big[0];"
    k = PortableKernel(name="pl_emu_big", input_names=["x"], output_names=["out"], body=body)
    seen = []
    EmulatedKernel(k, seen.append)(inputs=[mx.zeros((4,))], output_shapes=[(32,)], output_dtypes=[mx.float32],
                                   grid=(32, 1, 1), threadgroup=(32, 1, 1))
    assert seen[0].threadgroup_memory == 36000
    cuda_only = dataclasses.replace(k, name="pl_emu_cuda", cuda_body="// tensor cores")
    kernels = {"pl_emu_big": k, "pl_emu_cuda": cuda_only}
    launches = seen + [Launch("pl_emu_big", [], (2048, 1, 1), (2048, 1, 1)),
                       Launch("pl_emu_cuda", [], (32, 1, 1), (32, 1, 1)),
                       Launch("pl_emu_cuda", [], (32, 1, 1), (32, 1, 1), forced=True)]
    whats = [v.what for v in limit_violations(launches, kernels)]
    assert len(whats) == 3, whats
    assert "36000 bytes of threadgroup memory > 32768" in whats[0]
    assert "2048 threads per threadgroup > 1024" in whats[1]
    assert "CUDA-only variant selected on Metal" in whats[2]  # the forced (harness-chosen) one is not


def test_threadgroup_declarations_are_shared_storage_or_an_error():
    body = "threadgroup float a[4];  // per threadgroup\n  threadgroup int n;\n// a threadgroup\nconst int x = 1;"
    out = metal_emulator.rewrite_threadgroup(body)
    assert "static float a[4]; ::pl::tg_note((void*)&a, sizeof(a));" in out
    assert "static int n; ::pl::tg_note((void*)&n, sizeof(n));" in out
    assert "const int x = 1;" in out  # the comment's word is not a declaration
    with pytest.raises(EmulatorError, match="cannot rewrite"):  # would silently be one per thread
        metal_emulator.rewrite_threadgroup("threadgroup float a[4], b[4];")
    assert metal_emulator.rewrite_threadgroup("p = (threadgroup float*)q;") == "p = (threadgroup float*)q;"
