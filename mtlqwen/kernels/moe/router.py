"""The MoE router's projection and the routing in one launch (decode sizes).

    logits = x @ Wr^T            [T, E]  (rounded to x's dtype, as `linear_multi` returns it)
    sgl    = x @ Ws^T            [T, 1]  (the shared expert's gate logit, with a shared expert)
    inds, weights = route(logits, k, renorm, sgl)   (moe/kernels.py's routing body, fp32)

Why: the router projection and the routing kernel were two launches per MoE layer, 40 per 35B-A3B step,
and MLX's host time per launch (~13-20 us on the H200's hosts, benchmarks/decode_profile.md) made the
batch-1 step host-bound. Routing needs every logit of a token, so the qmv threadgroups count themselves out
on a per-router counter (as qmatmul/residual.py's epilogue does): the last one to finish reads the logits
back and runs the routing, one SIMD group per token.
"""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..portable import KernelExample, portable_kernel
from ..qmatmul import gemv
from ..qmatmul.bodies import HEADER, XKIND, fma_body
from ..qmatmul.params import LinearParams
from ..qmatmul.residual import arrival_counter
from ..selection import SELECT, qmv_config
from .kernels import ROUTE_BODY, route_limits

# the routing body over the logits this launch wrote (E, t and lane come from the epilogue and the qmv body)
_ROUTE = (ROUTE_BODY.replace("  const int E = logits_shape[1];\n  const int t = TGID_X;\n  const int lane = LANE;\n", "")
          .replace("TO_FLOAT(logits[(size_t)t * E + e])", "TO_FLOAT(LOAD_L2(y0 + (size_t)t * E + e))"))
_GATE = "if (SH) weights[(size_t)t * KS + KT] = 1.0f / (1.0f + EXP(-TO_FLOAT(LOAD_L2(y1 + t))));"

# After the qmv body: y0 (and y1) hold this threadgroup's rows. Writers fence, one thread counts the
# threadgroup in; the last of all the projections' threadgroups routes every token.
EPILOGUE = r"""
  SHARED int rr_last;
  DEVICE_FENCE;
  BARRIER;
  if (TID_X == 0)
    rr_last = (int)(ATOMIC_ADD_U32(cnt, 1u) == (uint32_t)(NBLOCKS - 1));
  BARRIER;
  if (rr_last) {
    DEVICE_FENCE;
    const int E = N0;
    for (int t = warp; t < M; t += 4) {
ROUTE
    }
    if (TID_X == 0) ATOMIC_STORE_U32(cnt, 0u);
  }
"""


def _body(sh: bool) -> str:
    if "logits" in _ROUTE or "SHARED_GATE" not in _ROUTE:
        raise AssertionError("moe/kernels.py's routing body changed: update the replacements above")
    nblocks = "((N0 + RB - 1) / RB + (N1 + RB - 1) / RB)" if sh else "((N0 + RB - 1) / RB)"
    route = _ROUTE.replace("SHARED_GATE", _GATE if sh else "")
    return fma_body(2 if sh else 1, 0) + EPILOGUE.replace("NBLOCKS", nblocks).replace("ROUTE", route)


def _example(dt, bits: int, sh: bool) -> KernelExample:
    """The 35B-A3B router (H 2048, E 256, top-8, g64) at batch 1."""
    E, H, k = 256, 2048, 8
    w = [(mx.uint32, (E, H * bits // 32)), (dt, (E, H // 64)), (dt, (E, H // 64))]
    ws = [(mx.uint32, (1, H * bits // 32)), (dt, (1, H // 64)), (dt, (1, H // 64))]
    ins = [(dt, (1, H))] + w + (ws if sh else []) + [(mx.uint32, (8,))]
    tmpl = [("T", dt), ("XK", XKIND[dt]), ("BITS", bits), ("GS", 64), ("MT", 1), ("R", 4), ("U", 1),
            ("P", 1 + sh), ("EPI", 0), ("PF", 0), ("NP", int(bits == 4)), ("KT", k), ("EPL", E // 32), ("SH", sh),
            ("RN", True)]
    return KernelExample(inputs=ins, outputs=[dt] * (1 + sh) + [mx.int32, mx.float32], template=tmpl)


_KERNELS: dict = {}


def _kernel(sh: bool):
    if sh not in _KERNELS:
        proj = ["w0", "s0", "b0"] + (["w1", "s1", "b1"] if sh else [])
        _KERNELS[sh] = portable_kernel(
            name=f"mtl_moe_router_route_s{int(sh)}", header=HEADER, body=_body(sh),
            input_names=["x"] + proj + ["cnt"], output_names=["y0"] + (["y1"] if sh else []) + ["inds", "weights"],
            examples=[_example(dt, b, sh) for dt in (mx.bfloat16, mx.float32) for b in (4, 8)])
    return _KERNELS[sh]


for _sh in (False, True):  # declared at import so check_metal / check_cuda see them
    _kernel(_sh)


def supported(x: mx.array, router: LinearParams, shared_gate: LinearParams | None, k: int) -> bool:
    """The qmv's shapes (1-8 rows; router and shared gate of one quantization), the routing kernel's
    (E <= 1024, k <= 16), the row on."""
    ps = [router] + ([shared_gate] if shared_gate is not None else [])
    if not (SELECT["moe_route_in_router"] == 1 and SELECT["moe_route_kernel"] == 1 and gpu_backend() is not None
            and x.ndim == 2 and router.quantized and gemv.qmv_supported(x, ps)
            and (shared_gate is None or shared_gate.out_features == 1)):
        return False
    return route_limits(router.out_features, k)


def launch(x: mx.array, router: LinearParams, shared_gate: LinearParams | None, k: int, renorm: bool = True):
    """The launch's outputs: logits [T, E], (shared gate logit [T, 1],) inds [T, k] int32, weights [T, k (+1)]."""
    T, K = x.shape
    E = router.out_features
    sh = shared_gate is not None
    ps = [router] + ([shared_gate] if sh else [])
    R, U = qmv_config(gemv.row_bucket(T), K, router.bits, N=E)
    nblocks = sum(-(-p.out_features // (4 * R)) for p in ps)
    return _kernel(sh)(
        gpu_backend(), inputs=gemv.fma_inputs(x, ps) + [arrival_counter(router)],
        output_shapes=[(T, p.out_features) for p in ps] + [(T, k), (T, k + sh)],
        output_dtypes=[x.dtype] * len(ps) + [mx.int32, mx.float32],
        grid=(nblocks * 128, 1, 1), threadgroup=(128, 1, 1),
        template=gemv.fma_template(x, router, R, U, len(ps), 0, 0)
        + [("KT", k), ("EPL", -(-E // 32)), ("SH", sh), ("RN", bool(renorm))],
        init_value=gemv.POISON)


def router_route(x: mx.array, router: LinearParams, shared_gate: LinearParams | None, k: int, renorm: bool = True):
    """x [T, H] -> (inds [T, k] int32, weights [T, k (+1)] fp32) as moe_route(linear(x, router), ...)."""
    outs = launch(x, router, shared_gate, k, renorm)
    return outs[-2], outs[-1]
