"""What `check_metal --run` executes: for every registered kernel, launches through its op's GPU entry on
the Metal emulator (inputs shaped as the kernel's registered examples, with the examples' template values:
the same instantiations check_metal compiles) and the plain-MLX reference twin on the CPU.

A `Trial` gives outputs to compare: the kernel's (run under `metal_emulator.emulating`) and the
reference's, with a tolerance each (relative to the reference's largest magnitude; 0 = bit for bit). For
kernels that write a pool in place, the outputs are the pool rows after the launch (and the untouched
rows, which must stay bit for bit). Op functions are looked up by name anywhere under mtlqwen.kernels
(`_fn`), so moving an op into a subpackage does not break the table.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import mlx.core as mx

F32, BF16 = mx.float32, mx.bfloat16
TOL = {F32: 1e-4, BF16: 1.5e-2}  # bf16: one rounding of the output and some slack
STATE_TOL = {F32: 1e-4, BF16: 1e-3}  # fp32 states whatever the activation dtype


@dataclass
class Trial:
    label: str
    run: Callable[[], list]  # the kernel's outputs, under emulating()
    ref: Callable[[], list]  # the reference's outputs, on the CPU
    tol: list[float]
    # while it runs, the registered kernel `substitute[0]` launches `substitute[1]`'s Metal rendering (a
    # variant no op selects on Metal, run with the geometry of the kernel it stands in for)
    substitute: tuple[str, str] | None = None
    # the registered kernels it launches (default: the label's name)
    kernels: tuple[str, ...] = ()

    def __post_init__(self):
        self.kernels = self.kernels or (self.substitute[1] if self.substitute else self.label.split("[")[0],)


_INDEX: dict[str, list] = {}


def _fn(name: str):
    """The function / class `name` from the one module under mtlqwen.kernels that defines it."""
    if not _INDEX:
        pkg = importlib.import_module("mtlqwen.kernels")
        for info in pkgutil.walk_packages(pkg.__path__, "mtlqwen.kernels."):
            if info.name.rsplit(".", 1)[-1].startswith(("check_", "metal_")):
                continue
            mod = importlib.import_module(info.name)
            for attr, obj in vars(mod).items():
                if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == info.name:
                    _INDEX.setdefault(attr, []).append(obj)
    found = _INDEX.get(name, [])
    if len(found) != 1:
        raise LookupError(f"{len(found)} modules under mtlqwen.kernels define {name}: "
                          f"{[f.__module__ for f in found]}")
    return found[0]


def _n(dt) -> str:
    return str(dt).rsplit(".", 1)[-1]


def _rand(rng, *shape, dtype=F32, scale=1.0):
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def _cpu(fn, *a, **kw):
    with mx.stream(mx.cpu):
        out = fn(*a, **kw)
        mx.eval(out)
    return out


def _layout(lens, S, rng):
    """Packed sequences of lengths `lens` whose state rows are a random subset of S pool rows."""
    B = len(lens)
    rows = [int(x) for x in rng.permutation(S)[:B]]
    return _fn("SeqLayout")(query_start_loc=[0] + [int(x) for x in np.cumsum(lens)], kv_valid=[0] * B,
                            block_tables=[[0]] * B, state_rows=rows)


def _pool_rows(pool, rows):
    """(rows of the pool, the other rows), fp32 copies taken now."""
    p = np.array(pool.astype(F32))
    others = [i for i in range(p.shape[0]) if i not in rows]
    return [mx.array(p[rows]), mx.array(p[others])]


# ---- rows: RMSNorm, gated RMSNorm, add + RMSNorm, RoPE, q/k norm + RoPE -------------------------------------


def _row_trials() -> list[Trial]:
    out = []
    for dt, D in ((BF16, 4096), (F32, 48)):
        rng = np.random.default_rng(D)
        x, z, d = (_rand(rng, 5, D, dtype=dt) for _ in range(3))
        w = 1 + _rand(rng, D, dtype=dt, scale=0.2)
        tag = f"{_n(dt)} D={D}"
        out += [
            Trial(f"rms_norm[{tag}]", lambda x=x, w=w: [_fn("rms_norm_kernel")(x, w, 1e-6)],
                  lambda x=x, w=w: [_cpu(_fn("rms_norm_ref"), x, w, 1e-6)], [TOL[dt]]),
            Trial(f"gated_rms_norm[{tag}]", lambda x=x, z=z, w=w: [_fn("gated_rms_norm_kernel")(x, z, w, 1e-5)],
                  lambda x=x, z=z, w=w: [_cpu(_fn("gated_rms_norm_ref"), x, z, w, 1e-5)], [TOL[dt]]),
            Trial(f"add_rms_norm[{tag}]", lambda x=x, d=d, w=w: list(_fn("add_rms_norm_kernel")(x, d, w, 1e-6)),
                  lambda x=x, d=d, w=w: list(_cpu(_fn("add_rms_norm_ref"), x, d, w, 1e-6)), [0.0, TOL[dt]]),
        ]
    for dt, H in ((BF16, 16), (F32, 3)):
        rng = np.random.default_rng(H)
        tables = _fn("RopeTables")(64, 1e7, initial=64)
        x = _rand(rng, 3, H, 256, dtype=dt)
        pos = mx.array(rng.integers(0, 64, 3).astype(np.int32))
        out.append(Trial(f"rope_tables[{_n(dt)} H={H}]", lambda x=x, p=pos, t=tables: [_fn("rope_kernel")(x, p, t)],
                         lambda x=x, p=pos, t=tables: [_cpu(_fn("apply_rope_ref"), x, p, t)], [TOL[dt]]))
    for dt, H, RS in ((BF16, 16, 512), (F32, 4, 256)):  # row stride RS = 2 * D: q inside the q|gate rows
        rng = np.random.default_rng(RS)
        tables = _fn("RopeTables")(64, 1e7, initial=64)
        x, w = _rand(rng, 3, H, RS, dtype=dt), 1 + _rand(rng, 256, dtype=dt, scale=0.2)
        pos = mx.array(rng.integers(0, 64, 3).astype(np.int32))
        out.append(Trial(
            f"head_norm_rope[{_n(dt)} H={H} RS={RS}]",
            lambda x=x, w=w, p=pos, t=tables: [_fn("head_norm_rope_kernel")(x, w, 1e-6, p, t, 256)],
            lambda x=x, w=w, p=pos, t=tables: [_cpu(_fn("head_norm_rope_ref"), x, w, 1e-6, p, t, 256)], [TOL[dt]]))
    return out


# ---- causal conv1d + SiLU ------------------------------------------------------------------------------------


def _conv_trials() -> list[Trial]:
    out = []
    for xt, pt, lens, CH, S, K in ((BF16, BF16, [5, 3], 8192, 4, 4), (F32, F32, [1, 6, 2], 416, 5, 4),
                                   (BF16, F32, [4, 1], 300, 3, 2)):
        rng = np.random.default_rng(CH)
        layout = _layout(lens, S, rng)
        x, w = _rand(rng, sum(lens), CH, dtype=xt), _rand(rng, CH, K, dtype=xt)
        pool = _rand(rng, S, K - 1, CH, dtype=pt)
        tag = f"{_n(xt)}/{_n(pt)} CH={CH} K={K}"
        if K == 4:
            out.append(Trial(f"causal_conv1d_silu[{tag}]",
                             lambda x=x, w=w, p=pool, L=layout: list(_fn("run_conv")(x, w, p, L)),
                             lambda x=x, w=w, p=pool, L=layout: list(_cpu(_fn("causal_conv1d_ref"), x, w, p, L)),
                             [TOL[xt], 0.0]))
        pool2 = _rand(rng, S, K - 1, CH, dtype=pt)

        def run(x=x, w=w, p=pool2, L=layout):
            y, done = _fn("run_conv")(x, w, p, L, inplace=True)
            return [y, done] + _pool_rows(p, L.state_rows)

        def ref(x=x, w=w, p=pool2, L=layout):
            before = _pool_rows(p, L.state_rows)
            y, states = _cpu(_fn("causal_conv1d_ref"), x, w, p + 0, L)
            return [y, mx.array([1], dtype=mx.int32), states.astype(F32), before[1]]

        out.append(Trial(f"causal_conv1d_silu_inplace[{tag}]", run, ref, [TOL[xt], 0.0, 0.0, 0.0]))
    return out


# ---- GDN: recurrent, chunked, candidates, in place, fused gated norm -----------------------------------------------


def _gdn_args(seed, lens, Hk, Hv, dk, dv, dt):
    rng = np.random.default_rng(seed)
    T, B = sum(lens), len(lens)
    S = B + 1
    layout = _layout(lens, S, rng)
    args = dict(q=_rand(rng, T, Hk, dk, dtype=dt), k=_rand(rng, T, Hk, dk, dtype=dt), v=_rand(rng, T, Hv, dv, dtype=dt),
                a=_rand(rng, T, Hv, dtype=dt), b=_rand(rng, T, Hv, dtype=dt),
                A_log=mx.array(np.log(rng.uniform(1, 16, Hv)).astype(np.float32)),
                dt_bias=_rand(rng, Hv, dtype=dt, scale=0.5), state_pool=_rand(rng, S, Hv, dv, dk, scale=0.1))
    return args, layout, rng


def _packed(args):
    q, k, v = args["q"], args["k"], args["v"]
    T, Hk, dk = q.shape
    y = mx.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1)
    return y, (Hk, dk, v.shape[1], v.shape[2])


def _gdn_trials() -> list[Trial]:
    out = []
    geoms = ((BF16, 16, 32, 128, 128, [5, 3]), (F32, 2, 6, 32, 48, [4, 3]))
    for dt, Hk, Hv, dk, dv, lens in geoms:
        tag = f"{_n(dt)} Hk={Hk} Hv={Hv} dk={dk} dv={dv}"
        tol = [TOL[dt], STATE_TOL[dt]]
        for chunk, name in ((False, "gdn_recurrent"), (True, "gdn_chunk")):
            args, layout, _ = _gdn_args(dk + chunk, lens, Hk, Hv, dk, dv, dt)
            out.append(Trial(f"{name}[{tag}]",
                             lambda a=args, L=layout, c=chunk: list(_fn("run_gdn")(**a, layout=L, chunk=c)),
                             lambda a=args, L=layout: list(_cpu(_fn("gated_delta_ref"), **a, layout=L)), tol))
            args, layout, _ = _gdn_args(dk + chunk + 2, lens, Hk, Hv, dk, dv, dt)

            def run(a=args, L=layout, c=chunk):
                o, done = _fn("run_gdn")(**a, layout=L, chunk=c, inplace=True)
                return [o, done] + _pool_rows(a["state_pool"], L.state_rows)

            def ref(a=args, L=layout):
                before = _pool_rows(a["state_pool"], L.state_rows)
                o, states = _cpu(_fn("gated_delta_ref"), **{**a, "state_pool": a["state_pool"] + 0}, layout=L)
                return [o, mx.array([1], dtype=mx.int32), states, before[1]]

            out.append(Trial(f"{name}_inplace[{tag}]", run, ref, [TOL[dt], 0.0, STATE_TOL[dt], 0.0]))
        args, layout, _ = _gdn_args(dk + 5, lens, Hk, Hv, dk, dv, dt)
        out.append(Trial(f"gdn_recurrent_cand[{tag}]",
                         lambda a=args, L=layout: list(_fn("run_gdn")(**a, layout=L, candidates=True)),
                         lambda a=args, L=layout: list(_cpu(_fn("gated_delta_candidates_ref"), **a, layout=L)),
                         tol + [STATE_TOL[dt]]))
        for inplace in (False, True):
            args, layout, rng = _gdn_args(dk + 7 + inplace, lens, Hk, Hv, dk, dv, dt)
            y, heads = _packed(args)
            T = y.shape[0]
            z = _rand(rng, T, Hv * dv, dtype=dt)
            nw = 1 + _rand(rng, dv, scale=0.2)
            rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias")}
            pool = args["state_pool"]

            def run(y=y, z=z, nw=nw, r=rest, p=pool, L=layout, h=heads, ip=inplace):
                o, s = _fn("run_gdn_normed")(y, z, nw, 1e-6, **r, state_pool=p, layout=L, heads=h, inplace=ip)
                return [o, s] + (_pool_rows(p, L.state_rows) if ip else [])

            def ref(y=y, z=z, nw=nw, r=rest, p=pool, L=layout, h=heads, ip=inplace):
                before = _pool_rows(p, L.state_rows)
                o, s = _cpu(_fn("gated_delta_packed_normed_ref"), y, z, nw, 1e-6, **r, state_pool=p + 0, layout=L,
                            heads=h)
                return [o, mx.array([1], dtype=mx.int32), s, before[1]] if ip else [o, s]

            out.append(Trial(f"gdn_recurrent_normed{'_inplace' if inplace else ''}[{tag}]", run, ref,
                             [TOL[dt], 0.0, STATE_TOL[dt], 0.0] if inplace else tol))
        args, layout, rng = _gdn_args(dk + 11, lens, Hk, Hv, dk, dv, dt)
        y, heads = _packed(args)
        z = _rand(rng, y.shape[0], Hv * dv, dtype=dt)
        nw = 1 + _rand(rng, dv, scale=0.2)
        rest = {n: args[n] for n in ("a", "b", "A_log", "dt_bias", "state_pool")}
        out.append(Trial(
            f"gdn_recurrent_normed_cand[{tag}]",
            lambda y=y, z=z, nw=nw, r=rest, L=layout, h=heads: list(
                _fn("run_gdn_normed")(y, z, nw, 1e-6, **r, layout=L, heads=h, candidates=True)),
            lambda y=y, z=z, nw=nw, r=rest, L=layout, h=heads: list(
                _cpu(_fn("gated_delta_packed_candidates_normed_ref"), y, z, nw, 1e-6, **r, layout=L, heads=h)),
            tol + [STATE_TOL[dt]]))
    # the recurrences' staged bodies (SELECT["gdn_normed_stage"], ["gdn_recurrent_stage"]) on the same cases, with
    # the block their examples declare (segments of 3-5 tokens: partial blocks; the tests draw whole ones too)
    staged = []
    for t in out:
        for prefix, row in (("gdn_recurrent_normed", "gdn_normed_stage"), ("gdn_recurrent", "gdn_recurrent_stage")):
            if t.label.startswith(prefix):  # gdn_recurrent_normed[_x][...] -> gdn_recurrent_normed_staged[_x][...]
                staged.append(Trial(prefix + "_staged" + t.label[len(prefix):], _staged_run(t.run, row), t.ref, t.tol))
                break
    return out + staged


def _staged_run(run: Callable[[], list], row: str) -> Callable[[], list]:
    def staged():
        from .gdn.pieces import STAGE_EXAMPLE  # noqa: PLC0415
        from .selection import selected  # noqa: PLC0415

        with selected({row: STAGE_EXAMPLE}):
            return run()
    return staged


# ---- paged attention and the in-place KV write -----------------------------------------------------------------


def _attn_batch(rng, dt, past, qlens, nkv=4, rep=4, hd=256, bt=128):
    need = [(p + t + bt - 1) // bt for p, t in zip(past, qlens)]
    nblocks = sum(need) + 2  # two garbage blocks no table names
    ids = rng.permutation(nblocks).tolist()
    tables, o = [], 0
    for n in need:
        tables.append(ids[o:o + n])
        o += n
    kp, vp = (_rand(rng, nblocks, bt, nkv, hd, dtype=dt) for _ in range(2))
    qsl = [0] + [int(x) for x in np.cumsum(qlens)]
    layout = _fn("SeqLayout")(query_start_loc=qsl, kv_valid=list(past), block_tables=tables,
                              state_rows=list(range(len(past))), block_tokens=bt)
    q = _rand(rng, qsl[-1], nkv * rep, hd, dtype=dt)
    return q, kp, vp, layout


def _attn_trials() -> list[Trial]:
    out = []
    for dt in (BF16, F32):
        rng = np.random.default_rng(3)
        q, kp, vp, layout = _attn_batch(rng, dt, past=[130, 37], qlens=[2, 2])
        scale = 256 ** -0.5
        packed = mx.concatenate([_rand(rng, *q.shape, dtype=dt), _rand(rng, *q.shape, dtype=dt)], axis=-1)
        compact = _rand(rng, q.shape[0], q.shape[1] * q.shape[2], dtype=dt)
        for splits in (1, 3):
            ks = ("mtl_paged_attn_s1_g0", "mtl_paged_attn_merge_g0") if splits > 1 else ("mtl_paged_attn_s0_g0",)
            out.append(Trial(
                f"paged_attention[{_n(dt)} {'split' if splits > 1 else 'single'}]",
                lambda q=q, k=kp, v=vp, L=layout, n=splits: [_fn("paged_attention_gpu")(q, k, v, L, scale, splits=n)],
                lambda q=q, k=kp, v=vp, L=layout: [_cpu(_fn("paged_attention_ref"), q, k, v, L, scale)], [TOL[dt]],
                kernels=ks))
        for splits, gate in ((1, packed), (3, packed), (3, compact)):  # the gate read in place, or compact rows
            s = ("split" if splits > 1 else "single") + (" q|gate" if gate is packed else " compact gate")
            ks = ("mtl_paged_attn_s1_g0", "mtl_paged_attn_merge_g1") if splits > 1 else ("mtl_paged_attn_s0_g1",)
            out.append(Trial(
                f"paged_attention_gated[{_n(dt)} {s}]",
                lambda q=q, k=kp, v=vp, L=layout, n=splits, g=gate: [
                    _fn("paged_attention_gpu")(q, k, v, L, scale, gate=g, splits=n)],
                lambda q=q, k=kp, v=vp, L=layout, g=gate: [
                    _cpu(_fn("paged_attention_gated_ref"), q, k, v, L, scale, g)], [TOL[dt]], kernels=ks))
    for pt, kt in ((BF16, BF16), (F32, BF16)):
        rng = np.random.default_rng(5)
        _, kp, vp, layout = _attn_batch(rng, pt, past=[126, 3], qlens=[4, 5])
        k, v = (_rand(rng, 9, 4, 256, dtype=kt) for _ in range(2))

        def run(kp=kp, vp=vp, k=k, v=v, L=layout):
            done = _fn("write_kv_inplace_kernel")(kp, vp, k, v, L)
            return [done, kp.astype(F32) + 0, vp.astype(F32) + 0]

        def ref(kp=kp, vp=vp, k=k, v=v, L=layout):
            rk, rv = _cpu(_fn("write_kv"), kp + 0, vp + 0, k, v, L)
            return [mx.array([1], dtype=mx.int32), rk.astype(F32), rv.astype(F32)]

        out.append(Trial(f"mtl_kv_write_inplace[{_n(pt)} pool, {_n(kt)} k/v]", run, ref, [0.0, 0.0, 0.0]))
    # q / k norm + RoPE and the in-place write in one launch (attention/prep.py), at the examples' geometries
    geoms = ((16, 4, 256, 64), (16, 2, 256, 64), (4, 2, 64, 32))
    # (activation dtype, norm-weight dtype): bf16 activations beside fp32 norms too (the 35B-A3B's checkpoints)
    for (dt, wt), (hq, hk, hd, rd) in [((d, d), g) for d in (BF16, F32) for g in geoms] + [((BF16, F32), geoms[1])]:
        rng = np.random.default_rng(6)
        _, kp, vp, layout = _attn_batch(rng, dt, past=[126, 3], qlens=[4, 5], nkv=hk, rep=hq // hk, hd=hd)
        qg, k, v = _rand(rng, 9, hq, 2 * hd, dtype=dt), _rand(rng, 9, hk, hd, dtype=dt), _rand(rng, 9, hk, hd, dtype=dt)
        qn, kn = ((1 + _rand(rng, hd, dtype=dt, scale=0.2)).astype(wt) for _ in range(2))
        tables = _fn("RopeTables")(rd, 1e7)
        pos = layout.array("positions")

        def run(kp=kp, vp=vp, qg=qg, k=k, v=v, qn=qn, kn=kn, t=tables, pos=pos, L=layout, hd=hd):
            q, kk, done = _fn("prep_kv_write")(qg, k, v, qn, kn, 1e-6, pos, t, hd, kp, vp, L)
            return [q, kk, done, kp.astype(F32) + 0, vp.astype(F32) + 0]

        def ref(kp=kp, vp=vp, qg=qg, k=k, v=v, qn=qn, kn=kn, t=tables, pos=pos, L=layout, hd=hd):
            hnr = _fn("head_norm_rope_ref")
            rq, rk = _cpu(hnr, qg, qn, 1e-6, pos, t, hd), _cpu(hnr, k, kn, 1e-6, pos, t, hd)
            wk, wv = _cpu(_fn("write_kv"), kp + 0, vp + 0, rk, v, L)
            return [rq, rk, mx.array([1], dtype=mx.int32), wk.astype(F32), wv.astype(F32)]

        out.append(Trial(f"mtl_attn_prep_kv_write[{_n(dt)} {hq}/{hk} heads of {hd}, {_n(wt)} norms]", run, ref,
                         [TOL[dt], TOL[dt], 0.0, TOL[dt], 0.0]))
    # the DFlash drafter's forms: k and v read in place from its k|v projection rows [T, 2 * 8 * 128], with q (a
    # proposal of 8 rows) and without (a context write of 16)
    for hq, qlens in ((32, [8]), (0, [9, 7])):
        rng = np.random.default_rng(7)
        _, kp, vp, layout = _attn_batch(rng, BF16, past=[126, 3][:len(qlens)], qlens=qlens, nkv=8, rep=4, hd=128)
        T = sum(qlens)
        qg = _rand(rng, T, hq, 128, dtype=BF16) if hq else None
        kv = _rand(rng, T, 2 * 8 * 128, dtype=BF16)
        qn, kn = ((1 + _rand(rng, 128, dtype=BF16, scale=0.2)) for _ in range(2))
        tables = _fn("RopeTables")(128, 1e6)
        pos = layout.array("positions")

        def run(kp=kp, vp=vp, qg=qg, kv=kv, qn=qn, kn=kn, t=tables, pos=pos, L=layout):
            q, kk, done = _fn("prep_kv_write")(qg, kv, kv, qn, kn, 1e-6, pos, t, 128, kp, vp, L, k_off=0, v_off=1024)
            return ([q] if qg is not None else []) + [kk, done, kp.astype(F32) + 0, vp.astype(F32) + 0]

        def ref(kp=kp, vp=vp, qg=qg, kv=kv, qn=qn, kn=kn, t=tables, pos=pos, L=layout, T=T):
            hnr = _fn("head_norm_rope_ref")
            rk = _cpu(hnr, kv[:, :1024].reshape(T, 8, 128), kn, 1e-6, pos, t, 128)
            wk, wv = _cpu(_fn("write_kv"), kp + 0, vp + 0, rk, kv[:, 1024:].reshape(T, 8, 128), L)
            return (([_cpu(hnr, qg, qn, 1e-6, pos, t, 128)] if qg is not None else [])
                    + [rk, mx.array([1], dtype=mx.int32), wk.astype(F32), wv.astype(F32)])

        out.append(Trial(f"mtl_attn_prep_kv_write[bf16 {hq}/8 heads of 128, k|v rows read in place]", run, ref,
                         ([TOL[BF16]] if hq else []) + [TOL[BF16], 0.0, TOL[BF16], 0.0]))
    return out


def edge_trials() -> list[Trial]:
    """Shapes past the registered examples that an op still says it covers on Metal: the widest head paged
    attention accepts there (256) with 16 query rows a threadgroup (4 tokens x GQA 4). (At 512 those rows
    need 34,944 bytes of threadgroup memory, past Metal's 32 KiB, so Metal leaves 512 to the reference.)"""
    rng = np.random.default_rng(4)
    q, kp, vp, layout = _attn_batch(rng, BF16, past=[40], qlens=[4], nkv=1, rep=4, hd=256, bt=16)
    scale = 256 ** -0.5
    return [Trial("paged_attention[bfloat16 hd=256 16 rows]",
                  lambda: [_fn("paged_attention_gpu")(q, kp, vp, layout, scale, splits=1)],
                  lambda: [_cpu(_fn("paged_attention_ref"), q, kp, vp, layout, scale)], [TOL[BF16]],
                  kernels=("mtl_paged_attn_s0_g0",))]


def _prefill_trials() -> list[Trial]:
    """A prefill-sized packed batch (chunks past SELECT["prefill_attn_min_queries"], a decode row beside them)
    through the attention dispatch at the 9B head shape with the q|gate projection: on Metal it takes the
    decode kernel's portable body (CUDA would take the tensor-core prefill kernel, a limit violation here)."""
    rng = np.random.default_rng(17)
    from .selection import SELECT  # noqa: PLC0415

    lim = SELECT["prefill_attn_min_queries"]
    q, kp, vp, layout = _attn_batch(rng, BF16, past=[130, 0, 70], qlens=[lim + 9, lim + 4, 1], nkv=2, rep=4)
    gate = mx.concatenate([_rand(rng, *q.shape, dtype=BF16), _rand(rng, *q.shape, dtype=BF16)], axis=-1)
    scale = 256 ** -0.5
    return [Trial("paged_attention_gated[bfloat16 prefill chunks, default selection]",
                  lambda: [_fn("attention_kernel")(q, kp, vp, layout, scale, gate=gate)],
                  lambda: [_cpu(_fn("paged_attention_gated_ref"), q, kp, vp, layout, scale, gate)], [TOL[BF16]],
                  kernels=("mtl_paged_attn_s1_g0", "mtl_paged_attn_merge_g1"))]


def trials(names=None, edges: bool = True) -> list[Trial]:
    """Every trial (edges: with the shapes past the examples), or those launching one of the kernels `names`."""
    from .metal_cases_qmatmul import qmatmul_trials  # noqa: PLC0415  (these import this module's helpers)
    from .metal_cases_spec import spec_trials  # noqa: PLC0415
    from .moe.metal_cases import moe_trials  # noqa: PLC0415

    out = (_row_trials() + _conv_trials() + _gdn_trials() + _attn_trials() + qmatmul_trials() + _prefill_trials()
           + moe_trials() + spec_trials())
    out += edge_trials() if edges else []
    return out if not names else [t for t in out if set(t.kernels) & set(names)]
