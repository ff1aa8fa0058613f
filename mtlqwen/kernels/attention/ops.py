"""The attention ops: the paged decode-attention kernel (kernels.py), the tensor-core prefill kernel
(prefill.py, CUDA) and the in-place KV write (kv_write.py) where they run, the references otherwise."""

from __future__ import annotations

import mlx.core as mx

from ..backend import gpu_backend
from ..dispatch import OPS, kernel_op
from ..rope.ops import head_norm_rope
from ..rope.reference import RopeTables, head_norm_rope_ref
from ..selection import SELECT
from ..seqs import SeqLayout
from . import drafter, kernels, kv_write, prefill, prep
from .reference import drafter_attention_ref, paged_attention_gated_ref, paged_attention_ref, write_kv

_POOLS = ("k_pool", "v_pool")


def _after(k_pool, v_pool, after):
    """The pools ordered after an in-place KV write (`after`, its token): the kernel takes the token as an
    input; a reference reading the pools needs the same edge (the write was taken before this attention's
    kernel was switched off)."""
    return (k_pool, v_pool) if after is None else tuple(mx.depends([k_pool, v_pool], [after]))


def uses_prefill_kernel(q_shape, q_dtype, k_pool, v_pool, layout: SeqLayout) -> bool:
    """Whether a batch takes the tensor-core prefill kernel: on CUDA, when some sequence has more than
    SELECT["prefill_attn_min_queries"] queries (decode rows alone, and traced layouts, stay on the decode
    kernel; 0: never). The prefill kernel then serves the whole packed batch, its 1-query rows included: a decode row's
    block walks its context once, as long as a prefill block of the same context (no split, no merge)."""
    if gpu_backend() != "cuda" or layout.traced or layout.num_seqs == 0:
        return False
    lim = SELECT["prefill_attn_min_queries"]
    qmax = max(layout.q_len(i) for i in range(layout.num_seqs))
    return (lim > 0 and qmax > lim and kernels.covers(q_shape, q_dtype, k_pool, v_pool, layout)
            and prefill.covers(q_shape, q_dtype, k_pool, v_pool, layout))


def attention_kernel(q, k_pool, v_pool, layout: SeqLayout, scale: float, gate=None, after=None):
    """The GPU attention for a batch: prefill kernel past the crossover, else the decode kernel."""
    if uses_prefill_kernel(q.shape, q.dtype, k_pool, v_pool, layout):
        return prefill.prefill_attention_gpu(q, k_pool, v_pool, layout, scale, gate=gate, after=after)
    return kernels.paged_attention_gpu(q, k_pool, v_pool, layout, scale, gate=gate, after=after)


def _attention_kernel(q, k_pool, v_pool, layout, scale, after=None):
    return attention_kernel(q, k_pool, v_pool, layout, scale, after=after)


def _gated_kernel(q, k_pool, v_pool, layout, scale, gate, after=None):
    return attention_kernel(q, k_pool, v_pool, layout, scale, gate=gate, after=after)


def _attention_ref(q, k_pool, v_pool, layout, scale, after=None):
    return paged_attention_ref(q, *_after(k_pool, v_pool, after), layout, scale)


@kernel_op("paged_attention", _attention_kernel, reference=_attention_ref, pools=_POOLS)
def paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, layout: SeqLayout, scale: float,
                    after: mx.array | None = None) -> mx.array:
    """q [T, nH, hd] -> [T, nH, hd]. `after`: the token of `write_kv_inplace` (given only when it returned one)."""
    return _attention_ref(q, k_pool, v_pool, layout, scale, after)


def _gated_ref(q, k_pool, v_pool, layout, scale, gate, after=None):
    return paged_attention_gated_ref(q, *_after(k_pool, v_pool, after), layout, scale, gate)


