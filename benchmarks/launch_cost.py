"""Host time MLX spends per launch, by what a launch carries: is it the kernel's source length, its number
of inputs, the size of its inputs, or MLX's per-node cost whatever the op?

Why: decode steps are host-bound on some hosts (benchmarks/moe.md: ~20 us of host time per graph node of
the 35B-A3B step, 2.9 ms of device time in an 11 ms step). Each variant is a chain of L launches of one
probe, y_{i+1} = probe(y_i, extras), on 256 floats (the device time is ~2 us a launch):

    builtin     MLX's own add (y + 1)
    reshape     two reshapes (views: graph nodes with no kernel), per launch counted as one link
    short       a custom kernel, 3 lines of body
    long        the same body with a comment block making its source ~16 KB (MLX hashes the source at
                every launch), and ~64 KB
    inputs16    the short kernel with 15 extra (unused) inputs, as the MoE gate+up launch has
    big_input   the short kernel with one extra unused input of 256 MB (a layer's stacked experts)
    matmul      MLX's matmul of [16, 16] by [16, 16] (cuBLASLt: MLX builds the descriptors and asks for an
                algorithm at every call), per link also two reshapes (the `reshape` row's cost)

Per variant: `encode` = wall time of mx.async_eval on the lazily built chain (MLX encodes every launch on
the calling thread), `total` = until the result is on the host, both per launch, median of R; `compiled`
the same chain through mx.compile (`call` = time to call the compiled function). CUDA or Metal; on the
CPU only `builtin` runs.

    python benchmarks/launch_cost.py [--links 400] [--reps 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from mtlqwen.kernels.backend import gpu_backend
from mtlqwen.kernels.portable import PortableKernel

BODY = """
  const unsigned int i = GID_X;
  if (i < inp_shape[0]) out[i] = inp[i] + 1.0f;
"""
N = 256


def probe(extra_inputs: int, pad_bytes: int) -> PortableKernel:
    pad = "".join(f"  // padding line {i:06d} " + "." * 40 + "\n" for i in range(pad_bytes // 64))
    names = ["inp"] + [f"e{i}" for i in range(extra_inputs)]
    return PortableKernel(name=f"mtl_launch_probe_i{extra_inputs}_p{pad_bytes}", input_names=names,
                          output_names=["out"], body=BODY + pad)


def chain_fn(step, links: int):
    def f(y, *extras):
        for _ in range(links):
            y = step(y, extras)
        return y

    return f


def kernel_step(k: PortableKernel, backend: str):
    def step(y, extras):
        return k(backend, inputs=[y, *extras], output_shapes=[(N,)], output_dtypes=[mx.float32],
                 grid=(N, 1, 1), threadgroup=(N, 1, 1))[0]

    return step


def timed(f, args, reps: int, links: int, compiled: bool) -> dict:
    fn = mx.compile(f) if compiled else f
    mx.eval(fn(*args))  # build, compile, warm up
    calls, encs, tots = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = fn(*args)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        y.tolist()
        t3 = time.perf_counter()
        calls.append(t1 - t0)
        encs.append(t2 - t1)
        tots.append(t3 - t0)
    us = lambda xs: round(1e6 * statistics.median(xs) / links, 2)  # noqa: E731
    return {"call_us": us(calls), "encode_us": us(encs), "total_us": us(tots)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=int, default=400)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    backend = gpu_backend()
    x = mx.zeros((N,), dtype=mx.float32)
    # reshape: a node with no kernel (a view), two per link, to price the graph node alone
    w16 = mx.eye(16, dtype=mx.float32)
    variants = {"builtin": (lambda y, extras: y + 1.0, []),
                "reshape": (lambda y, extras: y.reshape(16, 16).reshape(N), []),
                "matmul": (lambda y, extras: (y.reshape(16, 16) @ extras[0]).reshape(N), [w16])}
    if backend is not None:
        small = [mx.zeros((N,), dtype=mx.float32) for _ in range(15)]
        big = [mx.zeros((64 * 2**20,), dtype=mx.float32)]  # 256 MB
        variants.update({
            "short": (kernel_step(probe(0, 0), backend), []),
            "long 16 KB": (kernel_step(probe(0, 16384), backend), []),
            "long 64 KB": (kernel_step(probe(0, 65536), backend), []),
            "inputs16": (kernel_step(probe(15, 0), backend), small),
            "big_input": (kernel_step(probe(1, 0), backend), big),
        })
        mx.eval(small, big)
    print(f"device {mx.default_device()}, backend {backend or 'cpu (builtin and reshape only)'}, {a.links} launches a chain")
    print("| variant | eager encode us | eager total us | compiled call us | compiled encode us | compiled total us |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for name, (step, extras) in variants.items():
        f = chain_fn(step, a.links)
        r = rows[name] = {"eager": timed(f, [x, *extras], a.reps, a.links, False),
                          "compiled": timed(f, [x, *extras], a.reps, a.links, True)}
        e, c = r["eager"], r["compiled"]
        print(f"| {name} | {e['encode_us']} | {e['total_us']} | {c['call_us']} | {c['encode_us']} | {c['total_us']} |",
              flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "links": a.links, "rows": rows}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
