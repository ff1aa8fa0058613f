"""Reads a `kernels_qmatmul_attn.py --only sweep` JSON and says whether the qmv weight-prefetch variant
(PF 1) beats the plain one at batch 1 with the blocking the selection table uses, summed over the decode
shapes (each shape once per layer it occurs in; the LM head once). Prints one line per shape and a verdict
line starting with "prefetch wins" or "prefetch loses" (device_checks.sh greps it)."""

from __future__ import annotations

import json
import sys

from mtlqwen.kernels.selection import qmv_config

# shape -> (N, K, launches per Qwen3.5-9B decode step)
SHAPES = {"z/o 4096x4096": (4096, 4096, 24 + 8), "qkv 8192x4096": (8192, 4096, 24 + 8),
          "gate/up 12288x4096": (12288, 4096, 64), "down 4096x12288": (4096, 12288, 32),
          "lm_head 248320x4096": (248320, 4096, 1)}


def main(path: str) -> None:
    rows = [r for r in json.load(open(path))["rows"] if r["kind"] == "sweep" and r["M"] == 1]
    us = {(r["shape"], r["cand"]): r["us"] for r in rows}
    tot = {0: 0.0, 1: 0.0}
    for shape, (n, k, count) in SHAPES.items():
        R, U = qmv_config(1, k, 4, N=n)
        t = {pf: us.get((shape, f"R{R}U{U}PF{pf}")) for pf in (0, 1)}
        if None in t.values():
            continue
        best = min((v, c) for (s, c), v in us.items() if s == shape)
        print(f"{shape:22s} R{R}U{U}: PF0 {t[0]:7.1f} us  PF1 {t[1]:7.1f} us  (best {best[1]} {best[0]:.1f})")
        for pf in (0, 1):
            tot[pf] += count * t[pf]
    verdict = "prefetch wins" if tot[1] < tot[0] else "prefetch loses"
    print(f"{verdict}: per-step projection time PF0 {tot[0] / 1e3:.2f} ms, PF1 {tot[1] / 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