@kernel_op("paged_attention_gated", _gated_kernel, reference=_gated_ref, pools=_POOLS)
def paged_attention_gated(q, k_pool, v_pool, layout: SeqLayout, scale: float, gate: mx.array,
                          after: mx.array | None = None) -> mx.array:
    """`paged_attention` with the sigmoid output gate applied inside the kernel (no separate ops)."""
    return _gated_ref(q, k_pool, v_pool, layout, scale, gate, after)


def _inplace_ok(q_shape, q_dtype, k_pool, v_pool, layout) -> bool:
    """An in-place pool write is taken only where the attention that reads the pools next runs its kernel
    (which takes the token) over this shape."""
    attention_on = all(OPS[n].active_kernel() is not None for n in ("paged_attention", "paged_attention_gated"))
    return attention_on and kernels.covers(q_shape, q_dtype, k_pool, v_pool, layout)


def _prep_write_ok(q_shape, q_dtype, k_pool, v_pool, layout) -> bool:
    """prep.py's launch may write the pools where `write_kv_inplace` would run its kernel."""
    return OPS["write_kv_inplace"].active_kernel() is not None and _inplace_ok(q_shape, q_dtype, k_pool, v_pool, layout)


def _write_kv_inplace_kernel(k_pool, v_pool, k, v, layout, q_shape, q_dtype):
    if not _inplace_ok(q_shape, q_dtype, k_pool, v_pool, layout):
        return None
    return kv_write.write_kv_inplace_kernel(k_pool, v_pool, k, v, layout)


# no reference to compare with: the write's result is the pools' contents (tests/test_kernels_attention.py)
@kernel_op("write_kv_inplace", _write_kv_inplace_kernel, row="kv_inplace", pools=_POOLS)
def write_kv_inplace(k_pool: mx.array, v_pool: mx.array, k: mx.array, v: mx.array, layout: SeqLayout, q_shape,
                     q_dtype) -> mx.array | None:
    """On GPU back-ends: write k, v [T, nKV, hd] into the pools' own buffers (no pool copy) and return a
    token that `paged_attention(..., after=token)` takes so it runs after the write. None when that path
    does not apply (CPU, SELECT["kv_inplace"] off, or an attention the kernel does not cover): then use
    `write_kv`."""
    return None


def _prep_kernel(qg, k, v, q_norm, k_norm, eps, positions, tables, head_dim, k_pool, v_pool, layout):
    """One launch where the three it replaces would all run their kernels, the in-place write included."""
    ops_on = all(OPS[n].active_kernel() is not None
                 for n in ("head_norm_rope", "write_kv_inplace", "paged_attention", "paged_attention_gated"))
    q_shape = (qg.shape[0], qg.shape[1], head_dim)
    if not (ops_on and kernels.covers(q_shape, qg.dtype, k_pool, v_pool, layout)
            and prep.covers(qg, k, v, q_norm, k_norm, k_pool, v_pool, tables, head_dim)):
        return None
    return tuple(prep.prep_kv_write(qg, k, v, q_norm, k_norm, eps, positions, tables, head_dim, k_pool, v_pool, layout))


def _prep_check(qg, k, v, q_norm, k_norm, eps, positions, tables, head_dim, k_pool, v_pool, layout):
    """The self-check's reference: q and k as the references compute them, and the token (the write's
    result is the pools' contents: tests/test_kernels_attention_prep.py)."""
    return (head_norm_rope_ref(qg, q_norm, eps, positions, tables, head_dim),
            head_norm_rope_ref(k, k_norm, eps, positions, tables, head_dim), mx.ones((1,), dtype=mx.int32))


