"""The host's Python cost of building one eager step's graph on the GPU code path, on any machine.

A host-bound step's wall time is the Python that builds its graph plus MLX's encoding of the launches
(benchmarks/prefix_cache.md: 13.6 + 18.9 ms for the 9B warm prefix hit). The second needs the GPU; the first
does not. Here the GPU dispatch runs on the CPU with nothing evaluated: the back-end reports CUDA, every
custom kernel is a stand-in that returns lazy zeros of its output shapes (one MLX op per output, no launch),
and mx.async_eval does nothing. The model, its random weights and the cache stay lazy, so the 9B shape
builds in seconds. What is timed is Qwen35Model.forward's Python, the ops' dispatch and the kernels'
argument building, for a fresh layout each step (the engine packs one per step). It is not a device
measurement: MLX's own per-op cost differs between back-ends, and the stand-ins cost less than a real
kernel call's node. Use it to find and cut Python overhead; confirm on the device (step_trace.py).

    python benchmarks/host_build.py                                # 9B warm prefix hit: 8 x 64 over 2,048
    python benchmarks/host_build.py --seqs 1 --tokens 1024 --context 0 --profile 30
    python benchmarks/host_build.py --dense-weights                # with the engine's kept copies (CUDA default)
    python benchmarks/host_build.py --dense-weights --nodes --steps 3   # and the step's graph: launches, other nodes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

import mlx.core as mx

from bench_common import host_profile
from mtlqwen.kernels import SeqLayout, backend, dispatch, portable
from mtlqwen.model import QuantSpec, builtin


def _stand_in(**kw):
    return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]


_LEAVES: dict = {}
LAUNCHES = [0]


def _leaf_stand_in(**kw):
    """For --nodes: leaf outputs tied to the call's inputs by one `Depends` node (so the graph above a kernel
    stays connected), counted as one launch a call."""
    LAUNCHES[0] += 1
    out = []
    for s, d in zip(kw["output_shapes"], kw["output_dtypes"]):
        key = (tuple(s), d)
        if key not in _LEAVES:
            _LEAVES[key] = mx.zeros(s, dtype=d)
            mx.eval(_LEAVES[key])
        out.append(_LEAVES[key])
    return mx.depends(out, [a for a in kw["inputs"] if isinstance(a, mx.array)])


def pretend_cuda(leaves: bool = False) -> None:
    """The CUDA dispatch on the CPU, nothing evaluated (this process only: it never restores); leaves: the
    kernels' stand-ins are leaf arrays (for counting the graph's other nodes)."""
    mx.set_default_device(mx.cpu)
    gpu = SimpleNamespace(type=mx.DeviceType.gpu)
    backend.gpu_backend.cache_clear()
    backend.gpu_backend = lambda: "cuda"  # use_kernels reads it from backend's globals
    for mod in list(sys.modules.values()):  # modules that imported the functions by name
        if getattr(mod, "__name__", "").startswith("mtlqwen") and getattr(mod, "gpu_backend", None) is not None:
            mod.gpu_backend = backend.gpu_backend
    backend.use_kernels.__globals__["mx"] = SimpleNamespace(default_device=lambda: gpu, DeviceType=mx.DeviceType)
    portable.PortableKernel.build = lambda self, b: _leaf_stand_in if leaves else _stand_in
    dispatch.Op._first_use = lambda self, new, kern, out, args, kw: out  # no self-check: nothing runs
    mx.async_eval = lambda *a, **k: None


def stand_in_dense(model) -> None:
    """Kept copies as runtime/dense_weights.py attaches them and evaluates their views, of zeros broadcast
    (stride 0: no memory; nothing is dequantized here)."""
    from mtlqwen.runtime.dense_weights import attach, projection_groups, views  # noqa: PLC0415

    for g in projection_groups(model):
        dt, K = g[0].scales.dtype, g[0].in_features
        attach(g, [mx.broadcast_to(mx.zeros((), dtype=dt), (sum(p.out_features for p in g), K))])
        mx.eval(views(g))


def warm_layout(S: int, T: int, context: int, bt: int) -> SeqLayout:
    """S sequences of T new tokens over `context` cached ones each, own blocks and slots."""
    per = -(-(context + T) // bt)
    return SeqLayout([i * T for i in range(S + 1)], [context] * S,
                     [list(range(i * per, (i + 1) * per)) for i in range(S)], list(range(S)), bt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(builtin.SHAPES), default="9b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="keep the N functions with the most self time")
    ap.add_argument("--dense-weights", action="store_true",
                    help="the projections' kept dequantized copies (lazy stand-ins of their shapes), as the engine's "
                         "default on CUDA: the GEMMs past qgemm's rows read them instead of dequantizing")
    ap.add_argument("--nodes", action="store_true",
                    help="also count one step's graph on the CUDA path: the kernel launches, and every other node by "
                         "primitive (each costs the host MLX's encoding on the GPU: benchmarks/decode_profile.md)")
    args = ap.parse_args(argv)
    pretend_cuda(leaves=args.nodes)
    model = builtin.random_model(config=builtin.SHAPES[args.shape](), seed=0,
                                 quantize=QuantSpec(args.bits, 64) if args.bits else None)
    if args.dense_weights:
        stand_in_dense(model)
    S, T, bt = args.seqs, args.tokens, args.block_tokens
    per = -(-(args.context + T) // bt)
    cache = model.make_cache(num_blocks=S * per + 1, num_slots=S, block_tokens=bt)
    ids = mx.zeros((S * T,), dtype=mx.int32)
    rows = mx.array([(i + 1) * T - 1 for i in range(S)], dtype=mx.int32)

    pools = [list(p) for p in (cache.k_pools, cache.v_pools, cache.conv_states, cache.rec_states)]

    def step():
        # the pools as allocated: a step rebinds them to its lazy outputs, and nothing here is evaluated,
        # so without this each step's graph would extend every earlier one's
        cache.k_pools[:], cache.v_pools[:], cache.conv_states[:], cache.rec_states[:] = (list(p) for p in pools)
        t0 = time.perf_counter()
        model.forward(ids, warm_layout(S, T, args.context, bt), cache, rows)
        return 1e3 * (time.perf_counter() - t0)

    if args.nodes:  # before any timing: the counts of one step (leaf stand-ins cost no nodes)
        from decode_profile import count_primitives  # noqa: PLC0415

        cache.k_pools[:], cache.v_pools[:], cache.conv_states[:], cache.rec_states[:] = (list(p) for p in pools)
        LAUNCHES[0] = 0
        logits = model.forward(ids, warm_layout(S, T, args.context, bt), cache, rows)
        nodes = count_primitives([logits, *cache.k_pools, *cache.v_pools, *cache.conv_states, *cache.rec_states])
        nodes["Depends"] = nodes.get("Depends", 0) - LAUNCHES[0]  # the stand-ins' own
        nodes = {k: v for k, v in sorted(nodes.items(), key=lambda kv: -kv[1]) if v}
        print(f"graph of one step on the CUDA path: {LAUNCHES[0]} custom-kernel launches, {sum(nodes.values())} other "
              "nodes: " + ", ".join(f"{k} {v}" for k, v in nodes.items()))
    step()  # first calls build the ops' tables
    times = [step() for _ in range(args.steps)]
    print(f"{args.shape}, {S} x {T} tokens over {args.context}: Python build of one eager step "
          f"{statistics.median(times):.2f} ms (median of {args.steps}; min {min(times):.2f})")
    if args.profile:
        for p in host_profile(lambda: [step() for _ in range(args.steps)], args.profile):
            print(f"  {p['self_ms'] / args.steps:7.3f} ms self {p['cum_ms'] / args.steps:7.3f} cum "
                  f"{p['calls'] / args.steps:7.1f} calls  {p['fn']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
