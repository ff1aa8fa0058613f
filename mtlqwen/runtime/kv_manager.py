"""The one owner of KV memory and prefix state: block pool, prefix cache, the snapshot boundary rule.

block_pool.py is its primitive (ids and ref counts) and prefix_cache.py its store (keys, entries,
snapshots); the rules that tie them to sequences live here and nowhere else:
  - a sequence's block table, `kv_valid` and pending restore are written only here: `admit` starts
    kv_valid at 0 or past a prefix hit, `allocate` gives the bundles a step's tokens need, `advance`
    is the one place kv_valid grows, `free` drops every reference;
  - the boundary rule: a snapshot is taken where the computed length is a multiple of the interval
    (`on_boundary`); prefill chunks end on the next one (`chunk_tokens`) and a verification stops short
    of it (`max_drafts`), since a verification's state is only known at read-back;
  - what the pool can give without preempting: free bundles plus those only unpinned entries hold
    (`available`, `reserve`), and what a sequence may still ask for (`blocks_to_finish`);
  - one snapshot hook per engine step (`step_snapshots`): zero or restore fresh slots before the
    forward, capture boundary states after it and publish them, at once where their tokens are on the
    host (prefill), else when the step's tokens are read back (a decode anchor in flight);
  - one hook when a request finishes (`finish`): a turn entry for its exact computed tokens, taken
    from its slot before the slot is released;
  - what a waiting request would restore (`hit_length`) and which prefix it shares with a running
    one (`shared_boundary`), for the scheduler's shared in-flight prefixes;
  - entries that leave or arrive as rows and states (`export`, `adopt`: prompt_file.py's files, a
    prompt-logprob pass), written into bundles of their own or sharing those of the entry they extend.

The scheduler decides who runs and how many tokens; it asks here how many bundles that takes, whether
they exist, and to allocate or free them (the seam of vLLM v1's scheduler and KV-cache manager).
"""

from __future__ import annotations

import mlx.core as mx

from .block_pool import BlockPool
from .prefix_cache import DEFAULT_CACHE_BYTES, Capture, Prefix, PrefixCache, bundle_pools, empty_stats


# finish reasons whose sequence's slot holds a state worth keeping (not a cancelled or failed request)
TURN_REASONS = ("stop", "stop_string", "length")


