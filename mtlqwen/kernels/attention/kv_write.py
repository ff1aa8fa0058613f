"""Writing new tokens' K/V into the paged pools in place (GPU).

Why a kernel: MLX's scatter reuses its input buffer only when nothing else holds it, and the GPU
back-ends hold every kernel input until its command buffer completes. The pools are read by the
previous step's attention, usually still in flight, so `pool[blocks, offsets] = k` copies the whole
pool each step (measured on the H200: +384 MiB peak for 4 x 96 MiB of extra pool). This kernel writes
through the pools' input pointers instead and outputs a one-element `done` token.

Ordering: MLX orders kernels only through buffers one produces and another takes. So every reader of
the pools in the same evaluation must take `done` as an input (the paged attention kernel does); the
next step is a separate evaluation, which runs after this one on the same stream. The pool arrays
themselves stay the same MLX arrays; their contents change under them, as a KV cache's must.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, portable_kernel
from ..seqs import SeqLayout

# one thread per element of a token's K (and V) row: ROW = nKV * hd
_BODY = """
const uint32_t gid = GID_X;
const uint32_t T = (uint32_t)k_shape[0];
if (gid < T * ROW) {
  const uint32_t t = gid / ROW, r = gid % ROW;
  const size_t dst = ((size_t)blocks[t] * BT + (size_t)offsets[t]) * ROW + r;
  ((DEVICE_PTR TP*)k_pool)[dst] = FROM_FLOAT(TP, TO_FLOAT(k[gid]));
  ((DEVICE_PTR TP*)v_pool)[dst] = FROM_FLOAT(TP, TO_FLOAT(v[gid]));
}
if (gid == 0) {
  done[0] = 1;
}
"""

KV_WRITE = portable_kernel(
    name="mtl_kv_write_inplace",
    input_names=["k_pool", "v_pool", "k", "v", "blocks", "offsets"],
    output_names=["done"],
    body=_BODY,
    examples=[
        KernelExample(
            inputs=[(tp, (64, 128, 4, 256)), (tp, (64, 128, 4, 256)), (tk, (9, 4, 256)), (tk, (9, 4, 256)),
                    (mx.int32, (9,)), (mx.int32, (9,))],
            outputs=[mx.int32],
            template=[("TP", tp), ("ROW", 1024), ("BT", 128)],
        )
        for tp, tk in ((mx.bfloat16, mx.bfloat16), (mx.float32, mx.bfloat16))
    ],
)


def write_kv_inplace_kernel(k_pool, v_pool, k, v, layout: SeqLayout) -> mx.array | None:
    """-> the `done` token [1] int32 (None: not covered; the caller writes functionally instead)."""
    backend = gpu_backend()
    T = k.shape[0]
    ok = (mx.float32, mx.float16, mx.bfloat16)
    if (backend is None or T == 0 or k_pool.dtype not in ok or k.dtype not in ok or v_pool.dtype != k_pool.dtype
            or k.shape != v.shape or k.shape[1:] != k_pool.shape[2:] or v_pool.shape != k_pool.shape):
        return None
    row = k.shape[1] * k.shape[2]
    return KV_WRITE(
        backend,
        inputs=[k_pool, v_pool, k.astype(v.dtype) if k.dtype != v.dtype else k, v,
                layout.array("write_blocks"), layout.array("write_offsets")],
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
        grid=(-(-T * row // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        template=[("TP", k_pool.dtype), ("ROW", row), ("BT", layout.block_tokens)],
    )[0]
