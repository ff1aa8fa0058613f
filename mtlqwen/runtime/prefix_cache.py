"""The prefix cache (design.md, "prefix cache"): GDN state snapshots + shared KV bundles every `interval` tokens.

A sequence whose computed length lands on a multiple of the interval publishes an entry for that
prefix: the conv + recurrent state of every GDN layer right after it (copies gathered from its slot),
and the KV bundles holding it (ref counted, read-only from then on). A new request restores the
longest entry shorter than itself: the state is copied into its slot, the bundles go into its block
table, and it starts at kv_valid = the entry's length. GDN state cannot be trimmed, so a hit is only
possible at an exact snapshot; prefill chunks are cut on interval boundaries to take them. The store
only: kv_manager.KVManager decides when to look up, restore, capture and evict, and writes the sequence.

Keys are chained: key(k) = xxh3_64(key(k-1) as 8 bytes LE ‖ tokens of interval k as int32 LE), with
key(0) = xxh3_64(model identity), so entries never cross models or drafters; a request's cache_salt
(SamplingParams) is chained in first, key(0) = xxh3_64(that ‖ "salt:" ‖ the salt), so requests share
entries, turn entries and in-flight prefixes only with requests of the same salt (vLLM's per-tenant
isolation: no one learns from a hit's timing what another tenant sent). A lookup compares the
stored prefix tokens too: a hash collision is a miss, never a wrong answer.

When the interval is not a multiple of block_tokens, the last block of a prefix is partial and its
owner keeps writing it; instead of sharing it, the entry keeps a copy of that block's K/V (copy on
write), and a hit writes the copy into a fresh block of its own. Only whole blocks are ever shared.

Two kinds of entry share one store, one budget and one LRU order:
  - interval entries, at every multiple of the interval (captured at launch; published then when the
    prefix's tokens are on the host, else at read-back);
  - turn entries, at the exact computed length of a finished sequence (prompt + the generated tokens
    that ran through the model), kept when it leaves its slot so the next turn of a conversation, whose
    prompt extends it, restores right there. A turn entry of length L sits in the bucket of its longest
    whole-interval prefix, key(L // interval) (the root for L < interval), under the key
    xxh3_64(bucket as 8 bytes LE ‖ the remaining L % interval tokens); a length on a boundary is an
    interval entry. A lookup walks the buckets from the longest prefix down and takes the longest entry
    whose tokens match, so a chat template that re-renders an earlier turn differently just hits shorter.

Eviction is LRU with a second chance for entries that were hit (CLOCK): a victim that was hit since it
last came up is spared once, moved to the most recent end, and loses the mark.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import xxhash

from .block_pool import BlockPool

DEFAULT_CACHE_BYTES = 1 << 30  # ~20 snapshots of the 9B shape (49 MiB of GDN state each)


def model_identity(model, drafter=None) -> str:
    """What makes two engines' entries interchangeable: config, weights' source, dtype, drafter."""
    return f"{model.config!r}|source={getattr(model, 'source', None)}|dtype={model.dtype}|drafter={drafter!r}"


def root_key(identity: str) -> int:
    return xxhash.xxh3_64_intdigest(identity.encode())


def chunk_key(parent: int, tokens) -> int:
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + token_bytes(tokens))


def token_bytes(tokens) -> bytes:
    """Token ids as int32 little-endian bytes (ids are checked to lie in [0, vocab) at admission). struct packs a
    list twice as fast as numpy converts it: a warm hit compares a 2,048-token prefix several times a step."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def prefix_keys(root: int, tokens, interval: int) -> list[int]:
    """Keys of every whole-interval prefix of tokens (key of prefix k at index k - 1)."""
    keys, key = [], root
    for j in range(len(tokens) // interval):
        key = chunk_key(key, tokens[j * interval : (j + 1) * interval])
        keys.append(key)
    return keys


@dataclass(eq=False)
class PrefixEntry:
    key: int
    length: int  # tokens in the prefix
    tokens: bytes  # the prefix (int32 LE), compared on every hit
    blocks: list[int]  # whole KV bundles of the prefix, one reference held by the entry
    state: list[mx.array]  # per GDN layer conv states then recurrent states, each [1, ...]
    tail: list[mx.array] | None  # K/V of the partial last block per attention pool [1, bt, nKV, hd]
    nbytes: int
    pins: int = 0  # sequences admitted with this entry whose restore is not launched yet
    bucket: int | None = None  # a turn entry's bucket key (see the module doc); None for an interval entry
    hits: int = 0
    spare: bool = False  # hit since it last came up for eviction: spared once (second chance)
    salt: str | None = None  # the cache_salt its key chains in (saved with it: prompt_file.py)

    @property
    def kind(self) -> str:
        return "interval" if self.bucket is None else "turn"


@dataclass(eq=False)
class Capture:
    """A snapshot taken when a step is launched; published then if its tokens are on the host (a prefill
    boundary), else when the step's tokens are read back (a decoding sequence's anchor in flight)."""

    seq: object
    length: int
    blocks: list[int]  # references taken at capture
    state: list[mx.array]
    tail: list[mx.array] | None

    def arrays(self) -> list[mx.array]:
        return self.state + (self.tail or [])


class Prefix:
    """What keys, lookups and inserts read of a sequence, for a bare token list and its cache_salt."""

    def __init__(self, tokens: list[int], salt: str | None = None):
        self.tokens, self.params, self.prefix_keys = list(tokens), SimpleNamespace(cache_salt=salt), []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def _group(seqs: list, row) -> list[tuple[PrefixEntry, mx.array]]:
    """The restored entries in first-seen order, each with the pool rows (int32) of the seqs restoring it."""
    groups: dict[int, tuple[PrefixEntry, list[int]]] = {}
    for seq in seqs:
        groups.setdefault(id(seq.restore), (seq.restore, []))[1].append(row(seq))
    return [(e, mx.array(rows, dtype=mx.int32)) for e, rows in groups.values()]


def _spread(part: mx.array, rows: mx.array) -> mx.array:
    """An entry's [1, ...] array as the update of len(rows) rows: a broadcast (stride 0), which a scatter reads
    without a copy."""
    n = rows.shape[0]
    return part if n == 1 else mx.broadcast_to(part, (n, *part.shape[1:]))


def state_pools(cache) -> list[mx.array]:
    """Every pool a slot row indexes: per GDN layer the conv states, then the recurrent states."""
    return [*cache.conv_states, *cache.rec_states]


def bundle_pools(cache) -> list[mx.array]:
    # every pool a bundle id indexes: the target's K/V, and the drafter's (speculative.py sets cache.drafter_cache)
    d = getattr(cache, "drafter_cache", None)
    return [*cache.k_pools, *cache.v_pools, *(d.arrays() if d is not None else ())]


class PrefixCache:
    """Entries in LRU order (least recent first). budget_bytes bounds the snapshots (state + tail copies);
    entry_bytes is the size of one, to reject a budget that could hold none."""

    def __init__(self, pool: BlockPool, interval: int, block_tokens: int, budget_bytes: int, identity: str, entry_bytes: int = 0):
        if interval < 1:
            raise ValueError(f"prefix_interval must be >= 1 (0 turns the cache off), got {interval}")
        if budget_bytes < entry_bytes:
            raise ValueError(
                f"prefix_cache_bytes={budget_bytes} is less than one snapshot ({entry_bytes} bytes); "
                "raise it or turn the cache off with prefix_interval=0"
            )
        self.pool, self.interval, self.block_tokens = pool, interval, block_tokens
        self.budget, self.root = budget_bytes, root_key(identity)
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # both kinds
        self.turns: dict[int, list[int]] = {}  # bucket key -> keys of its turn entries
        self.nbytes = 0
        self.counters = dict.fromkeys(COUNTERS, 0)

    # ---- keys and lookup
    def root_of(self, seq) -> int:
        """key(0) of seq's prefixes: the model's, or its salt's chained onto it."""
        salt = seq.params.cache_salt
        return self.root if salt is None else xxhash.xxh3_64_intdigest(
            self.root.to_bytes(8, "little") + b"salt:" + salt.encode("utf-8", "surrogatepass"))

    def keys(self, seq, k: int) -> list[int]:
        """Keys of seq's first k prefixes, memoised on the sequence (whole intervals never change)."""
        ks, I = seq.prefix_keys, self.interval
        while len(ks) < k:
            j = len(ks)
            ks.append(chunk_key(ks[-1] if ks else self.root_of(seq), seq.tokens[j * I : (j + 1) * I]))
        return ks[:k]

    def _find(self, seq, k: int) -> PrefixEntry | None:
        e = self.entries.get(self.keys(seq, k)[-1])
        if e is None or e.tokens != token_bytes(seq.tokens[: k * self.interval]):
            return None  # absent, or a different prefix under the same key
        return e

    def _bucket(self, seq, k: int) -> int:
        """The bucket of turn entries between k and k + 1 intervals of seq's tokens."""
        return self.keys(seq, k)[-1] if k else self.root_of(seq)

    def lookup(self, seq) -> PrefixEntry | None:
        """The longest entry (either kind) for a proper prefix of seq's tokens: at least one token is
        left to run. Buckets from the longest whole-interval prefix down: a turn entry of bucket k is
        longer than the interval entry k, which is longer than anything of bucket k - 1."""
        limit = seq.num_tokens - 1
        for k in range(limit // self.interval, -1, -1):
            turns = [self.entries[key] for key in self.turns.get(self._bucket(seq, k), ())]
            for e in sorted((e for e in turns if e.length <= limit), key=lambda e: -e.length):
                if e.tokens == token_bytes(seq.tokens[: e.length]):
                    return e
            e = self._find(seq, k) if k else None
            if e is not None:
                return e
        return None

    # ---- hits (KVManager.admit) and restores (KVManager.step_snapshots)
    def find_hit(self, seq) -> PrefixEntry | None:
        """Count a lookup for seq and return its longest hit, pinned against eviction until unpin()."""
        c = self.counters
        c["prefix_lookups"] += 1
        c["prefix_query_tokens"] += seq.num_tokens
        e = self.lookup(seq)
        if e is not None:
            e.pins += 1
        return e

    def count_hit(self, e: PrefixEntry) -> None:
        self.entries.move_to_end(e.key)
        e.hits, e.spare = e.hits + 1, True
        self.counters["prefix_hits"] += 1
        self.counters["prefix_hit_tokens"] += e.length
        if e.bucket is not None:
            self.counters["prefix_turn_hits"] += 1

    @staticmethod
    def unpin(e: PrefixEntry) -> None:
        """Its restore is launched, or the sequence left before it was."""
        e.pins -= 1

    def restore(self, seqs: list, cache, zero_slots: list[int] = ()) -> None:
        """Zero the GDN state of zero_slots and copy each seq's hit (seq.restore) into its slot, and its
        partial block into seq's own block, lazily in the step's graph: per pool, one scatter for the zeroed
        rows and one for each entry restored, reading the entry's [1, ...] state broadcast over its rows. Each
        op costs the host ~20-40 us on CUDA: a concatenation of the parts launched a copy per part, so 8
        restores of one 9B entry were 48 scatters + 384 copies, now 48 scatters (benchmarks/prefix_cache.md).
        The entries' arrays are only read."""
        mine = {seq.slot for seq in seqs}
        zero = [r for r in zero_slots if r not in mine]  # a restored slot is overwritten: no zeroing first
        by_entry = _group(seqs, lambda seq: seq.slot)
        zero_rows = mx.array(zero, dtype=mx.int32) if zero else None
        for i, pool in enumerate(state_pools(cache)):  # pool [slots, ...]; entry state [1, ...]
            if zero_rows is not None:
                pool[zero_rows] = mx.zeros((), pool.dtype)
            for e, rows in by_entry:
                pool[rows] = _spread(e.state[i], rows)
        tailed = [seq for seq in seqs if seq.restore.tail is not None]
        if tailed:
            bt = self.block_tokens
            for i, pool in enumerate(bundle_pools(cache)):  # pool [blocks, ...]; entry tail [1, ...]
                for e, rows in _group(tailed, lambda seq: seq.block_table[seq.restore.length // bt]):
                    pool[rows] = _spread(e.tail[i], rows)

    # ---- capture (at launch) and publish (at launch or read-back)
    def capture(self, seq, end: int, cache, state: list[mx.array] | None = None) -> Capture | None:
        """A snapshot of seq's state after `end` tokens (a boundary its step reaches), or None when that
        prefix is cached already; call after the step's graph is built. state: the GDN states the step
        left at `end` inside its chunk (model/gdn_taps.py), in the slot rows' order; None: the slot's rows."""
        if len(seq.tokens) >= end:  # tokens known now: skip what is cached already
            e = self._find(seq, end // self.interval)
            if e is not None:
                self.entries.move_to_end(e.key)
                return None
        return self._snapshot(seq, end, cache, state)

    def _snapshot(self, seq, end: int, cache, state: list[mx.array] | None = None) -> Capture:
        """Copies of seq's slot state (or `state`) and partial block after `end` computed tokens, and
        references to its whole blocks below end (lazily, in the graph built so far). A partial block taken
        in a step that went on past `end` holds rows past it too: a restore writes them before it reads."""
        bt = self.block_tokens
        blocks = seq.block_table[: end // bt]
        self.pool.share(blocks)
        if state is None:
            rows = mx.array([seq.slot], dtype=mx.int32)
            state = [mx.take(p, rows, axis=0) for p in state_pools(cache)]
        tail = None
        if end % bt:
            b = mx.array([seq.block_table[end // bt]], dtype=mx.int32)
            tail = [mx.take(p, b, axis=0) for p in bundle_pools(cache)]
        return Capture(seq, end, blocks, state, tail)

    def publish(self, caps: list[Capture]) -> list[PrefixEntry]:
        """Insert each capture whose tokens are on the host as an interval entry; returns the entries
        inserted (not those cached already)."""
        out = []
        for c in caps:
            seq, k = c.seq, c.length // self.interval
            if len(seq.tokens) >= c.length:  # else cancelled before its anchor was read back
                key = self.keys(seq, k)[-1]
                if self._insert(key, c, None):
                    out.append(self.entries[key])
            else:
                self.pool.free(c.blocks)
        return out

    def withdraw(self, entries: list[PrefixEntry]) -> None:
        """Drop entries whose step failed after they were published (pinned or not: a sequence restoring
        one fails with that step); one already evicted is skipped."""
        for e in entries:
            if self.entries.get(e.key) is e:
                self._drop(e)

    def keep_turn(self, seq, length: int, cache) -> bool:
        """A turn entry for seq's first `length` tokens (all computed, on the host; its slot's state is
        exactly after them): call before the slot is released. False when that prefix is cached already
        (touched instead) or the entry did not fit."""
        key, bucket = self._turn_key(seq, length)
        e = self.entries.get(key)
        if e is not None:
            if e.tokens == token_bytes(seq.tokens[:length]):
                self.entries.move_to_end(key)
            return False  # cached already, or a collision: a miss for the next turn, never a wrong answer
        c = self._snapshot(seq, length, cache)
        mx.async_eval(*c.arrays())  # before the next step's in-place writes into the slot and block
        return self._insert(key, c, bucket)

    def _turn_key(self, seq, length: int) -> tuple[int, int | None]:
        """(key, bucket) of an entry for seq's first `length` tokens: an interval entry (bucket None) on a
        boundary, else a turn entry of its longest whole-interval prefix's bucket."""
        k, rest = divmod(length, self.interval)
        bucket = self._bucket(seq, k)
        return (chunk_key(bucket, seq.tokens[k * self.interval : length]), bucket) if rest else (bucket, None)

    # ---- entries made elsewhere (a saved prompt: runtime/prompt_file.py)
    def exact(self, tokens: list[int], salt: str | None = None) -> PrefixEntry | None:
        """The entry for exactly these tokens under that cache_salt, or None."""
        if not tokens:
            return None
        e = self.entries.get(self._turn_key(Prefix(tokens, salt), len(tokens))[0])
        return e if e is not None and e.tokens == token_bytes(tokens) else None

    def maximal(self) -> list[PrefixEntry]:
        """The entries no other entry of their salt extends, least recently used first: what restores every
        conversation's end (a shorter entry's tokens are a prefix of a kept one's, its K/V rows within it)."""
        es = list(self.entries.values())
        return [e for e in es if not any(o is not e and o.salt == e.salt and o.length > e.length
                                         and o.tokens.startswith(e.tokens) for o in es)]

    def adopt(self, tokens: list[int], blocks: list[int], state: list[mx.array],
              tail: list[mx.array] | None, salt: str | None = None) -> PrefixEntry | None:
        """An entry for exactly these tokens (under that cache_salt) from state computed elsewhere, taking over
        one reference to each of `blocks` (written already); None when that prefix is cached already (the
        references are dropped) or the entry did not fit the budget."""
        prefix = Prefix(tokens, salt)
        key, bucket = self._turn_key(prefix, len(tokens))
        if not self._insert(key, Capture(prefix, len(tokens), blocks, state, tail), bucket, counted=False):
            return None
        return self.entries[key]

    def _insert(self, key: int, c: Capture, bucket: int | None, counted: bool = True) -> bool:
        """Store capture c under key (taking over its block references), then evict down to the budget;
        a duplicate or a key collision drops c's references instead. counted: a turn entry counts as kept."""
        tokens = token_bytes(c.seq.tokens[: c.length])
        e = self.entries.get(key)
        if e is not None:
            if e.tokens == tokens:
                self.entries.move_to_end(key)  # published by another sequence of the same step
            self.pool.free(c.blocks)
            return False
        nbytes = sum(a.nbytes for a in c.arrays())
        self.entries[key] = PrefixEntry(key, c.length, tokens, c.blocks, c.state, c.tail, nbytes, bucket=bucket,
                                        salt=c.seq.params.cache_salt)
        if bucket is not None:
            self.turns.setdefault(bucket, []).append(key)
            self.counters["prefix_turns_kept"] += counted
        self.nbytes += nbytes
        while self.nbytes > self.budget and self._evict_one():
            pass
        return key in self.entries

    # ---- eviction
    def _victim(self) -> PrefixEntry | None:
        """The least recently used entry nobody is restoring, sparing once (and moving to the most recent
        end) each one hit since it last came up; None when every entry is pinned."""
        for _ in range(2):  # the second pass finds no marks left
            spared, victim = [], None
            for e in self.entries.values():
                if e.pins:
                    continue
                if not e.spare:
                    victim = e
                    break
                spared.append(e)
            for e in spared:
                e.spare = False
                self.entries.move_to_end(e.key)
            if victim is not None or not spared:
                return victim
        return None

    def _evict_one(self, counted: bool = True) -> bool:
        """Drop the victim (_victim); False when there is none."""
        e = self._victim()
        if e is None:
            return False
        self._drop(e)
        self.counters["prefix_evictions"] += counted
        return True

    def _drop(self, e: PrefixEntry) -> None:
        del self.entries[e.key]
        if e.bucket is not None:
            keys = self.turns[e.bucket]
            keys.remove(e.key)
            if not keys:
                del self.turns[e.bucket]
        self.pool.free(e.blocks)
        self.nbytes -= e.nbytes

    def evict_for_blocks(self, n: int) -> bool:
        """Evict LRU entries until the pool has n free bundles (before anyone is preempted); False if it can't."""
        while self.pool.num_free < n:
            if not self._evict_one():
                return False
        return True

    def clear(self) -> int:
        """Drop every entry not pinned by a pending restore; returns how many were dropped."""
        n = 0
        while self._evict_one(counted=False):
            n += 1
        return n

    def reclaimable(self) -> int:
        """Bundles that evicting every unpinned entry would free (no sequence holds them)."""
        held = Counter(b for e in self.entries.values() if e.pins == 0 for b in e.blocks)
        return sum(1 for b, n in held.items() if self.pool.ref_counts[b] == n)

    def stats(self) -> dict:
        blocks = len({b for e in self.entries.values() for b in e.blocks})
        turns = [e for e in self.entries.values() if e.bucket is not None]
        return {**self.counters, "prefix_entries": len(self.entries), "prefix_bytes": self.nbytes, "prefix_blocks": blocks,
                "prefix_turn_entries": len(turns), "prefix_turn_bytes": sum(e.nbytes for e in turns)}


COUNTERS = ("prefix_lookups", "prefix_hits", "prefix_hit_tokens", "prefix_query_tokens", "prefix_evictions",
            "prefix_turn_hits", "prefix_turns_kept")
STATS = (*COUNTERS, "prefix_entries", "prefix_bytes", "prefix_blocks", "prefix_turn_entries", "prefix_turn_bytes")


def empty_stats() -> dict:
    """stats() of a cache that is off: the same keys, all zero."""
    return dict.fromkeys(STATS, 0)
