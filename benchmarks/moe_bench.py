"""One MoE block (router, top-k, experts, shared expert) of the Qwen3.5-35B-A3B geometry (E 256, top-8,
H 2048, Im = Is 512, MLX affine 4-bit g64, routers 8-bit, bf16 x), per token count T, path by path:

    ours        the block as the model runs it (MoEBlock: router + shared gate in one projection, moe_route,
                moe_experts at the selection table's path for T)
    gather_qmm  the previous block: softmax / argpartition / take / renormalise as separate ops, MLX's
                unsorted gather_qmm per projection, the shared expert and its gate (moe_*_ref)
    sorted      moe_route, then the pairs grouped by expert (moe_experts_sorted), at every T
    grouped     moe_route, then the grouped tensor-core GEMM over the experts' padded segments
                (moe/grouped.py; CUDA, T >= 64), at the table's tile rows and at each --tile-rows
    fused       the fused expert kernels alone on given routing (T <= --fused-max, past the table's row too;
                GPU back-ends)

Timing (no CUPTI): a chain of L blocks in one graph, block i's input x_i made to depend on block i-1's
output (mx.depends: no extra kernel) so blocks cannot overlap, each x_i a different random row set so the
routing, and the experts read, change from block to block, over two copies of the layer's weights. The
graph is built before the clock starts; wall time of its evaluation, median of R, divided by L: device
time plus MLX's per-launch host cost, which the engine pays too. `active MB` = the packed bytes of the
experts the T tokens select (distinct ones), the shared expert and the router; GB/s = that / time.

    python benchmarks/moe_bench.py [--tokens 1 2 4 8 ...] [--rows G D ...] [--tile-rows 16 32 64] [--json OUT]
    python benchmarks/moe_bench.py --experts 16 --hidden 256 --im 128 --tokens 1 8 --links 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from mtlqwen.kernels import backend, selection
from mtlqwen.kernels.moe import grouped, kernels, moe_experts_ref, moe_experts_sorted, moe_route, moe_route_ref
from mtlqwen.kernels.moe.ops import shared_mlp
from mtlqwen.kernels.qmatmul import linear, linear_ref
from mtlqwen.model import QuantSpec
from mtlqwen.model.builtin import random_weights
from mtlqwen.model.config import parse_config
from mtlqwen.model.qwen35 import MoEBlock


def one_layer_config(args):
    """A one-layer 35B-A3B-geometry config (the GDN mixer is built too, and not timed)."""
    return parse_config({
        "model_type": "qwen3_5_moe_text", "vocab_size": 1024, "hidden_size": args.hidden, "num_hidden_layers": 1,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "num_experts": args.experts, "num_experts_per_tok": args.k,
        "moe_intermediate_size": args.im, "shared_expert_intermediate_size": args.im, "eos_token_id": 1,
        "layer_types": ["linear_attention"],
    })


def blocks(args, copies: int = 2) -> list[MoEBlock]:
    out = []
    for seed in range(copies):
        c = one_layer_config(args)
        w = random_weights(c, seed=seed, quantize=QuantSpec(4, 64))
        out.append(MoEBlock({k: v for k, v in w.items() if ".mlp." in k}, "model.layers.0.mlp", c))
    return out


def path_ours(b: MoEBlock, x):
    return b(x)


def path_gather_qmm(b: MoEBlock, x):
    logits, sgl = linear(x, b.router), linear(x, b.shared_gate)
    inds, w = moe_route_ref(logits, b.k, True, sgl)
    return moe_experts_ref(x, b.gate_proj, b.up_proj, b.down_proj, inds, w, _shared(b), shared_mlp)


def path_sorted(b: MoEBlock, x):
    logits, sgl = linear(x, b.router), linear(x, b.shared_gate)
    inds, w = moe_route(logits, b.k, True, sgl)
    return moe_experts_sorted(x, b.gate_proj, b.up_proj, b.down_proj, inds, w, _shared(b), shared_mlp)


def path_grouped(b: MoEBlock, x, mb=None):
    logits, sgl = linear(x, b.router), linear(x, b.shared_gate)
    inds, w = moe_route(logits, b.k, True, sgl)
    return grouped.grouped_experts(x, b.gate_proj, b.up_proj, b.down_proj, inds, w, _shared(b), shared_mlp, mb=mb)


def _shared(b: MoEBlock):
    return (b.shared.gate_proj, b.shared.up_proj, b.shared.down_proj)


def routing_of(b: MoEBlock, x):
    """Concrete routing for the fused-kernel timing (outside the timed graph)."""
    inds, w = moe_route_ref(linear_ref(x, b.router), b.k, True, linear_ref(x, b.shared_gate))
    mx.eval(inds, w)
    return inds, w


def chain_time(fn, bs, xs, reps: int) -> float:
    """Seconds per block over a dependent chain of len(xs) blocks rotating over the weight copies bs."""
    def build():
        outs, prev = [], None
        for i, x in enumerate(xs):
            x = x if prev is None else mx.depends([x], [prev])[0]
            prev = fn(bs[i % len(bs)], x, i)
            outs.append(prev)
        return outs

    mx.eval(build())  # warm-up: compiles, allocates
    mx.synchronize()
    times = []
    for _ in range(reps):
        outs = build()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(xs)


def active_bytes(b: MoEBlock, inds_list) -> float:
    """Mean packed bytes a block of the chain must read: distinct selected experts, shared expert, router."""
    p = b.gate_proj
    per_expert = 3 * (p.weight.nbytes + p.scales.nbytes + p.biases.nbytes) / p.weight.shape[0]
    fixed = sum(q.weight.nbytes + q.scales.nbytes + q.biases.nbytes for q in (*_shared(b), b.router, b.shared_gate))
    return statistics.mean(len(set(np.array(i).ravel().tolist())) * per_expert + fixed for i in inds_list)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512, 4096])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--im", type=int, default=512)
    ap.add_argument("--links", type=int, default=64, help="blocks per chain (fewer for large T)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="*", default=[],
                    help="pairs G D: also time the fused kernels at G gate rows / D down rows per SIMD group")
    ap.add_argument("--fused-max", type=int, default=64, help="time the fused kernels alone up to this T")
    ap.add_argument("--tile-rows", type=int, nargs="*", default=[],
                    help="also time the grouped path at these tile rows MB (16 / 32 / 64)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gpu = backend.use_kernels()
    bs = blocks(args)
    rng = np.random.default_rng(0)
    rows_cfg = [tuple(args.rows[i:i + 2]) for i in range(0, len(args.rows) - 1, 2)]
    results = []
    print(f"device {mx.default_device()}, kernels {'on' if gpu else 'off (references)'}; "
          f"E {args.experts} top-{args.k} H {args.hidden} Im {args.im}")
    print(f"{'T':>5s} {'path':>14s} {'us':>10s} {'active MB':>10s} {'GB/s':>8s}")
    for T in args.tokens:
        links = max(2, min(args.links, args.links * 8 // T))
        xs = [mx.array(rng.standard_normal((T, args.hidden)).astype(np.float32)).astype(mx.bfloat16)
              for _ in range(links)]
        routes = [routing_of(bs[i % 2], x) for i, x in enumerate(xs)]
        mb = active_bytes(bs[0], [r[0] for r in routes])
        paths = {"ours": lambda b, x, i: path_ours(b, x), "gather_qmm": lambda b, x, i: path_gather_qmm(b, x),
                 "sorted": lambda b, x, i: path_sorted(b, x)}
        if T >= 64 and grouped.supported(xs[0], bs[0].gate_proj, bs[0].up_proj, bs[0].down_proj, routes[0][0]):
            for mbr in [None] + args.tile_rows:
                paths["grouped" + (f" mb{mbr}" if mbr else "")] = lambda b, x, i, mbr=mbr: path_grouped(b, x, mbr)
        # the fused kernels also past the table's moe_fused_max_tokens, up to --fused-max (where to move the row)
        fused_rows = {"moe_fused_max_tokens": max(T, selection.SELECT["moe_fused_max_tokens"])}
        with selection.selected(fused_rows):
            fusable = kernels.fused_supported(xs[0], bs[0].gate_proj, bs[0].up_proj, bs[0].down_proj, routes[0][0])
        if gpu and T <= args.fused_max and fusable:
            for cfg in [None] + rows_cfg:
                paths["fused" + (f" {cfg[0]}/{cfg[1]}" if cfg else "")] = (
                    lambda b, x, i, cfg=cfg: kernels.fused_experts(x, b.gate_proj, b.up_proj, b.down_proj,
                                                                   *routes[i], _shared(b), rows=cfg))
        for name, fn in paths.items():
            with selection.selected(fused_rows if name.startswith("fused") else {}):
                t = chain_time(fn, bs, xs, args.reps)
            results.append(dict(T=T, path=name, us=t * 1e6, active_mb=mb / 1e6, gbs=mb / t / 1e9))
            print(f"{T:5d} {name:>14s} {t * 1e6:10.1f} {mb / 1e6:10.2f} {mb / t / 1e9:8.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "args": vars(args),
                       "select": {k: v for k, v in selection.SELECT.items() if k.startswith("moe_")},
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
