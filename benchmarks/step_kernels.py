"""Device time of one decode step, kernel by kernel (under Nsight Compute).

Runs `--steps` decode steps of the Qwen3.5-9B shape (random MLX 4-bit g64 weights) at batch B; run it
under `ncu` and give the CSV to `--summarize`, which keeps the kernels of the last step (every step
is preceded by a marker kernel) and sums their durations by kernel name:

    MLX_USE_CUDA_GRAPHS=0 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python benchmarks/step_kernels.py --batch 8 > $OUT/ncu.csv
    python benchmarks/step_kernels.py --summarize $OUT/ncu.csv --steps 3
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re


def run(batch: int, steps: int, past: int) -> None:
    import mlx.core as mx  # noqa: PLC0415

    from mtlqwen.kernels import SeqLayout  # noqa: PLC0415
    from mtlqwen.model.builtin import qwen35_9b_config, random_model  # noqa: PLC0415
    from mtlqwen.model.config import QuantSpec  # noqa: PLC0415

    model = random_model(qwen35_9b_config(), quantize=QuantSpec(4, 64), dtype=mx.bfloat16)
    nb = past // 128 + 1
    cache = model.make_cache(batch * nb + 1, batch, 128)
    ids = mx.zeros((batch,), dtype=mx.int32)
    marker = mx.fast.cuda_kernel(name="step_marker", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
    mx.synchronize()
    try:  # with `ncu --profile-from-start off`, only what follows is profiled (not building the weights)
        from cuda.bindings import runtime as cudart  # noqa: PLC0415

        cudart.cudaProfilerStart()
    except Exception as e:  # noqa: BLE001
        print(f"cudaProfilerStart unavailable ({e}); profile with --launch-skip instead", flush=True)
    for _ in range(steps):
        mx.eval(marker(inputs=[ids], output_shapes=[(1,)], output_dtypes=[mx.int32], grid=(1, 1, 1),
                       threadgroup=(1, 1, 1))[0])
        lay = SeqLayout(list(range(batch + 1)), [past] * batch, [[i * nb + j for j in range(nb)] for i in range(batch)],
                        list(range(batch)), 128)
        ids = mx.argmax(model.forward(ids, lay, cache), axis=-1).astype(mx.int32)
        mx.eval(ids, *cache.arrays())


_TIME = "gpu__time_duration.sum"
# optional metrics (pass them to ncu's --metrics too): DRAM bytes give each kernel's achieved GB/s; the issue-
# active share tells an instruction-bound kernel (near 100%) from a latency-bound one
_EXTRA = {"dram__bytes_read.sum": "GB/s read", "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
          "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %"}


def _value(r: dict) -> float:
    val = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    return val * scale.get(unit, 1.0)  # durations in µs, bytes in bytes, percentages as they are


def summarize(path: str, steps: int) -> None:
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels: dict[str, dict] = {}  # ncu's launch ID -> name and metric values, in launch order
    for r in rows:
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"]})
        k[r["Metric Name"]] = _value(r)
    seq = list(kernels.values())
    marks = [i for i, k in enumerate(seq) if "step_marker" in k["name"]]
    last = seq[marks[-1] + 1 :]
    extra = [m for m in _EXTRA if any(m in k for k in last)]
    by = collections.defaultdict(lambda: collections.defaultdict(float))
    for k in last:
        b = by[re.sub(r"_[0-9a-f]{10}\b.*", "", k["name"])[:60]]
        b["n"] += 1
        b["us"] += k[_TIME]
        for m in extra:  # byte counts add up; percentages are weighted by duration
            b[m] += k[m] if m.endswith(".sum") else k[m] * k[_TIME]
    total = sum(v["us"] for v in by.values())
    print(f"kernels in the last step: {len(last)}, device time {total / 1000:.2f} ms")
    heads = ["kernel", "launches", "µs", "share"] + [_EXTRA[m] for m in extra]
    print("| " + " | ".join(heads) + " |\n" + "|---" * len(heads) + "|")
    for name, v in sorted(by.items(), key=lambda kv: -kv[1]["us"])[:30]:
        cells = [name, f"{v['n']:.0f}", f"{v['us']:.0f}", f"{100 * v['us'] / total:.1f}%"]
        for m in extra:
            cells.append(f"{v[m] / v['us'] / 1e3:.0f}" if m.endswith(".sum") else f"{v[m] / v['us']:.0f}")
        print("| " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument("--summarize", metavar="CSV")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize, a.steps)
    else:
        run(a.batch, a.steps, a.past)


if __name__ == "__main__":
    main()
