"""Compile every registered kernel's CUDA rendering with nvcc (no GPU needed), as MLX's `cuda_kernel` would.

`python -m mtlqwen.kernels.check_cuda [names...]`: for each kernel in `portable.REGISTRY` and each of its
`examples`, write the source MLX 0.32 generates (`build_kernel` in mlx/backend/cuda/custom_kernel.cpp: the
header, `__global__ void name(const T* in, [Shape in_shape,] ..., T* out)` with shape / strides / ndim
parameters only where the body names them, template arguments as `constexpr` / `using` lines), with MLX's
device header replaced by the two types the bodies use, and compile it for sm_90a (MLX's JIT target on an
H200) with `ptxas -v`. Exit status 1 on any failure; `--regs` prints each instantiation's registers and
spills.

Why: a CUDA compile error otherwise shows up only on the lent GPU, after the call's setup time (one
device call of 2026-11-30 was lost to `uint` in a kernel body). What it cannot check: NVRTC-only
differences, and running the kernel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

from .portable import REGISTRY, KernelExample, PortableKernel, render_header

_TYPE = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t",
    mx.uint32: "uint32_t", mx.int64: "int64_t", mx.uint64: "uint64_t", mx.int16: "int16_t",
    mx.uint16: "uint16_t", mx.int8: "int8_t", mx.uint8: "uint8_t", mx.bool_: "bool",
}

# stands in for "mlx/backend/cuda/device/utils.cuh": the shape / strides parameter types
_MLX_DEVICE = r"""
#include <cstdint>
#include <cuda/std/array>
#include <cooperative_groups.h>
namespace mlx { namespace core { namespace cu {
using Shape = cuda::std::array<int32_t, 8>;
using Strides = cuda::std::array<int64_t, 8>;
}}}
"""


def nvcc() -> str | None:
    return os.environ.get("NVCC") or shutil.which("nvcc")


def cuda_source(kern: PortableKernel, ex: KernelExample) -> str:
    """The translation unit MLX would compile for this call."""
    body = kern.source("cuda")
    params = []
    for name, (dt, shape) in zip(kern.input_names, ex.inputs):
        params.append(f"    const {_TYPE[dt]}* {name}")
        if len(shape) > 0:
            for suffix, ty in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if name + suffix in body:
                    params.append(f"    const __grid_constant__ {ty} {name}{suffix}")
    params += [f"    {_TYPE[dt]}* {name}" for name, dt in zip(kern.output_names, ex.outputs)]
    consts = []
    for name, v in ex.template:
        if isinstance(v, bool):
            consts.append(f"  constexpr bool {name} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            consts.append(f"  constexpr int {name} = {v};")
        else:
            consts.append(f"  using {name} = {_TYPE[v]};")
    return (_MLX_DEVICE + render_header(kern.header, "cuda") + "namespace mlx { namespace core { namespace cu {\n"
            + f"__global__ void {kern.unique_name('cuda')}(\n" + ",\n".join(params) + ") {\n"
            + "\n".join(consts) + "\n" + body + "\n}\n}}}\n")


def compile_source(src: str, arch: str = "sm_90a") -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "kernel.cu")
        with open(f, "w") as fh:
            fh.write(src)
        cmd = [nvcc(), f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v", "-o", os.path.join(d, "k.cubin"), f]
        res = subprocess.run(cmd, capture_output=True, text=True)
    return res.returncode == 0, res.stderr


def _usage(msg: str) -> str:
    """'N registers, S bytes spill' from ptxas -v."""
    regs = re.search(r"Used (\d+) registers", msg)
    spill = re.search(r"(\d+) bytes spill stores", msg)
    return f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} bytes spilled"


def cuda_only_jobs() -> list[tuple[str, PortableKernel, KernelExample]]:
    """The CUDA-only kernels outside the portable registry (no Metal rendering: Metal runs MLX's op), each
    instantiation as the kernel module declares it: the tensor-core quantized GEMM (dense, its warpgroup-MMA
    form, and grouped by expert) and prefill attention."""
    from .attention import prefill  # noqa: PLC0415
    from .moe import grouped  # noqa: PLC0415
    from .qmatmul import qgemm, wgmma  # noqa: PLC0415

    return [(f"{kern.name}[{i}]", kern, ex) for mod in (qgemm, wgmma, grouped, prefill)
            for i, (kern, ex) in enumerate(mod.examples())]


def check(kernels: dict[str, PortableKernel] | None = None) -> list[tuple[str, bool, str]]:
    """[(label, ok, compiler message)] for every (kernel, example); with no `kernels`, the CUDA-only
    kernels' instantiations too."""
    jobs = [(f"{name}[{i}]", kern, ex) for name, kern in (REGISTRY if kernels is None else kernels).items()
            for i, ex in enumerate(kern.cuda_examples if kern.cuda_body and kern.cuda_examples else kern.examples)]
    if kernels is None:
        jobs += cuda_only_jobs()

    def run(job):
        label, kern, ex = job
        ok, msg = compile_source(cuda_source(kern, ex))
        return label, ok, msg

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(run, jobs))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    regs = "--regs" in argv
    names = [a for a in argv if a != "--regs"]
    if nvcc() is None:
        print("nvcc not found (set NVCC or put it on PATH): nothing checked")
        return 1
    from . import gpu  # noqa: F401,PLC0415  (every kernel module registers its kernels on import)

    kernels = {n: REGISTRY[n] for n in names} if names else None
    results = check(kernels)
    failed = [r for r in results if not r[1]]
    for label, ok, msg in results:
        print(f"{'ok  ' if ok else 'FAIL'} {label}" + (f"  ({_usage(msg)})" if ok and regs else ""))
        if not ok:
            print(msg[-4000:])
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
