"""Which quantized-matmul path runs for which shape class, and the qmv kernel's blocking.

Numbers come from benchmarks/kernels_qmatmul_attn.py on the project's H200 (MLX 0.32.4 CUDA); the
markdown beside it records the runs. Change a row only with a measurement that justifies it.
"""

from __future__ import annotations

SELECT: dict[str, int] = {
    # M <= 8: our qmv kernel (K split across lanes, 16-byte loads). MLX's own qmv reaches ~0.5-0.7 TB/s
    # at M=1 (anchors.md); the kernel is bandwidth- or issue-bound well above that up to 8 rows.
    "qmv_max_rows": 8,
    # 9..qmv_loop_max_rows rows: one qmv launch per 8 rows. Each launch re-reads the weights, so this
    # only pays while MLX's tensor-core GEMM (qmm_sm80) costs more than that; M=16 is the DFlash-verify
    # size. Set from the M=16 column of the benchmark.
    "qmv_loop_max_rows": 16,
    # From this many rows on: dequantize to the activation dtype, then MLX's bf16 GEMM (cuBLAS). The
    # dequantize pass (~4x the weight bytes written) is paid once per step; anchors measured MLX's
    # quantized GEMM ~4x slower than the bf16 GEMM at M=2048. Between the two limits MLX's qmm runs.
    "dequant_gemm_min_rows": 256,
}

# (MT, bits) -> (R weight rows per SIMD group, U chunks in flight per lane and row). Large U keeps
# enough bytes in flight at M=1 (one wave of the H200 needs ~25 KB per SM); at larger MT the per-row
# accumulators cost registers, so R grows (more reuse of each x load) and U shrinks.
QMV_BLOCKING: dict[tuple[int, int], tuple[int, int]] = {
    (1, 4): (2, 4),
    (1, 8): (2, 4),
    (2, 4): (2, 2),
    (2, 8): (2, 2),
    (4, 4): (4, 1),
    (4, 8): (4, 1),
    (8, 4): (4, 1),
    (8, 8): (4, 1),
}


def qmv_config(mt: int, K: int, bits: int, swiglu: bool = False) -> tuple[int, int]:
    """(R, U) for a qmv launch; SwiGLU doubles R (gate + up rows), so it starts from half at MT >= 4
    to keep the accumulators in registers."""
    R, U = QMV_BLOCKING[(mt, bits)]
    if swiglu and mt >= 4:
        R = max(1, R // 2)
    return R, U