# tests/test_kernels_attention_prep.py passed on the H200 (fp32 norm weights beside bf16 activations included)
@kernel_op("attention_prep", _prep_kernel, reference=_prep_check, row="attn_prep_fused", pools=_POOLS)
def attention_prep(qg: mx.array, k: mx.array, v: mx.array, q_norm: mx.array, k_norm: mx.array, eps: float,
                   positions: mx.array, tables: RopeTables, head_dim: int, k_pool: mx.array, v_pool: mx.array,
                   layout: SeqLayout):
    """qg [T, HQ, 2*D] (q | gate per head), k / v [T, HK, D] -> (q [T, HQ, D], k [T, HK, D] normed and
    rotated, the in-place KV write's token or None). With None the caller writes k, v (`write_kv`)."""
    q = head_norm_rope(qg, q_norm, eps, positions, tables, head_dim)  # reads q where it lies in qg
    kn = head_norm_rope(k, k_norm, eps, positions, tables, head_dim)
    return q, kn, write_kv_inplace(k_pool, v_pool, kn, v, layout, q.shape, q.dtype)


def _drafter_forms(layout: SeqLayout, causal: bool, window) -> tuple[SeqLayout, SeqLayout] | None:
    """The drafter blocks' (write, decode rows) layouts (drafter.py), or None where the kernels do not serve:
    sliding-window layers (the decode kernel has no window), and a host layout without blocks for the block's
    rows (the engine allocates them: they are the verify rows; a table that ends at the context would send
    the write into the padding block)."""
    if window is not None:
        return None
    if not layout.traced and any(len(t) * layout.block_tokens < kv + layout.q_len(i)
                                 for i, (t, kv) in enumerate(zip(layout.block_tables, layout.kv_valid))):
        return None
    # the same for every layer of the pass: built once per layout (a graph node costs host time)
    return layout.derived(f"drafter_decode_form_{causal}", lambda: drafter.decode_form(layout, causal))


def _drafter_kernel(q, k_blk, v_blk, k_pool, v_pool, layout, scale, causal=False, window=None):
    """The block written into the pools past kv_valid, then one decode row per query (drafter.py); None
    (the reference) for sliding-window layers or where the write or the decode kernel does not run."""
    forms = _drafter_forms(layout, causal, window)
    if forms is None:
        return None
    write, rows = forms
    token = write_kv_inplace(k_pool, v_pool, k_blk, v_blk, write, q.shape, q.dtype)
    if token is None:
        return None
    return paged_attention(q, k_pool, v_pool, rows, scale, after=token)


# its GPU test passed on the H200 (benchmarks/results/gpu-tests-drafter-attention-packed-candidates.log), and it
# served in the timed speculative engine at 1 and 8 sequences x 8 and 16 rows with its first-use self-checks
# passing (benchmarks/spec.md, "Where a speculative step's time goes")
@kernel_op("drafter_attention", _drafter_kernel, pools=_POOLS)
def drafter_attention(q, k_blk, v_blk, k_pool, v_pool, layout: SeqLayout, scale: float, causal: bool = False,
                      window: int | None = None) -> mx.array:
    """DFlash drafter attention (dflash.md §1.4, §1.5): block queries over the paged context and the block's
    own transient K/V. q [T, nH, hd], k_blk / v_blk [T, nKV, hd] -> [T, nH, hd]. On GPUs the block's rows
    are written into the pools past kv_valid (scratch rows) and read back by the decode kernel."""
    return drafter_attention_ref(q, k_blk, v_blk, k_pool, v_pool, layout, scale, causal, window)


def _rows_of(src: mx.array, off: int, heads: int, head_dim: int) -> mx.array:
    """src [T, W] -> its heads x head_dim values from element `off` of each row: [T, heads, head_dim]."""
    return src[:, off:off + heads * head_dim].reshape(src.shape[0], heads, head_dim)


def _drafter_prep_kernel(q, k_src, k_off, v_src, v_off, q_norm, k_norm, eps, positions, tables, head_dim, k_pool,
                         v_pool, layout, scale, causal=False, window=None):
    """prep.py's launch (q and k norm + RoPE, the block's K/V into the pools) then the decode rows; None where
    `drafter_attention` would not run its kernels on these shapes."""
    forms = None if OPS["drafter_attention"].active_kernel() is None else _drafter_forms(layout, causal, window)
    if forms is None:
        return None
    write, rows = forms
    if not (_prep_write_ok(q.shape, q.dtype, k_pool, v_pool, write)
            and prep.covers(q, k_src, v_src, q_norm, k_norm, k_pool, v_pool, tables, head_dim, k_off, v_off)):
        return None
    qn, _, token = prep.prep_kv_write(q, k_src, v_src, q_norm, k_norm, eps, positions, tables, head_dim, k_pool,
                                      v_pool, write, k_off=k_off, v_off=v_off)
    return paged_attention(qn, k_pool, v_pool, rows, scale, after=token)


