"""Where each sequence of a packed batch lies: the host-side layout shared by every op."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


_ARRAY_NAMES = ("positions", "write_blocks", "write_offsets", "state_rows", "query_start_loc", "kv_valid",
                "block_tables")


@dataclass
class SeqLayout:
    """Packed batch geometry. Sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of every
    packed [T, ...] activation; kv_valid[i] tokens of it are already cached; its paged KV lives in the
    blocks block_tables[i]; its GDN state in pool row state_rows[i]."""

    query_start_loc: list[int]  # [B+1]
    kv_valid: list[int]  # [B]
    block_tables: list[list[int]]  # [B][n_blocks_i]
    state_rows: list[int]  # [B] rows of the GDN state pools (the sequence slots)
    block_tokens: int = 128
    _arrays: dict = field(default_factory=dict, repr=False)  # array() copies and derived() objects, by name
    _provided: set = field(default_factory=set, repr=False)  # array names given by provide(), not the lists
    # [B] or None: True for a speculative verification (anchor + drafts). The model then keeps the GDN
    # state after each of its tokens (or its inputs, to replay), to commit the state after the last
    # accepted draft (Qwen35Model's verify_commit).
    verify: list[bool] | None = None
    # Set by the compiled decode step (model/compiled.py): an upper bound on kv_valid[i] + q_len(i) that
    # attention plans its split with, so one trace serves every length up to it.
    max_len: int | None = None
    # True inside an `mx.compile` trace: only the arrays and the query_start_loc list are real; ops index
    # by the arrays and take no other value from the lists (a value read there would be baked in).
    traced: bool = False
    # [B] or None: per sequence, the token counts o (0 < o < q_len, ascending) after which the step must also
    # leave the GDN state (the prefix cache's snapshot boundaries inside a prefill chunk; model/gdn_taps.py)
    state_taps: list[list[int]] | None = None

    @classmethod
    def for_trace(cls, query_start_loc: list[int], arrays: dict[str, mx.array], block_tokens: int,
                  verify: list[bool] | None = None, max_len: int | None = None) -> SeqLayout:
        """The layout inside an `mx.compile` trace: the real query_start_loc and device arrays (every name
        `array` serves), dummy lists (traced=True: ops must not read values from them)."""
        B = len(query_start_loc) - 1
        width = arrays["block_tables"].shape[1]
        lay = cls(list(query_start_loc), [0] * B, [[0] * width] * B, [0] * B, block_tokens,
                  verify=verify, max_len=max_len, traced=True)
        for name, a in arrays.items():
            lay.provide(name, a)
        return lay

    def provide(self, name: str, a: mx.array) -> None:
        """Use `a` as the device copy `array(name)` returns (e.g. block tables padded to a chosen width)."""
        if name not in _ARRAY_NAMES:
            raise KeyError(f"{name!r} is not a layout array ({', '.join(_ARRAY_NAMES)})")
        self._arrays[name] = a
        self._provided.add(name)

    def host_values(self, name: str) -> list[int] | None:
        """The host values `array(name)` holds for positions / write_blocks / write_offsets, or None when a
        device array was provided for it (a pipelined step's) or inside a trace."""
        if self.traced or name in self._provided:
            return None
        if name == "positions":
            return list(self.positions())
        if name in ("write_blocks", "write_offsets"):
            return list(self.slot_mapping()[name == "write_offsets"])
        raise KeyError(f"{name!r}: host values are kept for positions, write_blocks and write_offsets")

    def derived(self, key: str, build):
        """An object derived from this layout, built once by build() and shared by every layer that asks."""
        if key in _ARRAY_NAMES:
            raise KeyError(f"{key!r} names a layout array; use array()")
        if key not in self._arrays:
            self._arrays[key] = build()
        return self._arrays[key]

    @property
    def num_seqs(self) -> int:
        return len(self.kv_valid)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def q_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def longest(self) -> int:
        """Context length attention must cover: max over sequences of kv_valid + q_len, or max_len."""
        if self.max_len is not None:
            return self.max_len
        return max(self.kv_valid[i] + self.q_len(i) for i in range(self.num_seqs))

    def positions(self) -> list[int]:
        """Absolute position of every packed token (text-only: its index in its sequence)."""
        out: list[int] = []
        for i in range(self.num_seqs):
            out.extend(range(self.kv_valid[i], self.kv_valid[i] + self.q_len(i)))
        return out

    def slot_mapping(self) -> tuple[list[int], list[int]]:
        """(block id, offset in block) where each new token's K/V is written."""
        blocks, offsets = [], []
        bt = self.block_tokens
        for i in range(self.num_seqs):
            table = self.block_tables[i]
            for p in range(self.kv_valid[i], self.kv_valid[i] + self.q_len(i)):
                blocks.append(table[p // bt])
                offsets.append(p % bt)
        return blocks, offsets

    def array(self, name: str) -> mx.array:
        """Device copies of the layout, built once per batch and shared by every layer."""
        if name not in self._arrays:
            if name == "positions":
                a = mx.array(self.positions(), dtype=mx.int32)
            elif name in ("write_blocks", "write_offsets"):
                b, o = self.slot_mapping()
                self._arrays["write_blocks"] = mx.array(b, dtype=mx.int32)
                self._arrays["write_offsets"] = mx.array(o, dtype=mx.int32)
                return self._arrays[name]
            elif name == "state_rows":
                a = mx.array(self.state_rows, dtype=mx.int32)
            elif name == "query_start_loc":
                a = mx.array(self.query_start_loc, dtype=mx.int32)
            elif name == "kv_valid":
                a = mx.array(self.kv_valid, dtype=mx.int32)
            elif name == "block_tables":
                width = max(1, max((len(t) for t in self.block_tables), default=1))
                padded = [t + [0] * (width - len(t)) for t in self.block_tables]
                a = mx.array(padded, dtype=mx.int32)
            else:
                raise KeyError(name)
            self._arrays[name] = a
        return self._arrays[name]

    def subset(self, seqs: list[int]) -> tuple[SeqLayout, list[int]]:
        """The layout of sequences `seqs` alone (in that order) and the packed rows of this layout they own."""
        qsl, rows = [0], []
        for i in seqs:
            s, e = self.query_start_loc[i], self.query_start_loc[i + 1]
            rows.extend(range(s, e))
            qsl.append(qsl[-1] + e - s)
        sub = SeqLayout(qsl, [self.kv_valid[i] for i in seqs], [self.block_tables[i] for i in seqs],
                        [self.state_rows[i] for i in seqs], self.block_tokens)
        return sub, rows