class KVManager:
    """num_blocks bundles of block_tokens tokens; prefix_interval > 0 turns the prefix cache on, with
    prefix_cache_bytes for its snapshots, identity for its root key and entry_bytes the size of one."""

    def __init__(self, num_blocks: int, block_tokens: int, prefix_interval: int = 0,
                 prefix_cache_bytes: int = DEFAULT_CACHE_BYTES, identity: str = "", entry_bytes: int = 0,
                 in_step: bool = False):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        # in_step: prefill chunks run across snapshot boundaries, the states there taken inside the step
        # (model/gdn_taps.py); else each chunk stops at the next boundary
        self.in_step = bool(in_step) and prefix_interval > 0
        self.pool = BlockPool(num_blocks)
        self.block_tokens = block_tokens
        self.prefix = (PrefixCache(self.pool, prefix_interval, block_tokens, prefix_cache_bytes, identity, entry_bytes)
                       if prefix_interval else None)

    @property
    def interval(self) -> int:
        """Tokens between snapshots; 0 when the prefix cache is off (stored once, in the cache's keys)."""
        return self.prefix.interval if self.prefix is not None else 0

    # ---- the boundary rule
    def to_boundary(self, pos: int) -> int | None:
        """Tokens from position pos to the next snapshot boundary after it; None without a cache."""
        i = self.interval
        return i - pos % i if i else None

    def on_boundary(self, length: int) -> bool:
        """A computed length whose GDN state is snapshotted."""
        return self.interval > 0 and length > 0 and length % self.interval == 0

    def chunk_tokens(self, seq, n: int, cross: bool = True) -> int:
        """A prefill chunk of n tokens, cut at the next boundary so the state there is captured, unless the
        boundaries' states are taken inside the step (in_step, and `cross`: a step without verifications)."""
        return self.chunk_tokens_at(seq.kv_valid, n, cross)

    def chunk_tokens_at(self, pos: int, n: int, cross: bool = True) -> int:
        b = self.to_boundary(pos)
        return n if b is None or (self.in_step and cross) else min(n, b)

    def boundaries_in(self, start: int, end: int) -> list[int]:
        """Snapshot boundaries b with start < b < end: the states a chunk over [start, end) leaves inside."""
        i = self.interval
        return list(range((start // i + 1) * i, end, i)) if i else []

    def max_drafts(self, seq, n: int) -> int:
        """Drafts (at most n) a decoding sequence may verify: anchor + drafts stay short of the next
        boundary, which a plain step then reaches (its state is captured at launch)."""
        return self.max_drafts_at(seq.kv_valid, n)

    def max_drafts_at(self, pos: int, n: int) -> int:
        """max_drafts of a sequence whose anchor is at position pos (a pipelined step's worst case)."""
        b = self.to_boundary(pos)
        return n if b is None else max(0, min(n, b - 2))

    # ---- sequences
    def advance(self, seq, n: int) -> None:
        """kv_valid covers n more tokens: scheduled by a launched step, restored, or accepted drafts."""
        seq.kv_valid += n

    def admit(self, seq) -> None:
        """seq takes a slot: nothing computed, or the longest prefix hit mapped in (its whole bundles
        shared, a fresh one for a partial last block, the restore pinned until launched)."""
        seq.kv_valid, seq.block_table, seq.cached_tokens = 0, [], 0
        if self.prefix is None:
            return
        e = self.prefix.find_hit(seq)
        if e is None:
            return
        own = []
        if e.tail is not None:  # copy on write: the partial block is rewritten into a block of seq's own
            if not self.reserve(1):
                self.prefix.unpin(e)
                return
            own = self.pool.allocate(1)
        self.pool.share(e.blocks)
        seq.block_table, seq.restore = e.blocks + own, e
        seq.cached_tokens = min(e.length, seq.prompt_len)
        self.advance(seq, e.length)
        self.prefix.count_hit(e)

    def free(self, seq) -> None:
        """seq leaves its slot (finished, cancelled or preempted): a pending restore is unpinned, every
        bundle reference dropped, and kv_valid is back to 0 (GDN state cannot be rolled back)."""
        self._unpin(seq)
        self.pool.free(seq.block_table)
        seq.block_table, seq.kv_valid = [], 0

    def finish(self, seq, reason: str, cache) -> None:
        """seq finished (call before it is released): keep a turn entry for the tokens its slot's state
        is exactly after, kv_valid of them (the last sampled token never ran through the model; one
        sampled on EOS may have, in the step launched before its read-back). Skipped when a verification
        ran past a stop (its state covers tokens the request dropped), or while a pipelined verification
        computes its state past kv_valid (Sequence.state_ahead)."""
        if self.prefix is None or reason not in TURN_REASONS or not seq.active or seq.restore is not None \
                or seq.state_ahead:
            return
        if 0 < seq.kv_valid <= len(seq.tokens):
            self.prefix.keep_turn(seq, seq.kv_valid, cache)

    # ---- shared in-flight prefixes (the scheduler's waits)
    def hit_length(self, seq) -> int:
        """Tokens seq would restore if admitted now (not counted as a lookup)."""
        e = self.prefix.lookup(seq) if self.prefix is not None else None
        return e.length if e is not None else 0

    def shared_boundary(self, seq, other) -> int:
        """The longest boundary up to which seq's tokens equal other's (known) tokens, leaving seq one
        token to run; 0 without a cache. By chained keys: a collision only costs a useless wait (the
        restore compares tokens)."""
        if self.prefix is None:
            return 0
        kmax = min(seq.num_tokens - 1, len(other.tokens)) // self.interval
        mine, theirs = self.prefix.keys(seq, kmax), self.prefix.keys(other, kmax)
        k = 0
        while k < kmax and mine[k] == theirs[k]:
            k += 1
        return k * self.interval

    def _unpin(self, seq) -> None:
        if seq.restore is not None:
            self.prefix.unpin(seq.restore)
            seq.restore = None

    # ---- blocks
    def new_blocks(self, seq, n: int) -> int:
        """Bundles seq's table lacks to hold n more tokens past kv_valid."""
        return max(0, BlockPool.blocks_for(seq.kv_valid + n, self.block_tokens) - len(seq.block_table))

    def blocks_to_finish(self, seq) -> int:
        """Bundles seq may still add before max_tokens (the last sampled token needs no KV; drafts never
        run past max_tokens)."""
        total = BlockPool.blocks_for(seq.prompt_len + seq.params.max_tokens - 1, self.block_tokens)
        return max(0, total - len(seq.block_table))

    def available(self) -> int:
        """Bundles the pool can give without preempting: free ones, plus those only unpinned entries hold."""
        return self.pool.num_free + (self.prefix.reclaimable() if self.prefix is not None else 0)

    def reserve(self, n: int) -> bool:
        """Make n bundles free, evicting least recently used entries if needed; False if they can't be."""
        return self.pool.num_free >= n or (self.prefix is not None and self.prefix.evict_for_blocks(n))

    def allocate(self, seq, n: int) -> None:
        """Extend seq's table to hold n more tokens (reserve() first)."""
        seq.block_table.extend(self.pool.allocate(self.new_blocks(seq, n)))
        # shared (prefix-cache) bundles are whole blocks below kv_valid: a step never writes one
        assert all(self.pool.ref_counts[b] == 1 for b in seq.block_table[seq.kv_valid // self.block_tokens :])

    # ---- the engine's hook
    def step_snapshots(self, scheduled, reset_slots: list[int], cache) -> StepSnapshots:
        """Call before the step's forward is built: zeroes the GDN state of reset_slots (fresh sequences,
        the padding slot) and copies each hit's snapshot over it, lazily in the step's graph. The returned
        object captures after the forward and publishes at read-back."""
        restoring = [s.seq for s in scheduled if s.fresh and s.seq.restore is not None] \
            if self.prefix is not None else []
        if restoring:  # the zeroing rides in the restores' scatters
            self.prefix.restore(restoring, cache, reset_slots)
            for seq in restoring:
                self._unpin(seq)
        elif reset_slots:
            rows = mx.array(reset_slots, dtype=mx.int32)
            for p in (*cache.conv_states, *cache.rec_states):
                p[rows] = 0
        return StepSnapshots(self, scheduled, cache)

    # ---- saved prompts (runtime/prompt_file.py)
    def export(self, tokens: list[int], cache, salt: str | None = None) -> tuple[list[mx.array], list[mx.array]] | None:
        """The entry for exactly these tokens (under that cache_salt) as (per bundle pool its K/V rows of positions
        0..L-1 [L, ...], per GDN pool the state after them [...]); None when the prefix cache holds none (or is off)."""
        e = self.prefix.exact(tokens, salt) if self.prefix is not None else None
        if e is None:
            return None
        bt, nb = self.block_tokens, len(e.blocks)
        ids = mx.array(e.blocks, dtype=mx.int32)
        rows = []
        for i, pool in enumerate(bundle_pools(cache)):  # pool [blocks, bt, ...]
            parts = [pool[ids].reshape(nb * bt, *pool.shape[2:])] if nb else []
            if e.tail is not None:  # the partial last block's copy, [1, bt, ...]
                parts.append(e.tail[i][0, : e.length - nb * bt])
            rows.append(mx.concatenate(parts) if len(parts) > 1 else parts[0])
        return rows, [s[0] for s in e.state]

    def adopt(self, tokens: list[int], rows: list[mx.array], state: list[mx.array], cache, salt: str | None = None):
        """A prefix entry for exactly `tokens` (under that cache_salt) from rows and states in export's form. The
        whole blocks of the longest entry it extends are shared (a conversation's turns, loaded one after another,
        hold their common K/V once); the other whole blocks are written into fresh bundles (evicting LRU entries
        for room), the rest kept as the entry's partial block. Returns the entry, or None when that prefix is
        cached already or the entry does not fit the budget."""
        if self.prefix is None:
            raise ValueError("the prefix cache is off (prefix_interval=0): a saved prompt has nowhere to go")
        if self.prefix.exact(tokens, salt) is not None:
            return None
        bt = self.block_tokens
        nb, rest = divmod(len(tokens), bt)
        base = self.prefix.lookup(Prefix(tokens, salt))
        shared = base.blocks[:nb] if base is not None else []
        self.pool.share(shared)  # held before eviction can free them
        fresh_n = nb - len(shared)
        if not self.prefix.evict_for_blocks(fresh_n):
            why = (f"the KV pool cannot hold the saved prompt: it needs {fresh_n} free blocks of {bt} tokens"
                   f"{f' beside the {len(shared)} it shares' if shared else ''}, {self.pool.num_free} of "
                   f"{self.pool.num_blocks} are free")
            self.pool.free(shared)
            raise ValueError(why)
        fresh = self.pool.allocate(fresh_n)
        ids = mx.array(fresh, dtype=mx.int32)
        lo = len(shared) * bt  # rows below lo are in the shared blocks already
        tail = [] if rest else None
        for pool, x in zip(bundle_pools(cache), rows):  # x [L, ...]
            if fresh_n:
                pool[ids] = x[lo: nb * bt].reshape(fresh_n, bt, *x.shape[1:])
                mx.eval(pool)  # one pool at a time: the scatter updates it in place, no second pool alive
            if rest:
                t = mx.zeros((1, bt, *x.shape[1:]), dtype=x.dtype)
                t[0, :rest] = x[nb * bt:]
                tail.append(t)
        state = [s[None] for s in state]
        mx.eval(state, tail or [])
        return self.prefix.adopt(list(tokens), shared + fresh, state, tail, salt)

    # ---- reporting
    def stats(self) -> dict:
        return self.prefix.stats() if self.prefix is not None else empty_stats()

    def clear(self) -> int:
        """Drop every prefix entry no pending restore pins; returns how many."""
        return self.prefix.clear() if self.prefix is not None else 0


class StepSnapshots:
    """One step's prefix snapshots: `capture()` once the forward is built (states of sequences whose
    computed length lands on a boundary) publishes those whose tokens are all on the host (every prefill
    boundary), `publish()` the rest when the step's tokens are read back (a decoding sequence's anchor in
    flight is only known then), `discard()` if the step failed (published entries withdrawn too)."""

    def __init__(self, kv: KVManager, scheduled, cache):
        self.kv, self.scheduled, self.cache = kv, scheduled, cache
        self.captures: list[Capture] = []  # captured, published at read-back
        self.published: list = []  # PrefixEntry objects this step published at launch

    def capture(self) -> None:
        """Take the snapshots and launch their evaluation: call after the step's own async_eval, so it
        runs after the in-place KV writes (a pending read of a pool would make the next write copy it)."""
        prefix = self.kv.prefix
        if prefix is None:
            return
        taps = getattr(self.cache, "gdn_taps", None)  # a ModelCache's; test stand-ins may have none
        if taps:
            self.cache.gdn_taps = {}
        for s in self.scheduled:
            end = s.start + s.num_tokens
            for b in self.kv.boundaries_in(s.start, end) if taps else ():  # states the step left inside
                state = taps.get((s.seq.slot, b))
                if state is not None:
                    c = prefix.capture(s.seq, b, self.cache, _tap_state(state, len(self.cache.conv_states)))
                    if c is not None:
                        self.captures.append(c)
            if self.kv.on_boundary(end):
                c = prefix.capture(s.seq, end, self.cache)
                if c is not None:
                    self.captures.append(c)
        if not self.captures:
            return
        mx.async_eval(*(a for c in self.captures for a in c.arrays()))
        # A request held for this prefix (or arriving now) restores it in the next step instead of one step
        # after this one's read-back: its restore reads the copies after this step on the stream. A prefill
        # boundary's tokens are all known; a decode anchor still in flight is not, so that capture waits.
        known, self.captures = _split(self.captures, lambda c: len(c.seq.tokens) >= c.length)
        if known:
            self.published = prefix.publish(known)

    def publish(self) -> None:
        if self.captures:
            self.kv.prefix.publish(self.captures)
            self.captures = []

    def discard(self) -> None:
        """The step failed: its snapshots are dropped with their bundle references, and the entries it
        published at launch are withdrawn (their states were never computed)."""
        for c in self.captures:
            self.kv.pool.free(c.blocks)
        self.captures = []
        if self.published:
            self.kv.prefix.withdraw(self.published)
            self.published = []


def _split(items: list, keep) -> tuple[list, list]:
    """(the items keep() accepts, the rest), each in order."""
    yes = [x for x in items if keep(x)]
    return yes, [x for x in items if not keep(x)]


def _tap_state(tap: dict, n_gdn: int) -> list[mx.array]:
    """A tap's states in the order of the slot rows a snapshot takes: every GDN layer's conv, then its rec."""
    if sorted(tap["conv"]) != list(range(n_gdn)) or sorted(tap["rec"]) != list(range(n_gdn)):
        raise RuntimeError(f"a state tap holds conv layers {sorted(tap['conv'])} and rec layers "
                           f"{sorted(tap['rec'])} of {n_gdn}: a snapshot needs every GDN layer's")
    return [tap["conv"][i] for i in range(n_gdn)] + [tap["rec"][i] for i in range(n_gdn)]
