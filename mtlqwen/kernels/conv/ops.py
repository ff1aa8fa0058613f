"""The conv op: the conv kernel (kernels.py) where it runs, the reference otherwise."""

from __future__ import annotations

import mlx.core as mx

from ..dispatch import kernel_op
from ..seqs import SeqLayout
from . import kernels
from .reference import causal_conv1d_ref


def _reference(x, w, conv_pool, layout, write_state=False):
    return causal_conv1d_ref(x, w, conv_pool, layout)


@kernel_op("causal_conv1d", kernels.causal_conv1d_kernel, reference=_reference, pools=("conv_pool",))
def causal_conv1d(x: mx.array, w: mx.array, conv_pool: mx.array, layout: SeqLayout,
                  write_state: bool = False) -> tuple[mx.array, mx.array | None]:
    """-> (y, new states [B, K-1, C]) for the caller's scatter, or -- write_state, and the GPU kernel with
    SELECT["conv_state_inplace"] took it (as `gated_delta_packed`'s write_state) -- (y, None): the states
    are already in conv_pool's rows. The pool array is then unchanged as a graph node while its contents
    changed, and MLX orders kernels only through data: the caller makes every later reader of the pool
    depend on this launch (GDNMixer rebinds the pool to `mx.depends(pool, y)`)."""
    return causal_conv1d_ref(x, w, conv_pool, layout)
