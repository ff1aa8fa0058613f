"""Where a decode step's time goes: Python graph build, MLX encode (host), device wait.

Qwen3.5-9B shape, random MLX 4-bit g64 weights, B sequences each with 512 cached tokens. For each B:

- `split`: one step at a time, timing the Python build of the graph (forward + argmax), the
  `mx.async_eval` call (MLX encodes and launches every primitive on the calling thread), and the wait
  for the tokens;
- `pipelined`: step N+1 is built from step N's lazy tokens before step N is read (the engine's overlap);
- `compiled`: the same pipelined loop through `mx.compile` of the step (layout fixed), to show how much
  of the host cost compilation removes; its first-step logits are compared with the plain path;
- primitive counts of one step's graph (from `mx.export_to_dot`), and the per-primitive host cost of
  three primitive kinds measured on chains of 1000.

    python benchmarks/decode_profile.py --json $OUT/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import tempfile
import time

import mlx.core as mx

from mtlqwen.kernels import SeqLayout
from mtlqwen.kernels import add_rms_norm
from mtlqwen.kernels.selection import parse_rows, selected
from mtlqwen.model.builtin import demo_config, qwen35_9b_config, random_model
from mtlqwen.model.config import QuantSpec


def layout_for(B: int, past: int, bt: int = 128) -> SeqLayout:
    nb = past // bt + 1
    return SeqLayout(list(range(B + 1)), [past] * B, [[i * nb + j for j in range(nb)] for i in range(B)],
                     list(range(B)), bt)


def med_ms(xs):
    return statistics.median(xs) * 1e3


def step_fn(model, cache, B, past):
    def f(ids, *pools):
        n = len(cache.k_pools)
        g = len(cache.conv_states)
        cache.k_pools[:], cache.v_pools[:] = list(pools[:n]), list(pools[n : 2 * n])
        cache.conv_states[:], cache.rec_states[:] = list(pools[2 * n : 2 * n + g]), list(pools[2 * n + g :])
        logits = model.forward(ids, layout_for(B, past), cache)
        return [mx.argmax(logits, axis=-1).astype(mx.int32), *cache.arrays()]

    return f


def set_pools(cache, pools):
    n, g = len(cache.k_pools), len(cache.conv_states)
    cache.k_pools[:], cache.v_pools[:] = list(pools[:n]), list(pools[n : 2 * n])
    cache.conv_states[:], cache.rec_states[:] = list(pools[2 * n : 2 * n + g]), list(pools[2 * n + g :])


def count_primitives(arr) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, arr)
        txt = open(f.name).read()
    cnt = collections.Counter(re.findall(r'label ="([A-Za-z_]+)', txt))
    return dict(cnt.most_common())


def per_primitive_us() -> dict:
    out = {}
    x = mx.zeros((1, 4096), dtype=mx.bfloat16)
    w = mx.ones((4096,), dtype=mx.bfloat16)
    mx.eval(x, w)

    def chain(op, n=1000):
        ts = []
        for _ in range(5):
            y = x
            t0 = time.perf_counter()
            for _ in range(n):
                y = op(y)
            t1 = time.perf_counter()
            mx.eval(y)
            ts.append((time.perf_counter() - t1, t1 - t0))
        ev = statistics.median(t[0] for t in ts[1:]) / n * 1e6
        py = statistics.median(t[1] for t in ts[1:]) / n * 1e6
        return {"eval_us": round(ev, 2), "python_us": round(py, 2)}

    out["add (elementwise kernel)"] = chain(lambda y: y + 1)
    out["reshape (no kernel)"] = chain(lambda y: y.reshape(4096).reshape(1, 4096))
    out["add_rms_norm (custom kernel)"] = chain(lambda y: add_rms_norm(y, y, w, 1e-6)[1])
    return out


def _with_rows(rows: dict, f):
    with selected(rows):
        return f()


def ops_at(model, B: int, past: int) -> dict:
    """Per-launch time (µs) of the step's op kinds at B rows, from chains of 40 launches on the layers' own
    weights (so weights come from HBM), one eval per chain, median of 5."""
    from mtlqwen.kernels import linear, paged_attention  # noqa: PLC0415
    from mtlqwen.kernels import linear_multi, swiglu_linear  # noqa: PLC0415

    gdn = [l for l in model.layers if l.kind == "linear_attention"]
    att = [l for l in model.layers if l.kind != "linear_attention"]
    H = model.config.hidden_size
    x = mx.random.normal((B, H)).astype(mx.bfloat16)
    cache = model.make_cache(B * (past // 128 + 1) + 1, B, 128)
    lay = layout_for(B, past)
    c = model.config
    q = mx.random.normal((B, c.num_attention_heads, c.head_dim)).astype(mx.bfloat16)

    def chain(fn, n=40):
        ts = []
        for _ in range(5):
            outs = [fn(i) for i in range(n)]
            mx.eval(x)
            t0 = time.perf_counter()
            mx.eval(outs)
            ts.append(time.perf_counter() - t0)
        return round(statistics.median(ts[1:]) / n * 1e6, 1)

    xs: dict[int, mx.array] = {}

    def xin(p):  # an input row block of p's width
        if p.in_features not in xs:
            xs[p.in_features] = mx.random.normal((B, p.in_features)).astype(mx.bfloat16)
        return xs[p.in_features]

    mix = lambda i: gdn[i % len(gdn)].mixer  # noqa: E731
    mlp = lambda i: model.layers[i % len(model.layers)].mlp  # noqa: E731
    r = {
        "gdn in_proj qkv+z+b+a (linear_multi)": chain(lambda i: linear_multi(x, [mix(i).in_proj_qkv, mix(i).in_proj_z, mix(i).in_proj_b, mix(i).in_proj_a])),
        "gdn in_proj_qkv alone": chain(lambda i: linear(x, mix(i).in_proj_qkv)),
        "gdn in_proj_b alone (N=32)": chain(lambda i: linear(x, mix(i).in_proj_b)),
        "gdn out_proj": chain(lambda i: linear(xin(mix(i).out_proj), mix(i).out_proj)),
        "mlp gate+up (swiglu_linear)": chain(lambda i: swiglu_linear(x, mlp(i).gate_proj, mlp(i).up_proj)),
        "mlp down": chain(lambda i: linear(xin(mlp(i).down_proj), mlp(i).down_proj)),
        "paged attention": chain(lambda i: paged_attention(q, cache.k_pools[i % len(att)], cache.v_pools[i % len(att)], lay, 0.08)),
        **{f"paged attention, splits >= {n} keys": _with_rows({"attn_min_split_keys": n}, lambda: chain(
            lambda i: paged_attention(q, cache.k_pools[i % len(att)], cache.v_pools[i % len(att)], lay, 0.08)))
           for n in (32, 64, 128)},
        "lm_head": chain(lambda i: linear(x, model.lm_head), n=8),
    }
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--shape", choices=["9b", "demo"], default="9b", help="demo: a CPU smoke run")
    ap.add_argument("--variants", nargs="*", default=[], metavar="ROW=V[,ROW=V]",
                    help="also time the compiled step with these selection rows (e.g. attn_min_split_keys=64)")
    ap.add_argument("--no-ops", action="store_true", help="skip the per-op chains")
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = {spec: parse_rows(spec, source="--variants") for spec in args.variants}  # typos fail now
    res = {"mlx": mx.__version__, "device": str(mx.default_device())}
    model = random_model(qwen35_9b_config() if args.shape == "9b" else demo_config(), quantize=QuantSpec(4, 64), dtype=mx.bfloat16)
    res["per_primitive"] = per_primitive_us()
    for B in args.batches:
        r = res[f"B{B}"] = {}
        nb = args.past // 128 + 1
        cache = model.make_cache(B * nb + 1, B, 128)
        ids = mx.zeros((B,), dtype=mx.int32)
        # split: build / encode / wait, one step at a time
        build, enc, wait = [], [], []
        for i in range(args.steps + 3):
            t0 = time.perf_counter()
            logits = model.forward(ids, layout_for(B, args.past), cache)
            tok = mx.argmax(logits, axis=-1).astype(mx.int32)
            t1 = time.perf_counter()
            if i == 0:
                r["primitives"] = count_primitives(tok)
                r["primitives_total"] = sum(r["primitives"].values())
            mx.async_eval(tok, *cache.arrays())
            t2 = time.perf_counter()
            tok.tolist()
            t3 = time.perf_counter()
            ids = tok
            if i >= 3:
                build.append(t1 - t0), enc.append(t2 - t1), wait.append(t3 - t2)
        r["split_ms"] = {"build": med_ms(build), "encode": med_ms(enc), "wait": med_ms(wait),
                         "step": med_ms([a + b + c for a, b, c in zip(build, enc, wait)])}

        host: list[float] = []

        def pipelined(f):
            """Median step time; `host` gets the median time to build + launch a step (if it matches the
            step time, the host bounds the loop, not the device)."""
            nonlocal ids
            prev, ts, hs = None, [], []
            for i in range(args.steps + 3):
                t0 = time.perf_counter()
                tok = f(ids)
                mx.async_eval(tok, *cache.arrays())
                t1 = time.perf_counter()
                if prev is not None:
                    prev.tolist()
                ids, prev = tok, tok
                if i >= 3:
                    ts.append(time.perf_counter() - t0), hs.append(t1 - t0)
            prev.tolist()
            host[:] = [med_ms(hs)]
            return med_ms(ts)

        def plain(x):
            return mx.argmax(model.forward(x, layout_for(B, args.past), cache), axis=-1).astype(mx.int32)

        def step_peak_mib(f) -> float:
            """Memory a step takes above what is live before it (a pool copy shows up here)."""
            mem0 = mx.get_active_memory()
            mx.reset_peak_memory()
            f(ids).tolist()
            mx.eval(cache.arrays())
            return (mx.get_peak_memory() - mem0) / 2**20

        r["pipelined_ms"] = pipelined(plain)
        r["step_peak_above_active_MiB"] = step_peak_mib(plain)
        if not args.no_compile:
            f = mx.compile(step_fn(model, cache, B, args.past))
            # copies, not new handles: kernels that write K/V and GDN states in place would update a handle too
            ref_pools = [a + 0 for a in cache.arrays()]
            mx.eval(ref_pools)  # before the forward below advances the pools in place
            ref_logits = model.forward(ids, layout_for(B, args.past), cache)
            mx.eval(ref_logits)
            set_pools(cache, ref_pools)
            mx.eval(ref_pools)
            out = f(ids, *cache.arrays())
            set_pools(cache, out[1:])
            # the compiled step's argmax vs the plain one, from the same state
            r["compiled_tokens_match"] = bool(mx.all(out[0] == mx.argmax(ref_logits, axis=-1)).item())
            top2 = mx.sort(ref_logits.astype(mx.float32), axis=-1)[:, -2:]
            r["reference_min_top2_gap"] = float(mx.min(top2[:, 1] - top2[:, 0]).item())  # a tie explains a flip
            del ref_pools, ref_logits

            def comp(x):
                o = f(x, *cache.arrays())
                set_pools(cache, o[1:])
                return o[0]

            r["compiled_pipelined_ms"] = pipelined(comp)
            r["compiled_host_ms"] = host[0]
            for spec, rows in variants.items():  # the same compiled step with selection rows changed (retraced)
                with selected(rows):
                    fv = mx.compile(step_fn(model, cache, B, args.past))

                    def compv(x, fv=fv):
                        o = fv(x, *cache.arrays())
                        set_pools(cache, o[1:])
                        return o[0]

                    r.setdefault("variants_ms", {})[spec] = {"step": pipelined(compv), "host": host[0]}
            r["compiled_step_peak_above_active_MiB"] = step_peak_mib(comp)
        r["tok_per_s_pipelined"] = B * 1e3 / r["pipelined_ms"]
        del cache
        mx.clear_cache()
        if not args.no_ops:
            r["ops_us"] = ops_at(model, B, args.past)
        print(json.dumps({f"B{B}": {k: v for k, v in r.items() if k != "primitives"}}), flush=True)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
