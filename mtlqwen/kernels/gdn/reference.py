"""Gated DeltaNet: gates, L2-normalised q/k and the delta-rule recurrence over the fp32 state (the
reference twins; kernels.py and normed.py are the GPU kernels, ops.py the dispatchers).

State layout per sequence: [Hv, dv, dk] fp32 (a dv row is contiguous in dk, which suits kernels that
put a SIMD group on one row). Math follows docs/qwen35.md §2.4-2.8; the docstrings use its names.
"""

from __future__ import annotations

import mlx.core as mx

from ..norms.reference import gated_rms_norm_ref
from ..seqs import SeqLayout

REF_CHUNK = 64  # the reference's chunk; the prefill kernel uses 32 (same function, other blocking)
RECURRENT_MAX_T = 16  # shorter segments (decode, verification) run the plain recurrence


def gdn_gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """a, b [T, Hv] -> (g, beta) [T, Hv] fp32: g = -exp(A_log) * softplus(a + dt_bias) <= 0."""
    beta = mx.sigmoid(b.astype(mx.float32))
    x = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    softplus = mx.logaddexp(x, mx.zeros_like(x))
    return -mx.exp(A_log.astype(mx.float32)) * softplus, beta


def l2_normalize(x: mx.array) -> mx.array:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, fp32 (the epsilon sits on the sum, §2.5)."""
    xf = x.astype(mx.float32)
    return xf * mx.rsqrt(mx.sum(xf * xf, axis=-1, keepdims=True) + 1e-6)


def _recurrent(q, k, v, g, beta, S):
    """q, k [Hv, T, dk], v [Hv, T, dv], g, beta [Hv, T], S [Hv, dv, dk] -> (o [Hv, T, dv], S)."""
    outs = []
    for t in range(q.shape[1]):
        S = S * mx.exp(g[:, t])[:, None, None]
        kt = k[:, t]
        pred = (S @ kt[:, :, None])[..., 0]  # [Hv, dv]
        delta = beta[:, t, None] * (v[:, t] - pred)
        S = S + delta[:, :, None] * kt[:, None, :]
        outs.append((S @ q[:, t, :, None])[..., 0])
    return mx.stack(outs, axis=1), S


def _chunked(q, k, v, g, beta, S):
    """Same contract as `_recurrent`, in REF_CHUNK-token blocks (§2.8), fp32 throughout."""
    Hv, T, dk = k.shape
    n = -(-T // REF_CHUNK)
    pad = n * REF_CHUNK - T
    if pad:  # zero k, v, beta and g leave the state untouched
        q, k, v = (mx.pad(t, [(0, 0), (0, pad), (0, 0)]) for t in (q, k, v))
        g, beta = (mx.pad(t, [(0, 0), (0, pad)]) for t in (g, beta))
    C = REF_CHUNK
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    incl = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    eye = mx.eye(C, dtype=mx.float32)
    St = S.transpose(0, 2, 1)  # [Hv, dk, dv], the HF orientation used by the chunk formulas
    outs = []
    for c in range(n):
        sl = slice(c * C, (c + 1) * C)
        qc, kc, vc, gc, bc = q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl]
        gam = mx.cumsum(gc, axis=-1)  # [Hv, C]
        diff = gam[:, :, None] - gam[:, None, :]  # gamma_i - gamma_j
        d_strict = mx.exp(mx.where(strict, diff, -mx.inf))
        d_incl = mx.exp(mx.where(incl, diff, -mx.inf))
        A = bc[:, :, None] * (kc @ kc.transpose(0, 2, 1)) * d_strict
        # (I + A) is unit lower triangular; the inverse runs on the CPU stream (linalg is CPU-only in MLX)
        inv = mx.linalg.tri_inv(eye + A, upper=False, stream=mx.cpu)
        U = inv @ (bc[:, :, None] * vc)
        W = inv @ ((bc * mx.exp(gam))[:, :, None] * kc)
        Vp = U - W @ St  # [Hv, C, dv]
        o = mx.exp(gam)[:, :, None] * (qc @ St) + ((qc @ kc.transpose(0, 2, 1)) * d_incl) @ Vp
        outs.append(o)
        last = gam[:, -1]
        St = mx.exp(last)[:, None, None] * St + (kc * mx.exp(last[:, None] - gam)[:, :, None]).transpose(0, 2, 1) @ Vp
    o = mx.concatenate(outs, axis=1)[:, :T]
    return o, St.transpose(0, 2, 1)


def _head_major_inputs(q, k, v, a, b, A_log, dt_bias):
    """Gates, normalised and scaled q/k expanded to the value heads (value head j reads key head j // r),
    all fp32 and packed [T, Hv, ...]."""
    Hv, dk = v.shape[1], q.shape[2]
    r = Hv // q.shape[1]
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    qn = l2_normalize(q) * (dk**-0.5)
    kn = l2_normalize(k)
    if r > 1:
        qn, kn = mx.repeat(qn, r, axis=1), mx.repeat(kn, r, axis=1)
    return qn, kn, v.astype(mx.float32), g, beta


def gated_delta_ref(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state_pool: mx.array,
    layout: SeqLayout,
) -> tuple[mx.array, mx.array]:
    """q, k [T, Hk, dk] (post-conv, not yet normalised), v [T, Hv, dv], a, b [T, Hv],
    state_pool [S, Hv, dv, dk] fp32. Returns o [T, Hv, dv] (v's dtype) and new states [B, Hv, dv, dk]."""
    qn, kn, vf, g, beta = _head_major_inputs(q, k, v, a, b, A_log, dt_bias)
    outs, states = [], []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        S = state_pool[layout.array("state_rows")[i]].astype(mx.float32)  # by array: compile-safe
        args = [t[s:e].swapaxes(0, 1) for t in (qn, kn, vf, g, beta)]  # head-major
        fn = _recurrent if e - s <= RECURRENT_MAX_T else _chunked
        o, S = fn(*args, S)
        outs.append(o.swapaxes(0, 1))
        states.append(S)
    return mx.concatenate(outs, axis=0).astype(v.dtype), mx.stack(states)


def gated_delta_candidates_ref(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state_pool: mx.array,
    layout: SeqLayout,
) -> tuple[mx.array, mx.array, mx.array]:
    """`gated_delta_ref` that also returns the state after every token (speculative verification keeps
    the one after the last accepted token): (o [T, Hv, dv], new states [B, Hv, dv, dk],
    all states [T, Hv, dv, dk] fp32, row t = the state of t's sequence after token t)."""
    qn, kn, vf, g, beta = _head_major_inputs(q, k, v, a, b, A_log, dt_bias)
    outs, states, every = [], [], []
    for i in range(layout.num_seqs):
        s, e = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        S = state_pool[layout.array("state_rows")[i]].astype(mx.float32)  # by array: compile-safe
        for t in range(s, e):  # one token at a time: its state is the candidate
            o, S = _recurrent(*[x[t : t + 1].swapaxes(0, 1) for x in (qn, kn, vf, g, beta)], S)
            outs.append(o.swapaxes(0, 1))
            every.append(S)
        states.append(S)
    o = mx.concatenate(outs, axis=0) if outs else mx.zeros(v.shape, dtype=mx.float32)
    every = mx.stack(every) if every else mx.zeros((0,) + state_pool.shape[1:], dtype=mx.float32)
    return o.astype(v.dtype), mx.stack(states), every


def split_qkv(y: mx.array, heads: tuple[int, int, int, int]) -> tuple[mx.array, mx.array, mx.array]:
    """The conv output y [T, 2*Hk*dk + Hv*dv] -> q, k [T, Hk, dk], v [T, Hv, dv] (channel order q | k | v)."""
    Hk, dk, Hv, dv = heads
    T, kd = y.shape[0], Hk * dk
    return y[:, :kd].reshape(T, Hk, dk), y[:, kd : 2 * kd].reshape(T, Hk, dk), y[:, 2 * kd :].reshape(T, Hv, dv)


def gated_delta_packed_normed_ref(y, z, norm_w, eps: float, a, b, A_log, dt_bias, state_pool, layout: SeqLayout,
                                  heads: tuple[int, int, int, int]):
    """The GDN output with its gated RMSNorm: `gated_delta_ref` on y's q | k | v channels, then
    `gated_rms_norm_ref` per value head. z: T * Hv * dv values (any shape), norm_w [dv].
    -> (o_normed [T, Hv*dv] in y's dtype, new states [B, Hv, dv, dk] fp32)."""
    o, states = gated_delta_ref(*split_qkv(y, heads), a, b, A_log, dt_bias, state_pool, layout)
    return _head_norm_ref(o, z, norm_w, eps, heads), states


def _head_norm_ref(o, z, norm_w, eps: float, heads: tuple[int, int, int, int]):
    """`gated_rms_norm_ref` per value head of o [T, Hv, dv] (z: T * Hv * dv values) -> [T, Hv*dv]."""
    T, (_, _, Hv, dv) = o.shape[0], heads
    return gated_rms_norm_ref(o.reshape(T * Hv, dv), z.reshape(T * Hv, dv), norm_w, eps).reshape(T, Hv * dv)


def gated_delta_packed_candidates_normed_ref(y, z, norm_w, eps: float, a, b, A_log, dt_bias, state_pool,
                                             layout: SeqLayout, heads: tuple[int, int, int, int]):
    """A verification's GDN layer: `gated_delta_candidates_ref` on y's q | k | v channels, its output through
    `gated_rms_norm_ref` per value head. -> (o_normed [T, Hv*dv] in y's dtype, new states [B, Hv, dv, dk],
    all states [T, Hv, dv, dk] fp32)."""
    o, states, cand = gated_delta_candidates_ref(*split_qkv(y, heads), a, b, A_log, dt_bias, state_pool, layout)
    return _head_norm_ref(o, z, norm_w, eps, heads), states, cand
