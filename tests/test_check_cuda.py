"""check_cuda compiles every registered kernel's CUDA rendering with nvcc (CPU, CI where nvcc exists), as
MLX's cuda_kernel would write it, and fails on broken kernels."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest

import mlx.core as mx
from mtlqwen.kernels import check_cuda, portable
from mtlqwen.kernels.portable import KernelExample, PortableKernel

pytestmark = pytest.mark.skipif(check_cuda.nvcc() is None, reason="needs nvcc for the CUDA compile check")

GOOD_BODY = """
const int i = GID_X;
float acc = TO_FLOAT(x[i]) + (float)x_shape[0];
acc = SIMD_SUM(acc);
out[i] = FROM_FLOAT(T, acc * RSQRT(2.0f));
"""
EXAMPLE = KernelExample([(mx.float32, (64,))], [mx.bfloat16], [("T", mx.bfloat16), ("N", 4), ("B", True)])


def _kernel(name: str, body: str) -> PortableKernel:
    return PortableKernel(name=name, input_names=["x"], output_names=["out"], body=body, examples=[EXAMPLE])


def _main(argv: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = check_cuda.main(argv)
    return rc, buf.getvalue()


def test_all_registered_kernels_compile():
    rc, out = _main([])
    assert rc == 0, out
    for name, kern in portable.REGISTRY.items():  # every kernel, with at least one instantiation
        if not name.startswith("pl_test"):
            assert f"ok   {name}[0]" in out, name


def test_signature_names_shapes_only_where_the_body_uses_them():
    src = check_cuda.cuda_source(_kernel("pl_test_sig", GOOD_BODY), EXAMPLE)
    assert "const float* x,\n    const __grid_constant__ Shape x_shape,\n    __nv_bfloat16* out)" in src
    assert "x_strides" not in src and "constexpr int N = 4;" in src and "using T = __nv_bfloat16;" in src
    assert "constexpr bool B = true;" in src


@pytest.mark.parametrize("broken", [
    GOOD_BODY.replace("acc * RSQRT", "acc * RSQRT_MISSING"),  # unknown function
    GOOD_BODY.replace("float acc", "flaot acc"),  # type error
    GOOD_BODY.replace("(2.0f));", "(2.0f))"),  # syntax error
])
def test_a_broken_kernel_fails(monkeypatch, broken):
    monkeypatch.setitem(portable.REGISTRY, "pl_test_bad", _kernel("pl_test_bad", broken))
    monkeypatch.setitem(portable.REGISTRY, "pl_test_good", _kernel("pl_test_good", GOOD_BODY))
    rc, out = _main(["pl_test_bad", "pl_test_good"])
    assert rc == 1
    assert "FAIL pl_test_bad[0]" in out and "ok   pl_test_good[0]" in out
