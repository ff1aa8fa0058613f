"""Run a kernel's Metal rendering on the CPU: the source MLX's `metal_kernel` would build, compiled by g++
against metal_shim.h + metal_emu.h (threadgroups of fibers, real barriers, SIMD-group collectives in
lockstep), one process per launch so that a fault is a reported failure rather than a crash.

`EmulatedKernel(kern)` takes the same call as the object `mx.fast.metal_kernel` returns (inputs,
output_shapes, output_dtypes, grid in threads, threadgroup, template, init_value) and returns the
outputs; kernels that write through an input pointer (the in-place pools) change that input, as on the
GPU. Outputs without an init_value start as 0xFF bytes (NaN), so an element the kernel never writes shows.
`emulating()` makes the ops launch their kernels on this emulator as if on Metal and records each launch
(`Launch`) for the limits check. Executables are cached per source hash under $TMPDIR
(MTLQWEN_EMU_CACHE overrides the directory).

What it cannot show: races between threadgroups (they run one at a time, so a missing device fence or a
wrong "last threadgroup" count passes), and 16-bit arithmetic (it goes through float; the kernels keep
float arithmetic anyway). It is stricter than the GPU in one way: lanes of a simdgroup run one after
another between SIMD-group functions, so code that relies on their implicit lockstep through threadgroup
memory, without a barrier, fails here. Reads before a buffer's start are not caught (past its end are).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import mlx.core as mx

from .metal_source import _TYPE, _tmpl_value, kernel_name, metal_source, signature
from .portable import REGISTRY, KernelExample, PortableKernel

HERE = Path(__file__).parent
HEADERS = (HERE / "metal_shim.h", HERE / "metal_emu.h")
CXXFLAGS = ["-std=c++17", "-O1", "-w", "-fno-strict-aliasing"]

# `threadgroup float part[32];` -> static storage shared by the threadgroup's fibers, registered (size, poison)
_TG_DECL = re.compile(
    r"(?m)^([ \t]*)threadgroup[ \t]+((?:const[ \t]+)?[A-Za-z_][\w:]*(?:<[^;>\n]*>)?)[ \t]+([A-Za-z_]\w*)[ \t]*"
    r"((?:\[[^\]\n]+\])*)[ \t]*;")
# what is left of a threadgroup variable declaration after the rewrite (not a pointer or a cast)
_TG_LEFT = re.compile(r"\bthreadgroup[ \t]+(?:const[ \t]+)?[A-Za-z_][\w:]*(?:<[^;>]*>)?[ \t]+[A-Za-z_]\w*[ \t]*[\[;=]")
RUN_TIMEOUT_S = 300


class EmulatorError(RuntimeError):
    """The emulated launch failed (compile error, fault, divergent barrier...)."""


@dataclass
class Launch:
    kernel: str
    template: list
    grid: tuple
    threadgroup: tuple
    threadgroup_memory: int = 0  # bytes of threadgroup variables the launch declared
    trial: str = ""  # the check_metal --run trial that made it
    forced: bool = False  # a variant the harness substituted (metal_emulator.substituted), not an op's choice


def rewrite_threadgroup(body: str) -> str:
    """Threadgroup variables -> static storage (one instance, shared by the fibers of the running
    threadgroup). A declaration the pattern does not recognise is an error, not a per-thread local."""
    out = _TG_DECL.sub(lambda m: f"{m.group(1)}static {m.group(2)} {m.group(3)}{m.group(4)}; "
                                  f"::pl::tg_note((void*)&{m.group(3)}, sizeof({m.group(3)}));", body)
    left = _TG_LEFT.search(re.sub(r"//[^\n]*", "", out))
    if left:
        raise EmulatorError(f"threadgroup declaration the emulator cannot rewrite: {left.group(0)!r} "
                            "(declare one variable per statement, on its own line)")
    return out


def driver_source(kern: PortableKernel, ex: KernelExample) -> str:
    """The translation unit of one instantiation: kernel source, then `pl_thread` calling it."""
    src = metal_source(kern, ex, body=rewrite_threadgroup(kern.source("metal")))
    args = []
    for kind, name, i, _ in signature(kern, ex):
        if kind == "attr":
            args.append(f"t.{name}")
            continue
        b = f"pl::buffers[{i}]"
        dt = _TYPE[(ex.inputs[i][0] if i < len(ex.inputs) else ex.outputs[i - len(ex.inputs)])]
        args.append({"input": f"(const {dt}*){b}.data", "scalar": f"*(const {dt}*){b}.data",
                     "output": f"({dt}*){b}.data", "shape": f"(const int*){b}.shape",
                     "strides": f"(const int64_t*){b}.strides", "ndim": f"{b}.ndim"}[kind])
    call = kernel_name(kern, ex)
    if ex.template:
        call += "<" + ", ".join(_tmpl_value(v) for _, v in ex.template) + ">"
    return (src + "\nstatic void pl_thread(const pl::Thread& t) {\n  " + call + "(" + ", ".join(args) + ");\n}\n"
            + "int main(int argc, char** argv) { return pl::main_(argc, argv, pl_thread); }\n")


def cache_dir() -> Path:
    user = os.getuid() if hasattr(os, "getuid") else 0  # one per user: another's directory may not be writable
    d = Path(os.environ.get("MTLQWEN_EMU_CACHE") or Path(tempfile.gettempdir()) / f"mtlqwen-metal-emu-{user}")
    d.mkdir(parents=True, exist_ok=True)
    return d


_compile_lock = threading.Lock()
_compiling: dict[str, threading.Lock] = {}


def compile_driver(src: str, compiler: str | None = None) -> Path:
    """Executable for a driver source, built once per (source, headers, flags) hash."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or "g++"
    h = hashlib.sha256(src.encode())
    for hdr in HEADERS:
        h.update(hdr.read_bytes())
    h.update(" ".join([cxx] + CXXFLAGS).encode())
    key = h.hexdigest()[:20]
    exe = cache_dir() / f"k_{key}"
    with _compile_lock:
        lock = _compiling.setdefault(key, threading.Lock())
    with lock:
        if exe.exists():
            return exe
        with tempfile.TemporaryDirectory(dir=cache_dir()) as d:
            Path(d, "metal_stdlib").write_text(f'#include "{HEADERS[1]}"\n')
            f = Path(d, "kernel.cpp")
            f.write_text(src)
            tmp = Path(d, "k")
            res = subprocess.run([cxx, *CXXFLAGS, "-I", d, str(f), "-o", str(tmp)], capture_output=True, text=True)
            if res.returncode != 0:
                raise EmulatorError("compile failed:\n" + res.stderr[-4000:])
            os.replace(tmp, exe)  # atomic: a concurrent run never sees half an executable
    return exe


