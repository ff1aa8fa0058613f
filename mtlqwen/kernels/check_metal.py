"""Compile-check every registered kernel's Metal rendering with g++ (no Apple GPU needed).

`python -m mtlqwen.kernels.check_metal [names...]`: for each kernel in `portable.REGISTRY` and each of
its `examples` (concrete dtypes, shapes, template arguments), write the source MLX's `metal_kernel`
would generate (header, signature with `[[buffer(i)]]` parameters and only the thread attributes the
body names, template instantiation), swap <metal_stdlib> for `metal_shim.h`, and run
`g++ -fsyntax-only -std=c++17`. Exit status 1 on any failure, with the compiler's message.

What this proves: the body parses and type-checks as C++ against the Metal built-ins we declare, for
those instantiations. What it cannot: address spaces and Metal-only restrictions.

`--run` then executes them: every trial of metal_cases.py launches kernels through their ops' GPU entries
on the CPU emulator (metal_emulator.py, metal_emu.h: threadgroups of fibers, real barriers, SIMD-group
functions in lockstep, outputs poisoned) and compares the outputs with the reference twins; every launch
is checked against Apple's limits (32 KiB of threadgroup memory, 1024 threads a threadgroup, no CUDA-only
variant). Exit status 1 names the kernel, the trial and the first mismatching element or violation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import mlx.core as mx

from .metal_source import SHIM, metal_source
from .portable import REGISTRY, PortableKernel


def compile_source(src: str, compiler: str | None = None) -> tuple[bool, str]:
    """g++ -fsyntax-only on a Metal source with <metal_stdlib> resolved to the shim."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or "g++"
    with tempfile.TemporaryDirectory() as d:
        Path(d, "metal_stdlib").write_text(f'#include "{SHIM}"\n')
        f = Path(d, "kernel.cpp")
        f.write_text(src)
        # -fno-asm: `asm` is no keyword (Metal has no inline assembly: CUDA's must sit behind #if __CUDACC__)
        cmd = [cxx, "-std=c++17", "-fsyntax-only", "-fno-asm", "-Wno-attributes", "-Wno-unknown-pragmas",
               "-I", d, str(f)]
        res = subprocess.run(cmd, capture_output=True, text=True)
    return res.returncode == 0, res.stderr


def check(kernels: dict[str, PortableKernel] | None = None) -> list[tuple[str, bool, str]]:
    """[(label, ok, compiler message)] for every (kernel, example)."""
    kernels = REGISTRY if kernels is None else kernels
    jobs = []
    for name, kern in kernels.items():
        if not kern.examples:
            jobs.append((name, None, "no KernelExample declared: check_metal needs one to write a signature"))
        for i, ex in enumerate(kern.examples):
            jobs.append((f"{name}[{i}]", metal_source(kern, ex), ""))

    def run(job):
        label, src, msg = job
        if src is None:
            return label, False, msg
        ok, err = compile_source(src)
        return label, ok, err

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(run, jobs))


def _load_all() -> None:
    from . import gpu  # noqa: F401,PLC0415  (every kernel module registers its kernels on import)


def first_mismatch(got, want, tol: float) -> str | None:
    """Where `got` first leaves `want` by more than tol x max|want| (tol 0: bit for bit; a non-finite
    element where the reference is finite -- an unwritten, poisoned one -- always counts), or None."""
    g = np.array(mx.array(got).astype(mx.float32))
    w = np.array(mx.array(want).astype(mx.float32))
    if g.shape != w.shape:
        return f"shape {g.shape}, reference {w.shape}"
    scale = float(np.abs(w[np.isfinite(w)]).max()) if np.isfinite(w).any() else 0.0
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    bad = ~same & (~np.isfinite(g) | ~np.isfinite(w) | (np.abs(g - w) > tol * scale))
    if not bad.any():
        return None
    i = tuple(int(v) for v in np.argwhere(bad)[0])
    return (f"at {i}: {float(g[i]):.7g}, reference {float(w[i]):.7g} (tolerance {tol:g} x {scale:.4g}); "
            f"{int(bad.sum())} of {bad.size} elements differ")


