"""What the engine benchmarks share: the model arguments, building the model, one timed generate, the JSON."""

from __future__ import annotations

import json
import statistics
import time

import mtlqwen
from mtlqwen.model import QuantSpec, builtin
from mtlqwen.runtime import Engine, SamplingParams


def add_model_args(ap) -> None:
    ap.add_argument("--model", help="checkpoint directory or repo id; default: random weights of --shape")
    ap.add_argument("--shape", choices=sorted(builtin.SHAPES), default="9b")
    ap.add_argument("--bits", type=int, default=4, help="quantize random weights (0: bf16)")
    ap.add_argument("--group-size", type=int, default=64)


DENSE_WEIGHTS = {"auto": None, "on": True, "off": False}  # --dense-weights -> Engine(dense_weights=...)


def add_dense_weights_arg(ap) -> None:
    ap.add_argument("--dense-weights", nargs="+", choices=sorted(DENSE_WEIGHTS), default=["auto"],
                    help="Engine(dense_weights=...): keep dequantized copies of the projections for the GEMMs past "
                         "qgemm's rows (auto: the engine's default, on with the CUDA kernels where they fit); "
                         "several: each in turn, in one process")


_BUILT: dict = {}  # one model per process: benchmarks/suite.py runs several scripts on the same weights


def build_model(args):
    """(model, description) from --model, or random weights of --shape quantized per --bits / --group-size."""
    key = (args.model, args.shape, args.bits, args.group_size)
    if key not in _BUILT:
        _BUILT[key] = _build(args)
    return _BUILT[key]


def _build(args):
    if args.model:
        return mtlqwen.load(args.model), args.model
    config = builtin.SHAPES[args.shape]()
    quant = QuantSpec(args.bits, args.group_size) if args.bits else None
    model = builtin.random_model(config=config, seed=0, quantize=quant)
    return model, f"random {args.shape} ({f'{args.bits}-bit g{args.group_size}' if quant else 'bf16'})"


def timed_generate(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[list, float, list[float]]:
    """Submit every prompt at once, EOS ignored: (outputs, wall seconds, each request's time to first token)."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=gen_len, ignore_eos=True))
    wall = time.perf_counter() - t0
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return outs, wall, [o.ttft for o in outs]


def decode_rate(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """Submit one request a prompt, step until every one decodes, then time the steps to the last finish:
    (generated tok/s over that time, every host cost of a step included; tokens counted)."""
    import mlx.core as mx  # noqa: PLC0415

    for p, sp in zip(prompts, params):
        eng.submit(p, sp)
    running = eng.scheduler.running
    while len(running) < len(prompts) or any(len(s.tokens) <= s.prompt_len for s in running):
        eng.step()
        if not eng.has_work():
            raise RuntimeError("requests finished before every one of them was decoding")
    mx.synchronize()
    g0, t0 = eng.counters["generated_tokens"], time.perf_counter()
    while eng.has_work():
        eng.step()
    mx.synchronize()
    n = eng.counters["generated_tokens"] - g0
    return n / (time.perf_counter() - t0), n


def ttft_ms(first: list[float]) -> dict:
    return {"ttft_mean_ms": 1e3 * statistics.mean(first), "ttft_max_ms": 1e3 * max(first)}


def write_json(path: str | None, name: str, args, results) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"model": name, "args": vars(args), "results": results}, f, indent=2)


def host_profile(fn, top: int = 25) -> list[dict]:
    """Run fn() under cProfile: the host's Python time by function (ms, self and cumulative), the `top` with
    the most self time. What a host-bound step spends outside MLX's encoding shows up here by name."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    prof = cProfile.Profile()
    prof.runcall(fn)
    st = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim calls, self s, cumulative s, callers)}
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"fn": f"{'/'.join(file.rsplit('/', 2)[-2:])}:{line}({name})", "calls": c,
             "self_ms": round(1e3 * s, 3), "cum_ms": round(1e3 * cum, 3)} for (file, line, name), (_, c, s, cum, _) in rows]