def _bytes_of(a: mx.array) -> np.ndarray:
    """A writable uint8 view of a row-contiguous array's memory (its own buffer, not a copy)."""
    mx.eval(a)
    return np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8)


def _fill(shape, dtype, init_value) -> mx.array:
    if init_value is None:  # uninitialised on the GPU: 0xFF bytes (NaN / -1) make unwritten elements show
        n = int(np.prod(shape)) * dtype.size
        return mx.array(np.full(n, 0xFF, dtype=np.uint8)).view(dtype).reshape(shape)
    # built in numpy: mx.full may be a broadcast (stride 0) that has no buffer of its own to write into
    return mx.array(np.full(shape, init_value, dtype=np.float64)).astype(dtype)


class EmulatedKernel:
    """Stands in for `mx.fast.metal_kernel(...)`'s callable of one PortableKernel."""

    def __init__(self, kern: PortableKernel, on_launch=None, sources: set | None = None):
        self.kern = kern
        self.on_launch = on_launch
        self.sources = sources  # a dry run: collect the driver sources, run nothing (outputs stay poison)

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        kern = self.kern
        if len(inputs) != len(kern.input_names) or len(output_shapes) != len(kern.output_names):
            raise EmulatorError(f"{kern.name}: {len(inputs)} inputs / {len(output_shapes)} outputs for "
                                f"{kern.input_names} / {kern.output_names}")
        arrays = []
        for x in inputs:
            x = x if isinstance(x, mx.array) else mx.array(x)
            mx.eval(x)
            if not memoryview(x).c_contiguous:  # ensure_row_contiguous: MLX copies (writes to it are lost)
                x = mx.contiguous(x)
            arrays.append(x)
        outs = [_fill(tuple(s), dt, init_value) for s, dt in zip(output_shapes, output_dtypes)]
        ex = KernelExample([(a.dtype, tuple(a.shape)) for a in arrays], list(output_dtypes), list(template or []))
        launch = Launch(kern.name, list(template or []), tuple(grid), tuple(threadgroup))
        if self.sources is not None:
            self.sources.add(driver_source(kern, ex))
            return outs
        exe = compile_driver(driver_source(kern, ex))
        views = [_bytes_of(a) for a in arrays + outs]
        with tempfile.TemporaryDirectory(dir=cache_dir()) as d:
            fin, fout = Path(d, "in"), Path(d, "out")
            with open(fin, "wb") as f:
                f.write(np.array(list(grid) + list(threadgroup) + [len(views)], dtype=np.uint32).tobytes())
                for a, v in zip(arrays + outs, views):
                    shape = list(a.shape) + [0] * (8 - a.ndim)
                    strides = [int(np.prod(a.shape[i + 1:])) for i in range(a.ndim)] + [0] * (8 - a.ndim)
                    f.write(np.array([v.size], dtype=np.uint64).tobytes() + np.array([a.ndim], dtype=np.int32).tobytes()
                            + np.array(shape, dtype=np.int32).tobytes() + np.array(strides, dtype=np.int64).tobytes())
                    f.write(v.tobytes())
            try:
                res = subprocess.run([str(exe), str(fin), str(fout)], capture_output=True, text=True,
                                     timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:  # threadgroups run in turn: a spin-wait on another never ends
                raise EmulatorError(f"{kern.name} {_describe(launch)}: no end after {RUN_TIMEOUT_S} s") from e
            if res.returncode != 0:
                why = res.stderr.strip() or f"exit status {res.returncode}"
                if res.returncode < 0:
                    why = f"killed by signal {-res.returncode} (a read or write outside a buffer?) {why}"
                raise EmulatorError(f"{kern.name} {_describe(launch)}: {why}")
            data = np.fromfile(fout, dtype=np.uint8)
        m = re.search(r"threadgroup_memory=(\d+)", res.stdout)
        launch.threadgroup_memory = int(m.group(1)) if m else 0
        off = 0
        for v in views:  # inputs too: a kernel may write through an input pointer (in-place pools)
            new = data[off:off + v.size]
            if not np.array_equal(new, v):
                v[:] = new
            off += v.size
        if self.on_launch is not None:
            self.on_launch(launch)
        return outs


def precompile(sources: set, workers: int = 2) -> None:
    """Build the executables of a dry run's sources, `workers` compilers at a time (errors surface again,
    reported, when the launch itself compiles)."""
    def build(src):
        try:
            compile_driver(src)
        except EmulatorError:
            pass

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(build, sorted(sources)))


