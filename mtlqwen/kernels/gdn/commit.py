"""The "candidates" commit of a verification in one in-place launch per GDN layer (SELECT "gdn_commit_kernel").

After a verification, verifying sequence s keeps the state after its anchor and k[s] accepted drafts: the
recurrent state is candidate row starts[s] + k[s] of the layer's candidates [Tv, Hv, dv, dk], the conv state
the last K-1 conv inputs up to that token, taken from [its slot's old conv rows ; its raw verify rows]
(Qwen35Model.pick_candidates). As MLX ops that is a gather and a scatter of the state, and a gather of the old
rows, a reshape, a cast, a concatenation, a gather, a reshape and a scatter of the conv rows: nine graph nodes
a layer, 216 a 9B speculative step, whose wall time is the host's cost per node (benchmarks/spec.md). The
scatters also copy a whole pool whenever the verification still holds it. Here one launch a layer writes both
into the pools' own buffers and returns a `done` token, which the pools' handles follow (mx.depends), as
attention/kv_write.py does for K/V.

    rec_pool[slots[s]]           = cand[starts[s] + k[s]]
    conv_pool[slots[s], r]       = conv_pool[slots[s], t]  (before)    t = k[s] + 1 + r < K-1
                                 = raw[starts[s] + t - (K-1)]          otherwise          (r < K-1)

The old conv rows are read from the pool here: nothing writes a verifying slot between its verification and
its commit. One thread takes a slot's channel: it reads the K-1 values it needs before writing any, and no
other thread touches them. Ordering: the launch takes the candidates, which the verification computed from the
pools, so it runs after every read of the rows it overwrites. Verifying slots are distinct.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend, use_kernels
from ..norms.kernels import FLOATS
from ..portable import KernelExample, portable_kernel
from ..selection import SELECT

_TG = 256

_BODY = """
const size_t gid = (size_t)GID_X;
const size_t R = (size_t)HV * DV * DK;
const size_t S = (size_t)k_shape[0];
if (gid < S * (R + (size_t)C)) {
  const size_t s = gid / (R + (size_t)C), r = gid % (R + (size_t)C);
  const size_t slot = (size_t)slots[s];
  if (r < R) {
    ((DEVICE_PTR float*)rec_pool)[slot * R + r] = cand[((size_t)starts[s] + (size_t)k[s]) * R + r];
  } else {
    const size_t c = r - R;
    float col[K1];  // every value this channel's new rows take, read before any is overwritten
    for (int row = 0; row < K1; ++row) {
      const int t = k[s] + 1 + row;
      col[row] = (t < K1) ? TO_FLOAT(conv_pool[(slot * K1 + (size_t)t) * C + c])
                          : TO_FLOAT(raw[((size_t)starts[s] + (size_t)(t - K1)) * C + c]);
    }
    for (int row = 0; row < K1; ++row) {
      ((DEVICE_PTR TC*)conv_pool)[(slot * K1 + (size_t)row) * C + c] = FROM_FLOAT(TC, col[row]);
    }
  }
}
if (gid == 0) {
  done[0] = 1;
}
"""


def _example(tc, tr) -> KernelExample:
    """A small GDN layer (Hv 4, dv = dk = 16, 96 conv channels, K-1 = 3) at 2 verifications x 3 rows: the
    template carries the geometry, so the emulator's trial (metal_cases_spec.py) runs this instantiation."""
    Hv, d, C, S, Tv = 4, 16, 96, 2, 6
    return KernelExample(
        inputs=[(mx.float32, (5, Hv, d, d)), (tc, (5, 3, C)), (mx.float32, (Tv, Hv, d, d)), (tr, (Tv, C)),
                (mx.int32, (S,)), (mx.int32, (S,)), (mx.int32, (S,))],
        outputs=[mx.int32],
        template=[("HV", Hv), ("DV", d), ("DK", d), ("K1", 3), ("C", C), ("TC", tc)])


PICK = portable_kernel(
    name="gdn_commit_inplace",
    input_names=["rec_pool", "conv_pool", "cand", "raw", "k", "starts", "slots"],
    output_names=["done"],
    body=_BODY,
    examples=[_example(mx.bfloat16, mx.bfloat16), _example(mx.float32, mx.float32)],
)


def covers(rec_pool, conv_pool, cand, raw, k) -> bool:
    S = k.shape[0] if k.ndim == 1 else 0
    return (rec_pool.dtype == mx.float32 and cand.dtype == mx.float32 and rec_pool.ndim == 4
            and cand.shape[1:] == rec_pool.shape[1:] and conv_pool.ndim == 3 and conv_pool.dtype in FLOATS
            and raw.dtype in FLOATS and 0 < S and raw.ndim == 2 and raw.shape[1] == conv_pool.shape[2]
            and raw.shape[0] == cand.shape[0] and k.dtype == mx.int32)


def pick_inplace(rec_pool, conv_pool, cand, raw, k, starts, slots, backend: str | None = None):
    """The commit written into rec_pool [slots, Hv, dv, dk] and conv_pool [slots, K-1, C] in place -> the
    `done` token [1] int32, or None (the row off, no GPU kernels, a shape it does not take: the caller
    commits with MLX ops). cand [Tv, Hv, dv, dk] fp32, raw [Tv, C]; k, starts, slots [S] int32; the
    verifying slots' conv rows in conv_pool are still those from before the verification. `backend` forces
    one (the emulator's tests)."""
    if backend is None:
        if not SELECT["gdn_commit_kernel"] or not use_kernels():
            return None
        backend = gpu_backend()
    if not covers(rec_pool, conv_pool, cand, raw, k):
        return None
    S, (_, Hv, dv, dk), (_, K1, C) = k.shape[0], rec_pool.shape, conv_pool.shape
    total = S * (Hv * dv * dk + C)  # a thread per state element, and per (slot, channel) of the conv rows
    return PICK(
        backend,
        inputs=[rec_pool, conv_pool, cand, raw, k, starts, slots],
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
        grid=(-(-total // _TG) * _TG, 1, 1),
        threadgroup=(_TG, 1, 1),
        template=[("HV", Hv), ("DV", dv), ("DK", dk), ("K1", K1), ("C", C), ("TC", conv_pool.dtype)],
    )[0]
