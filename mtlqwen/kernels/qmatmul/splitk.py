"""qgemm's split-K partials reduced in one launch (qgemm.py, SELECT "qgemm_reduce_kernel").

A qgemm call that splits K writes fp32 partials [S, M, N_p] for each of its P outputs. As MLX ops their
reduction is a sum and a cast per output, and for SwiGLU a sum, two slices, a sigmoid, two products and a
cast: at 16 verify rows the 9B step spends ~365 graph nodes on them, and a speculative step is bound by
the host's cost per node (benchmarks/spec.md). Here one launch reduces every output of the call: one thread
per output element sums its S partials in split order (fp32), applies SwiGLU where asked, and rounds once.

    epi 0:  y_p[m, n] = sum_s part_p[s, m, n]                              p < P, each [M, N_p]
    epi 1:  g = sum_s part[s, m, n], u = sum_s part[s, m, N + n]:  y[m, n] = g * sigmoid(g) * u    [M, N]

Written in portable tokens, so the Metal emulator checks it on the CPU; it serves only beside qgemm (CUDA).
"""

from __future__ import annotations

import mlx.core as mx

from ..portable import KernelExample, portable_kernel

_TG = 256
MAX_P = 4  # qgemm's fused projections: a GDN layer's four (qkv | z | b | a) at most

_OUT0 = """
  if (!hit) {
    const size_t n = (size_t)partPIDX_shape[1] * (size_t)partPIDX_shape[2];
    if (e < n) {
      float acc = 0.0f;
      for (int s = 0; s < (int)partPIDX_shape[0]; ++s) acc += partPIDX[(size_t)s * n + e];
      yPIDX[e] = FROM_FLOAT(T, acc);
      hit = true;
    } else {
      e -= n;
    }
  }
"""

_SWIGLU = """
const size_t e = (size_t)GID_X;
const size_t N2 = (size_t)part0_shape[2], N = N2 / 2, M = (size_t)part0_shape[1];
if (e < M * N) {
  const size_t m = e / N, c = e % N;
  float g = 0.0f, u = 0.0f;
  for (int s = 0; s < (int)part0_shape[0]; ++s) {
    const size_t row = ((size_t)s * M + m) * N2;
    g += part0[row + c];
    u += part0[row + N + c];
  }
  y0[e] = FROM_FLOAT(T, g / (1.0f + EXP(-g)) * u);
}
"""


def _sum_body(P: int) -> str:
    return "size_t e = (size_t)GID_X;\nbool hit = false;\n" + "".join(_OUT0.replace("PIDX", str(p)) for p in range(P))


def _example(P: int, epi: int, dt) -> KernelExample:
    """A 16-row verification of the 9B: q|k|v- or GDN-input-like outputs (epi 0) or gate|up (epi 1), 4 splits."""
    ns = [8192, 4096, 32, 32][:P] if epi == 0 else [2 * 12288]
    return KernelExample(inputs=[(mx.float32, (4, 16, n)) for n in ns], outputs=[dt] * len(ns),
                         template=[("T", dt)])


REDUCE = {(P, epi): portable_kernel(
    name=f"mtl_splitk_reduce_p{P}_e{epi}",
    input_names=[f"part{p}" for p in range(P)],
    output_names=[f"y{p}" for p in range(P)],
    body=_SWIGLU if epi else _sum_body(P),
    examples=[_example(P, epi, dt) for dt in (mx.bfloat16, mx.float16)],
) for P, epi in [(p, 0) for p in range(1, MAX_P + 1)] + [(1, 1)]}


def covers(parts: list[mx.array], epi: int) -> bool:
    return (0 < len(parts) <= (1 if epi else MAX_P) and all(p.ndim == 3 and p.dtype == mx.float32 for p in parts)
            and len({p.shape[:2] for p in parts}) == 1 and (epi == 0 or parts[0].shape[2] % 2 == 0))


def reduce(backend: str, parts: list[mx.array], epi: int, dtype, init_value=None) -> list[mx.array]:
    """parts: the P partials [S, M, N_p] fp32 (epi 1: one, [S, M, 2N]) -> the outputs [M, N_p] (epi 1: [M, N])
    in `dtype`."""
    M = parts[0].shape[1]
    shapes = [(M, parts[0].shape[2] // 2)] if epi else [(M, p.shape[2]) for p in parts]
    total = sum(m * n for m, n in shapes)
    return REDUCE[(len(parts), epi)](
        backend,
        inputs=list(parts),
        output_shapes=shapes,
        output_dtypes=[dtype] * len(shapes),
        grid=(-(-total // _TG) * _TG, 1, 1),
        threadgroup=(_TG, 1, 1),
        template=[("T", dtype)],
        init_value=init_value,
    )