# tests/test_kernels_drafter_prep.py's GPU test passed on the H200 (benchmarks/results/gpu-tests-drafter-prep.log)
@kernel_op("drafter_attention_prep", _drafter_prep_kernel, row="drafter_prep", pools=_POOLS)
def drafter_attention_prep(q, k_src, k_off: int, v_src, v_off: int, q_norm, k_norm, eps: float, positions,
                           tables: RopeTables, head_dim: int, k_pool, v_pool, layout: SeqLayout, scale: float,
                           causal: bool = False, window: int | None = None) -> mx.array:
    """A DFlash drafter layer's attention from its raw projections: q [T, nH, hd] before its norm and RoPE,
    the block's k and v as rows [T, W] holding nKV x hd values from element k_off / v_off (the stacked k|v
    projection, read in place) -> [T, nH, hd]. On GPUs one launch norms and rotates q and k and writes the
    block's K/V into the pools, then the decode rows (`drafter_attention`'s form); else the ops it fuses."""
    HK = k_pool.shape[2]
    qn = head_norm_rope(q, q_norm, eps, positions, tables, head_dim)
    k = head_norm_rope(_rows_of(k_src, k_off, HK, head_dim), k_norm, eps, positions, tables, head_dim)
    return drafter_attention(qn, k, _rows_of(v_src, v_off, HK, head_dim), k_pool, v_pool, layout, scale, causal,
                             window)


def _context_write_kernel(k_src, k_off, v_src, v_off, k_norm, eps, positions, tables, head_dim, k_pool, v_pool,
                          layout, q_shape, q_dtype):
    """prep.py's launch without q rows, where `write_kv_inplace` would run its kernel; -> the pools following
    the write."""
    if not (_prep_write_ok(q_shape, q_dtype, k_pool, v_pool, layout)
            and prep.covers(None, k_src, v_src, None, k_norm, k_pool, v_pool, tables, head_dim, k_off, v_off)):
        return None
    _, _, token = prep.prep_kv_write(None, k_src, v_src, None, k_norm, eps, positions, tables, head_dim, k_pool,
                                     v_pool, layout, k_off=k_off, v_off=v_off)
    return tuple(mx.depends([k_pool, v_pool], [token]))


@kernel_op("drafter_context_write", _context_write_kernel, row="drafter_prep", pools=_POOLS)
def drafter_context_write(k_src, k_off: int, v_src, v_off: int, k_norm, eps: float, positions, tables: RopeTables,
                          head_dim: int, k_pool, v_pool, layout: SeqLayout, q_shape, q_dtype) -> tuple[mx.array, mx.array]:
    """A DFlash drafter layer's context K/V from its raw projection rows (as `drafter_attention_prep`'s k / v),
    k normed and rotated, written at the layout's write slots -> (k_pool, v_pool) after the write. On GPUs one
    launch into the pools' own buffers; else k's norm + RoPE, then `write_kv_inplace` or the functional write.
    q_shape / q_dtype: what the drafter's attention reads the pools with."""
    HK = k_pool.shape[2]
    k = head_norm_rope(_rows_of(k_src, k_off, HK, head_dim), k_norm, eps, positions, tables, head_dim)
    v = _rows_of(v_src, v_off, HK, head_dim)
    written = write_kv_inplace(k_pool, v_pool, k, v, layout, q_shape, q_dtype)
    return write_kv(k_pool, v_pool, k, v, layout) if written is None else tuple(mx.depends([k_pool, v_pool], [written]))