def _describe(launch: Launch) -> str:
    return f"grid {launch.grid} threadgroup {launch.threadgroup} template {launch.template}"


@contextlib.contextmanager
def emulating(kernels: dict[str, PortableKernel] | None = None, sources: set | None = None):
    """Inside: `gpu_backend()` is 'metal' and every registered kernel's Metal build is its EmulatedKernel.
    Yields the list the launches are appended to. With `sources`, a dry run that only collects them."""
    from . import backend  # noqa: PLC0415

    kernels = REGISTRY if kernels is None else kernels
    launches: list[Launch] = []
    saved_avail = mx.metal.is_available
    saved = {name: k._built.get("metal") for name, k in kernels.items()}
    mx.metal.is_available = lambda: True
    backend.gpu_backend.cache_clear()
    for k in kernels.values():
        k._built["metal"] = EmulatedKernel(k, launches.append, sources)
    try:
        yield launches
    finally:
        mx.metal.is_available = saved_avail
        backend.gpu_backend.cache_clear()
        for name, k in kernels.items():
            if saved[name] is None:
                k._built.pop("metal", None)
            else:
                k._built["metal"] = saved[name]


@contextlib.contextmanager
def substituted(sub: tuple[str, str] | None, launches: list, sources: set | None = None):
    """Inside `emulating`: launches of registered kernel sub[0] run sub[1]'s Metal rendering instead
    (recorded as forced: the harness chose that variant, no op did)."""
    if sub is None:
        yield
        return
    stand_in, variant = REGISTRY[sub[0]], REGISTRY[sub[1]]
    saved = stand_in._built.get("metal")

    def record(ln):
        ln.forced = True
        launches.append(ln)

    stand_in._built["metal"] = EmulatedKernel(variant, record, sources)
    try:
        yield
    finally:
        stand_in._built["metal"] = saved


@dataclass
class LimitViolation:
    kernel: str
    what: str


# Apple GPUs (Metal feature set tables): per threadgroup
MAX_THREADGROUP_MEMORY = 32 * 1024
MAX_THREADS_PER_THREADGROUP = 1024


def limit_violations(launches: list[Launch], kernels: dict[str, PortableKernel] | None = None) -> list[LimitViolation]:
    """Every launch over Apple's limits, and every launch of a CUDA-only variant on Metal."""
    kernels = REGISTRY if kernels is None else kernels
    out = []
    for ln in launches:
        threads = int(np.prod(ln.threadgroup))
        where = f"{ln.kernel} {_describe(ln)}" + (f" (trial {ln.trial})" if ln.trial else "")
        if threads > MAX_THREADS_PER_THREADGROUP:
            out.append(LimitViolation(ln.kernel, f"{where}: {threads} threads per threadgroup > "
                                                 f"{MAX_THREADS_PER_THREADGROUP}"))
        if ln.threadgroup_memory > MAX_THREADGROUP_MEMORY:
            out.append(LimitViolation(ln.kernel, f"{where}: {ln.threadgroup_memory} bytes of threadgroup memory > "
                                                 f"{MAX_THREADGROUP_MEMORY}"))
        k = kernels.get(ln.kernel)
        if k is not None and k.cuda_body is not None and not ln.forced:
            out.append(LimitViolation(ln.kernel, f"{where}: CUDA-only variant selected on Metal"))
    return out
