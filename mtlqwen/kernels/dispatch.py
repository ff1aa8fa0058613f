"""The one dispatcher every op goes through: its GPU kernel where one runs, else its fallback.

    @kernel_op("rms_norm", kernels.rms_norm_kernel, reference=rms_norm_ref)
    def rms_norm(x, w, eps):        # the body is the fallback: the reference, or other ops composed
        return rms_norm_ref(x, w, eps)

A call runs the kernel when `backend.use_kernels()` says kernels run (a GPU back-end, not forced to the
references) and the op's SELECT row (if it names one) is on. The kernel returns the op's result, or None
for a shape it does not cover; the fallback then runs.

Runtime safety (a kernel never fails a request):
- A kernel that raises when it is built or launched is switched off for the process: one warning names
  the op and the error, and this call and every later one take the fallback.
- The first call of each instantiation (a `PortableKernel` with one set of template values, as
  `portable.LAUNCHES` records them) is evaluated at once, so that a compile or launch error surfaces
  here rather than in the caller's `mx.eval`. Where MTLQWEN_SELF_CHECK is on (default: the back-ends
  without a recorded GPU verification, `UNVERIFIED`), that first output is also compared with the op's
  reference on the same inputs; a mismatch switches the kernel off the same way and the call returns
  the reference's result. The reference runs first, since in-place kernels change their inputs.
- Inside an `mx.compile` trace nothing derived from the inputs can be evaluated: the first-use check
  then runs on a concrete copy of the call (`_probe`: traced arrays replaced by random arrays of their
  shapes, pools cut to the rows the batch uses, a traced layout by a concrete one with empty contexts).

What it does not cover: an instantiation is checked at its first use only, so a launch that fails for a
later grid of an already checked instantiation still surfaces in the caller's `mx.eval`.

Tests put a fake kernel in through `inject` (any back-end, the CPU included).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from . import portable
from .backend import gpu_backend, use_kernels
from .selection import SELECT
from .seqs import SeqLayout

log = logging.getLogger("mtlqwen.kernels")

# Back-ends whose kernels have no recorded verification on a real GPU: the CUDA renderings pass the GPU
# tests on the H200 (benchmarks/kernels_qmatmul_attn.md, kernels_gdn.md); no Apple GPU has run the
# Metal renderings.
UNVERIFIED = ("metal",)
# Largest |kernel - reference| / max|reference| a self-check accepts, by output dtype: kernels and
# references round differently (bf16: one rounding of the output is 2^-8); a wrong mapping is O(1).
CHECK_TOL = {mx.float32: 1e-3, mx.float16: 3e-2, mx.bfloat16: 5e-2}


def self_check(unverified: tuple[str, ...] = ()) -> bool:
    """MTLQWEN_SELF_CHECK=0 / 1 forces it off / on; unset: on for the UNVERIFIED back-ends, and for an op's
    own `unverified` ones (a kernel newer than the back-end's last GPU verification)."""
    env = os.environ.get("MTLQWEN_SELF_CHECK", "")
    if env != "":
        return env not in ("0", "false", "False")
    return gpu_backend() in UNVERIFIED + tuple(unverified)


@dataclass
class Op:
    """One op's dispatch state. `failed` is set once (with the one warning) and never cleared but by
    `reset`; `checked` holds the instantiations that built, launched and (self-check) matched."""

    name: str
    kernel: Callable | None  # (*args) -> the op's result, or None for a shape it does not cover
    fallback: Callable  # what runs without the kernel: the reference or other ops
    reference: Callable | None  # what the self-check compares with; None: only built and launched
    row: str | None = None  # SELECT row that switches the kernel on (any nonzero value)
    pools: tuple[str, ...] = ()  # arguments indexed by the layout's rows (probe copies only those rows)
    unverified: tuple[str, ...] = ()  # back-ends where this op's kernel has not passed its GPU tests yet
    failed: str | None = None
    checked: set = field(default_factory=set)
    signature: inspect.Signature | None = None

    def active_kernel(self) -> Callable | None:
        """The kernel a call would try now, or None (references run, row off, switched off)."""
        if self.failed is not None or (self.row is not None and not SELECT[self.row]):
            return None
        if _INJECTED and self.name in _INJECTED:
            return _INJECTED[self.name]
        return self.kernel if use_kernels() else None

    def __call__(self, *args, **kw):
        kern = self.active_kernel()
        if kern is None:
            return self.fallback(*args, **kw)
        portable.LAUNCHES.append([])
        try:
            out = kern(*args, **kw)
        except Exception as e:  # noqa: BLE001  (any failure to build or launch: the fallback serves)
            self.switch_off(f"failed to build or launch: {type(e).__name__}: {e}")
            return self.fallback(*args, **kw)
        finally:
            launched = portable.LAUNCHES.pop()
        if out is None:
            return self.fallback(*args, **kw)
        # a fake kernel (tests) launches no PortableKernel: the kernel itself is the one instantiation
        launched = launched or [kern]
        if self.checked.issuperset(launched):
            return out
        return self._first_use([k for k in launched if k not in self.checked], kern, out, args, kw)

    def switch_off(self, why: str) -> None:
        self.failed = why
        log.warning("kernel for op %r switched off, its fallback runs from now on: %s", self.name, why)

    def _first_use(self, new: list, kern, out, args, kw):
        if not _concrete(args, kw):  # inside an mx.compile trace: check a concrete copy instead
            covered, why = self._check(kern, *self._probe(args, kw))
            if why is not None:
                self.switch_off(why)
                return self.fallback(*args, **kw)
            if covered:  # else the copy fell outside the kernel's coverage: checked at a later first use
                self.checked.update(new)
            return out
        ref = self._reference(args, kw)
        try:
            mx.eval(_arrays(out))
        except Exception as e:  # noqa: BLE001
            self.switch_off(f"failed to build or launch: {type(e).__name__}: {e}")
            return ref if ref is not None else self.fallback(*args, **kw)
        why = None if ref is None else mismatch(out, ref)
        if why is not None:
            self.switch_off(f"disagrees with its reference at first use ({why})")
            return ref
        self.checked.update(new)
        return out

    def _reference(self, args, kw):
        """The reference's result, evaluated (before the kernel's: in-place kernels change their inputs)."""
        if self.reference is None or not self_check(self.unverified):
            return None
        ref = self.reference(*args, **kw)
        mx.eval(_arrays(ref))
        return ref

    def _check(self, kern, args, kw) -> tuple[bool, str | None]:
        """(whether the kernel covered this concrete call, why it fails on it or None)."""
        ref = self._reference(args, kw)
        try:
            out = kern(*args, **kw)
            if out is None:
                return False, None
            mx.eval(_arrays(out))
        except Exception as e:  # noqa: BLE001
            return True, f"failed to build or launch: {type(e).__name__}: {e}"
        why = None if ref is None else mismatch(out, ref)
        return True, None if why is None else f"disagrees with its reference at first use ({why})"

    def _probe(self, args, kw) -> tuple[tuple, dict]:
        """A concrete stand-in for a traced call (same shapes, dtypes and layout geometry)."""
        sig = self.signature or inspect.signature(self.fallback)
        bound = sig.bind(*args, **kw)
        layout = next((v for v in bound.arguments.values() if isinstance(v, SeqLayout) and v.traced), None)
        if layout is not None:
            # empty contexts; each sequence its own blocks for its tokens, so that a kernel writing the pools in
            # place (the drafter's block rows) writes where the reference reads, not over another sequence's
            # rows; a table row as wide as the traced one (its dummy table's width is the arrays') or as its
            # tokens need, the entries past the tokens repeating its first block (never read: no context)
            lay = layout
            need = [max(1, -(-lay.q_len(i) // lay.block_tokens)) for i in range(lay.num_seqs)]
            first = [sum(need[:i]) for i in range(lay.num_seqs)]
            tables = [list(range(f, f + n)) + [f] * (len(t) - n) for f, n, t in zip(first, need, lay.block_tables)]
            concrete = SeqLayout(list(lay.query_start_loc), [0] * lay.num_seqs, tables, list(range(lay.num_seqs)),
                                 lay.block_tokens, verify=lay.verify, max_len=lay.max_len)
        for name, v in bound.arguments.items():
            if layout is not None and v is layout:
                bound.arguments[name] = concrete
            elif isinstance(v, mx.array) and not _concrete((v,), {}):
                # traced pools cut to the blocks the probe's tables name
                shape = (max(1, sum(need)), *v.shape[1:]) if layout is not None and name in self.pools else v.shape
                bound.arguments[name] = _random_like(shape, v.dtype)
        return bound.args, bound.kwargs


OPS: dict[str, Op] = {}
_INJECTED: dict[str, Callable] = {}


def kernel_op(name: str, kernel: Callable | None, *, reference: Callable | None = None, row: str | None = None,
              pools: tuple[str, ...] = (), unverified: tuple[str, ...] = ()):
    """Decorator: the decorated function is the op's fallback (and its reference unless `reference` is
    given); the returned function dispatches. The op is registered in OPS under `name`. `unverified`: the
    back-ends on which its kernel self-checks at first use although the back-end is verified."""

    def wrap(fallback):
        op = OPS[name] = Op(name, kernel, fallback, reference or fallback, row, pools, unverified=tuple(unverified),
                            signature=inspect.signature(fallback))

        @functools.wraps(fallback)
        def run(*args, **kw):
            return op(*args, **kw)

        run.op = op
        return run

    return wrap


def kernel_for(name: str) -> Callable | None:
    """The kernel op `name` would try now (None: its fallback runs)."""
    return OPS[name].active_kernel()


def reset(name: str | None = None) -> None:
    """Forget switch-offs and first-use checks (of one op, or all): tests, or after changing SELECT."""
    for op in [OPS[name]] if name else OPS.values():
        op.failed = None
        op.checked.clear()


@contextlib.contextmanager
def inject(name: str, kernel: Callable):
    """Run `kernel` as op `name`'s kernel inside the block, on any back-end (tests: a kernel that fails
    to build, or a wrong one); the op's state is reset on entry and exit."""
    if name not in OPS:
        raise KeyError(f"no op {name!r}; ops: {sorted(OPS)}")
    reset(name)
    _INJECTED[name] = kernel
    try:
        yield OPS[name]
    finally:
        del _INJECTED[name]
        reset(name)


def _arrays(out) -> list[mx.array]:
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (tuple, list)):
        return [a for o in out for a in _arrays(o)]
    return []


def _pairs(out, ref):
    """(kernel, reference) arrays, position by position; a None of the kernel's (a state it wrote in
    place) is skipped."""
    if isinstance(out, mx.array):
        yield out, ref
    elif isinstance(out, (tuple, list)):
        for o, r in zip(out, ref):
            yield from _pairs(o, r)


def mismatch(out, ref) -> str | None:
    """Why `out` is not `ref` within CHECK_TOL (shape, dtype, non-finite, error), or None."""
    for i, (o, r) in enumerate(_pairs(out, ref)):
        if not isinstance(r, mx.array) or o.shape != r.shape:
            return f"output {i}: shape {o.shape} against {getattr(r, 'shape', r)}"
        of, rf = o.astype(mx.float32), r.astype(mx.float32)
        if not mx.all(mx.isfinite(of) | ~mx.isfinite(rf)).item():
            return f"output {i}: non-finite values"
        scale = max(mx.max(mx.abs(rf)).item(), 1e-6) if rf.size else 1.0
        err = mx.max(mx.abs(of - rf)).item() / scale if rf.size else 0.0
        if err > CHECK_TOL.get(r.dtype, 1e-3):
            return f"output {i}: relative error {err:.3g}"
    return None


def _concrete(args, kw) -> bool:
    """False inside an mx.compile trace (an input cannot be evaluated there)."""
    try:
        mx.eval([a for a in (*args, *kw.values()) if isinstance(a, mx.array)])
    except ValueError as e:
        if "transformations" not in str(e):
            raise
        return False
    return True


def _random_like(shape, dtype) -> mx.array:
    """Probe values: floats ~N(0, 0.25); uint32 (packed weights) random bits; other integers (indices) 0."""
    if mx.issubdtype(dtype, mx.floating):
        return (0.5 * mx.random.normal(shape)).astype(dtype)
    if dtype == mx.uint32:
        return mx.random.randint(0, 2**31 - 1, shape).astype(mx.uint32)
    return mx.zeros(shape, dtype=dtype)
