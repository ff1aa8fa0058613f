"""check_metal compiles every registered kernel's Metal rendering with g++ (CPU, CI), and fails on
broken kernels; its generated signature matches the one MLX itself writes."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import redirect_stdout

import pytest

import mlx.core as mx
from mtlqwen.kernels import check_metal, portable
from mtlqwen.kernels.portable import KernelExample, PortableKernel

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the Metal compile check")

GOOD_BODY = """
const uint i = GID_X;
float acc = TO_FLOAT(x[i]);
acc = SIMD_SUM(acc);
out[i] = FROM_FLOAT(T, acc * RSQRT(2.0f));
"""
EXAMPLE = KernelExample([(mx.float32, (64,))], [mx.bfloat16], [("T", mx.bfloat16), ("N", 4)])


def _kernel(name: str, body: str) -> PortableKernel:
    return PortableKernel(name=name, input_names=["x"], output_names=["out"], body=body, examples=[EXAMPLE])


def _main(monkeypatch, extra: dict[str, PortableKernel]) -> tuple[int, str]:
    for name, k in extra.items():
        monkeypatch.setitem(portable.REGISTRY, name, k)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = check_metal.main([])
    return rc, buf.getvalue()


def test_all_registered_kernels_compile():
    rc = subprocess.run([sys.executable, "-m", "mtlqwen.kernels.check_metal"], capture_output=True, text=True)
    assert rc.returncode == 0, rc.stdout + rc.stderr
    check_metal._load_all()
    for name, kern in portable.REGISTRY.items():  # every kernel is checked, with at least one instantiation
        assert kern.examples, name
        assert f"ok   {name}[0]" in rc.stdout


def test_a_good_test_kernel_passes(monkeypatch):
    rc, out = _main(monkeypatch, {"pl_test_good": _kernel("pl_test_good", GOOD_BODY)})
    assert rc == 0, out


@pytest.mark.parametrize(
    "broken, message",
    [
        (GOOD_BODY.replace("acc = SIMD_SUM(acc);", "acc = SIMD_SUM(acc)"), "expected"),  # syntax error
        (GOOD_BODY.replace("float acc = TO_FLOAT(x[i]);", "float acc = x;"), "cannot convert"),  # pointer to float
        (GOOD_BODY.replace("acc = SIMD_SUM(acc);", "acc = simd_summ(acc);"), "not declared"),  # unknown built-in
        (GOOD_BODY + 'asm volatile("nop");', "not declared"),  # inline assembly (asm: no keyword here)
    ],
)
def test_broken_kernels_fail(monkeypatch, broken, message):
    rc, out = _main(monkeypatch, {"pl_test_broken": _kernel("pl_test_broken", broken)})
    assert rc == 1
    assert "FAIL pl_test_broken[0]" in out and message in out


def test_kernel_without_examples_fails(monkeypatch):
    k = PortableKernel(name="pl_test_noex", input_names=["x"], output_names=["out"], body=GOOD_BODY)
    rc, out = _main(monkeypatch, {"pl_test_noex": k})
    assert rc == 1 and "no KernelExample" in out


def _mlx_generated(kern: PortableKernel, ex: KernelExample) -> str | None:
    """The source MLX's metal_kernel prints (verbose) while exporting a call on a machine without Metal."""
    built = mx.fast.metal_kernel(
        name=kern.unique_name("metal"), input_names=kern.input_names, output_names=kern.output_names,
        source=kern.source("metal"), header=portable.render_header(kern.header, "metal"),
    )
    inputs = [mx.zeros(shape, dtype=dt) for dt, shape in ex.inputs]

    def fn(*xs):
        return built(inputs=list(xs), output_shapes=[(4,)] * len(ex.outputs), output_dtypes=ex.outputs,
                     grid=(32, 1, 1), threadgroup=(32, 1, 1), template=ex.template, verbose=True)

    # MLX prints from C++: capture file descriptor 1, not sys.stdout
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryDirectory() as d, open(os.path.join(d, "out.txt"), "w+") as cap:
        os.dup2(cap.fileno(), 1)
        try:
            mx.export_function(os.path.join(d, "fn.mlxfn"), fn, *inputs)
        except Exception:  # noqa: BLE001  (Metal present, or an MLX without export tracing of custom kernels)
            pass
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        cap.seek(0)
        text = cap.read()
    if "```" not in text:
        return None
    return text.split("```\n", 1)[1].rsplit("\n```", 1)[0]


@pytest.mark.parametrize("name", ["gdn_chunk", "rms_norm", "causal_conv1d_silu", "pl_test_good"])
def test_signature_matches_mlx(name):
    check_metal._load_all()
    kern = portable.REGISTRY.get(name) or _kernel(name, GOOD_BODY)
    ex = kern.examples[-1]
    theirs = _mlx_generated(kern, ex)
    if theirs is None:
        pytest.skip("this MLX does not print custom-kernel sources during export")
    assert check_metal.metal_source(kern, ex).strip() == theirs.strip()
