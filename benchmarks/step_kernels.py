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


def summarize(path: str, steps: int) -> None:
    text = open(path).read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    rows = [r for r in rows if r.get("Metric Name") == "gpu__time_duration.sum"]
    marks = [i for i, r in enumerate(rows) if "step_marker" in r["Kernel Name"]]
    last = rows[marks[-1] + 1 :]
    by = collections.defaultdict(lambda: [0, 0.0])
    for r in last:
        name = re.sub(r"_[0-9a-f]{10}\b.*", "", r["Kernel Name"])[:60]
        val = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        us = val / 1000 if unit in ("ns", "nsecond") else val if unit in ("us", "usecond") else val * 1000
        by[name][0] += 1
        by[name][1] += us
    total = sum(v[1] for v in by.values())
    print(f"kernels in the last step: {len(last)}, device time {total / 1000:.2f} ms")
    print("| kernel | launches | µs | share |\n|---|---|---|---|")
    for name, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"| {name} | {n} | {us:.0f} | {100 * us / total:.1f}% |")


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