def declared_ran(launches, kernels: dict[str, PortableKernel] | None = None) -> list[tuple[str, int]]:
    """(kernel, example index) of the registered examples some launch ran with the same template values
    (a bool and the int MLX writes for it count as the same)."""
    def norm(tmpl):
        return [(n, int(v) if isinstance(v, bool) else v) for n, v in tmpl]

    kernels = REGISTRY if kernels is None else kernels
    ran = {(ln.kernel, repr(norm(ln.template))) for ln in launches}
    return [(n, i) for n, k in kernels.items() for i, ex in enumerate(k.examples) if (n, repr(norm(ex.template))) in ran]


def run_trials(names: list[str] | None = None, trials=None) -> tuple[list[tuple[str, bool, str]], list, list]:
    """Execute the trials (metal_cases) on the emulator: ([(label, ok, message)], launches, limit violations).
    A registered kernel (of `names`) that no trial launched is a failure too."""
    from . import metal_cases, metal_emulator  # noqa: PLC0415

    _load_all()
    kernels = {n: REGISTRY[n] for n in names} if names else dict(REGISTRY)
    trials = metal_cases.trials(names) if trials is None else trials
    # a dry pass collects every launch's source (outputs stay poison: no launch depends on another's
    # values for its source), so that g++ runs two at a time, not one per launch in turn
    sources: set = set()
    with metal_emulator.emulating(sources=sources) as dry:
        for t in trials:
            try:
                with metal_emulator.substituted(t.substitute, dry, sources):
                    t.run()
            except Exception:  # noqa: BLE001,S112  (the real pass reports it)
                continue
    metal_emulator.precompile(sources, workers=min(2, os.cpu_count() or 1))
    results = []
    with metal_emulator.emulating() as launches:
        for t in trials:
            n0 = len(launches)
            try:
                want = t.ref()
                with metal_emulator.substituted(t.substitute, launches):
                    got = t.run()
                if len(got) != len(want) or len(got) != len(t.tol):
                    raise metal_emulator.EmulatorError(
                        f"{len(got)} outputs, reference {len(want)}, {len(t.tol)} tolerances")
                msgs = [f"output {i} {m}" for i, (g, w, tol) in enumerate(zip(got, want, t.tol))
                        if (m := first_mismatch(g, w, tol)) is not None]
                ran = {ln.kernel for ln in launches[n0:]}
                missing = [k for k in t.kernels if k not in ran]
                if missing:
                    msgs.append(f"did not launch {missing} (launched {sorted(ran)})")
                where = "; ".join(f"{ln.kernel} template {ln.template}" for ln in launches[n0:])
                results.append((t.label, not msgs, f"{msgs[0]} [launched: {where}]" if msgs else ""))
            except Exception as e:  # noqa: BLE001  (an emulator failure is this trial's failure)
                results.append((t.label, False, f"{type(e).__name__}: {e}"))
            for ln in launches[n0:]:
                ln.trial = t.label
    launched = {ln.kernel for ln in launches}
    for name in kernels:
        if name not in launched:
            results.append((name, False, "no trial launched this kernel (add one to metal_cases.py)"))
    return results, launches, metal_emulator.limit_violations(launches, kernels)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run = "--run" in argv
    names = [a for a in argv if a != "--run"]
    _load_all()
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        print(f"unknown kernels {unknown}; registered: {sorted(REGISTRY)}")
        return 1
    kernels = {n: REGISTRY[n] for n in names} if names else None
    results = check(kernels)
    failed = [r for r in results if not r[1]]
    for label, ok, msg in results:
        print(f"{'ok  ' if ok else 'FAIL'} {label}")
        if not ok:
            print(msg)
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if not run:
        return 1 if failed else 0
    runs, launches, violations = run_trials(names or None)
    bad = [r for r in runs if not r[1]]
    for label, ok, msg in runs:
        print(f"{'ran ' if ok else 'MISMATCH'} {label}" + ("" if ok else f": {msg}"))
    for v in violations:
        print(f"LIMIT {v.what}")
    exact = len(declared_ran(launches, kernels))
    total = sum(len(k.examples) for k in (kernels or REGISTRY).values())
    print(f"emulated: {len(runs) - len(bad)} passed, {len(bad)} failed, {len(launches)} launches, "
          f"{exact} of {total} registered instantiations run as declared; {len(violations)} limit violations")
    return 1 if failed or bad or violations else 0


if __name__ == "__main__":
    sys.exit(main())
