"""The DFlash drafter's attention on the GPU kernels: its block written into the pools, then decode rows.

A drafter block (dflash.md §1.4) is B queries at positions P..P+B-1 that see the committed context 0..P-1
and every key of the block (non-causal; a causal layer: the block's keys up to the query's own). The
reference (`drafter_attention_ref`) builds that per sequence from gathers, concatenations and masks: some
25 graph nodes a sequence and layer, which the host pays every speculative step (benchmarks/spec.md).

Here the same attention is two launches whatever the batch:
  1. the block's K/V are written into the drafter's pools at their own positions (`write_kv_inplace`).
     Those rows lie past kv_valid, where the runtime keeps nothing (speculative.py: a drafter-context
     row is exact only below kv_valid, and the step that commits a position writes it first);
  2. each block query runs as a one-query decode row of `paged_attention` whose kv_valid is the last key
     it may see (P + B - 1, or P + j for a causal layer): its own sequence's block table, context and
     block keys read from the pools alike.
Sliding-window layers keep the reference (the decode kernel has no window).
"""

from __future__ import annotations

import mlx.core as mx

from ..seqs import SeqLayout


def decode_form(layout: SeqLayout, causal: bool) -> tuple[SeqLayout, SeqLayout]:
    """(the layout that writes the blocks' rows at their positions, the layout of one decode row per block
    query) for the drafter blocks of `layout` (query_start_loc real; positions, kv_valid and block tables
    read as arrays, so a traced layout serves too). T = layout.num_tokens."""
    qsl, bt = layout.query_start_loc, layout.block_tokens
    lens = [qsl[i + 1] - qsl[i] for i in range(layout.num_seqs)]
    seg = mx.array([i for i, n in enumerate(lens) for _ in range(n)], dtype=mx.int32)  # [T] row -> sequence
    # the last key each row sees, less kv_valid: its own offset (causal) or its block's last row
    reach = mx.array([t if causal else n - 1 for n in lens for t in range(n)], dtype=mx.int32)  # [T]
    tables, kv = layout.array("block_tables"), layout.array("kv_valid")  # [S, W], [S]
    pos = layout.array("positions")  # [T]: kv_valid + offset
    write = SeqLayout.for_trace(list(qsl), {"positions": pos, "write_blocks": tables[seg, pos // bt],
                                            "write_offsets": pos % bt, "block_tables": tables, "kv_valid": kv}, bt)
    last = kv[seg] + reach  # [T]
    T = sum(lens)
    rows = SeqLayout.for_trace(list(range(T + 1)), {"kv_valid": last, "positions": last, "block_tables": tables[seg]},
                               bt, max_len=tables.shape[1] * bt)
    return write, rows
