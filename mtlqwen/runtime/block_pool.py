"""The KV block pool: ids of bundles, each one block of every full-attention layer's K and V pool.

Pure Python. A bundle is allocated and freed as a unit; ref counts let later features (the prefix
cache) share a bundle between sequences. Free ids wait in a FIFO queue: allocation takes from the
front, a freed id goes to the back, so the most recently freed blocks are reused last (what a prefix
cache wants: recently used content survives longest).
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    """allocate() asked for more bundles than are free; the scheduler preempts instead of raising."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def free_ids(self) -> list[int]:
        """The free queue, front (next allocated) first."""
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh bundles (ref count 1) from the front of the free queue."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """One more owner for each bundle (a prefix-cache hit shares blocks instead of copying them)."""
        for b in ids:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is free; only allocated blocks can be shared")
            self.ref_counts[b] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each bundle, in reverse order (a table's tail is least worth keeping);
        bundles reaching zero go to the back of the free queue."""
        for b in reversed(ids):
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    @staticmethod
    def blocks_for(num_tokens: int, block_tokens: int) -> int:
        """Bundles a table needs to hold num_tokens tokens."""
        return -(-num_tokens // block_tokens)
