"""The Gated DeltaNet ops: the recurrent / chunk kernels (kernels.py) and the recurrence with its output
norm fused (normed.py) where they run, the references otherwise."""

from __future__ import annotations

from ..dispatch import kernel_op
from ..norms.ops import gated_rms_norm
from ..seqs import SeqLayout
from . import kernels, normed
from .reference import (
    gated_delta_candidates_ref,
    gated_delta_packed_candidates_normed_ref,
    gated_delta_packed_normed_ref,
    gated_delta_ref,
    split_qkv,
)

_POOLS = ("state_pool",)


@kernel_op("gated_delta", kernels.gated_delta_kernel, pools=_POOLS)
def gated_delta(q, k, v, a, b, A_log, dt_bias, state_pool, layout: SeqLayout):
    """q, k [T, Hk, dk], v [T, Hv, dv], a, b [T, Hv] -> (o [T, Hv, dv], new states [B, Hv, dv, dk])."""
    return gated_delta_ref(q, k, v, a, b, A_log, dt_bias, state_pool, layout)


@kernel_op("gated_delta_candidates", kernels.gated_delta_candidates_kernel, pools=_POOLS)
def gated_delta_candidates(q, k, v, a, b, A_log, dt_bias, state_pool, layout: SeqLayout):
    """Like `gated_delta`, plus the candidate state after every token ([T, Hv, dv, dk] fp32)."""
    return gated_delta_candidates_ref(q, k, v, a, b, A_log, dt_bias, state_pool, layout)


def _packed_ref(y, a, b, A_log, dt_bias, state_pool, layout, heads, write_state=False):
    return gated_delta_ref(*split_qkv(y, heads), a, b, A_log, dt_bias, state_pool, layout)


@kernel_op("gated_delta_packed", kernels.gated_delta_packed_kernel, reference=_packed_ref, pools=_POOLS)
def gated_delta_packed(y, a, b, A_log, dt_bias, state_pool, layout: SeqLayout, heads: tuple[int, int, int, int],
                       write_state: bool = False):
    """`gated_delta` on the packed conv output y (heads = (Hk, dk, Hv, dv)): the kernel reads q, k, v where
    they lie in y instead of taking three sliced copies. write_state: the caller allows the kernel to write
    the new states into state_pool's rows itself; it then returns (o, None) and the caller skips its scatter
    (the reference always returns the states)."""
    return _packed_ref(y, a, b, A_log, dt_bias, state_pool, layout, heads)


def _packed_candidates_ref(y, a, b, A_log, dt_bias, state_pool, layout, heads):
    return gated_delta_candidates_ref(*split_qkv(y, heads), a, b, A_log, dt_bias, state_pool, layout)


@kernel_op("gated_delta_packed_candidates", kernels.gated_delta_packed_candidates_kernel,
           reference=_packed_candidates_ref, pools=_POOLS)
def gated_delta_packed_candidates(y, a, b, A_log, dt_bias, state_pool, layout: SeqLayout,
                                  heads: tuple[int, int, int, int]):
    """`gated_delta_candidates` on the packed conv output y (heads = (Hk, dk, Hv, dv)), as
    `gated_delta_packed` reads it: a verification's GDN layer without three sliced copies of y.
    -> (o [T, Hv, dv], new states [B, Hv, dv, dk], the state after every token [T, Hv, dv, dk] fp32)."""
    return _packed_candidates_ref(y, a, b, A_log, dt_bias, state_pool, layout, heads)


def _normed_ref(y, z, norm_w, eps, a, b, A_log, dt_bias, state_pool, layout, heads, write_state=False):
    return gated_delta_packed_normed_ref(y, z, norm_w, eps, a, b, A_log, dt_bias, state_pool, layout, heads)


@kernel_op("gated_delta_packed_normed", normed.gated_delta_packed_normed_kernel, reference=_normed_ref,
           row="gdn_fused_norm", pools=_POOLS)
def gated_delta_packed_normed(y, z, norm_w, eps: float, a, b, A_log, dt_bias, state_pool, layout: SeqLayout,
                              heads: tuple[int, int, int, int], write_state: bool = False):
    """`gated_delta_packed` followed by the gated RMSNorm: one kernel (normed.py) where
    SELECT["gdn_fused_norm"] allows it and it covers the batch (recurrent segments, head shapes within its
    register budget), else the two ops one after the other (each a kernel of its own on the GPU, the
    references on the CPU). Returns (o_normed [T, Hv*dv] in y's dtype, new states) or, when the kernel
    wrote the states into state_pool's rows itself (write_state, GPU), (o_normed, None)."""
    o, states = gated_delta_packed(y, a, b, A_log, dt_bias, state_pool, layout, heads, write_state)
    return gated_head_norm(o, z, norm_w, eps, heads), states


def gated_head_norm(o, z, norm_w, eps: float, heads: tuple[int, int, int, int]):
    """The GDN output's gated RMSNorm per value head: o, z of T * Hv * dv values -> [T, Hv*dv]. On
    [T * Hv, dv] views: 2-D inputs need no reshape inside the norm op."""
    T, (_, _, Hv, dv) = o.shape[0], heads
    return gated_rms_norm(o.reshape(T * Hv, dv), z.reshape(T * Hv, dv), norm_w, eps).reshape(T, Hv * dv)


@kernel_op("gated_delta_packed_candidates_normed", normed.gated_delta_packed_candidates_normed_kernel,
           reference=gated_delta_packed_candidates_normed_ref, row="gdn_fused_norm_candidates", pools=_POOLS)
def gated_delta_packed_candidates_normed(y, z, norm_w, eps: float, a, b, A_log, dt_bias, state_pool,
                                         layout: SeqLayout, heads: tuple[int, int, int, int]):
    """`gated_delta_packed_candidates` followed by the gated RMSNorm: one kernel (normed.py) where
    SELECT["gdn_fused_norm_candidates"] allows it and it covers the batch, else the two ops one after the
    other. -> (o_normed [T, Hv*dv] in y's dtype, new states, the state after every token [T, Hv, dv, dk])."""
    o, states, cand = gated_delta_packed_candidates(y, a, b, A_log, dt_bias, state_pool, layout, heads)
    return gated_head_norm(o, z, norm_w, eps, heads), states, cand
