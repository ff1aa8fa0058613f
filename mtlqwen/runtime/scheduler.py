"""The token-budget scheduler (pure Python: it sees KV memory only through the KV manager).

Each step: admit waiting requests into free slots (FIFO), then give every live sequence its tokens —
a decoding sequence sends its anchor (1 token), the rest of the step budget is split equally among the
prefilling sequences (`split_budget`) — then reserve the bundles those tokens need. When the pool
cannot cover the step, the newest sequence is preempted (blocks and slot freed, request re-queued at
the front for recompute from kv_valid 0: GDN state cannot be rolled back) and the split is redone.
A preempted request is readmitted only once the pool can hold it and every running sequence up to
max_tokens, so it is not preempted again while the pool is short (no thrash); new requests are admitted
as soon as a slot is free and their step's blocks exist. The victims a short pool picks are sequences never
preempted; when only former victims are left and a finished sequence still holds blocks until its
read-back, the former victim sits the step out instead.

Shared in-flight prefixes: a request admitted while a running sequence (the leader) is about to compute
a longer prefix of it than the cache holds (boundary `target`, see KVManager.shared_boundary) is held:
it keeps its slot but nothing is looked up, allocated or run, so the leader computes the shared prefix
once, with the whole budget. Each step a held request is released — looked up and admitted as usual,
restoring what the leader published — as soon as the cache holds `target`, or its leader left (finished,
cancelled, preempted), or its wait reached its limit: the steps it would take to compute the prefix
itself (`prefill_steps`) with an equal share of the budget among the sequences prefilling when it
arrived and itself, plus one (a boundary the leader reaches by decoding is published at that step's
read-back, one step late; one of prompt tokens is published when its step is launched). So a wait costs
at most one step over computing alone as things stood, and a request that timed out still restores the
boundaries the leader published meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_manager import KVManager
from .sequence import Sequence, SeqStatus


def split_budget(needs: list[int], budget: int) -> list[int]:
    """Equal shares of `budget` for sequences needing needs[i] tokens, in admission order.

    Rule: with `left` tokens and n open sequences, q, r = divmod(left, n); open sequence j (in order)
    is offered q + 1 if j < r else q. Every sequence whose need fits its offer gets exactly its need and
    leaves; the tokens it did not use are re-split among the rest. When no need fits, each remaining
    sequence takes its offer. So shares differ by at most one, and the earlier sequences get the extra.
    """
    shares = [0] * len(needs)
    open_ = list(range(len(needs)))
    left = budget
    while open_ and left > 0:
        q, r = divmod(left, len(open_))
        offer = {i: q + (1 if j < r else 0) for j, i in enumerate(open_)}
        fits = [i for i in open_ if needs[i] <= offer[i]]
        if not fits:
            for i in open_:
                shares[i] = offer[i]
            break
        for i in fits:
            shares[i] = needs[i]
            left -= needs[i]
        open_ = [i for i in open_ if i not in fits]
    return shares


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: tokens start .. start + num_tokens - 1 of its request."""

    seq: Sequence
    start: int  # kv_valid before the step
    num_tokens: int
    samples: bool  # the chunk reaches the end of the request, so its last row is sampled
    sample_index: int  # which generated token it samples (0 = first), for the per-token PRNG key
    fresh: bool  # first chunk since admission: zero the slot's GDN state before the step
    drafts: int = 0  # a speculative verification: the anchor then this many drafts (positions past the request)


@dataclass
class PrefixWait:
    """A request held back for its leader's snapshot at `target` tokens; held through step `until`."""

    leader: Sequence
    target: int
    until: int
    since: int


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    held: list[Sequence] = field(default_factory=list)  # waiting for a leader's snapshot this step
    released: list[Sequence] = field(default_factory=list)  # held before, admitted to the cache this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def tokens_of(self, seq: Sequence) -> int:
        return next((s.num_tokens for s in self.scheduled if s.seq is seq), 0)


class Scheduler:
    """Decides who runs and how many tokens; KV memory is the KV manager's (kv_manager.KVManager)."""

    def __init__(self, kv: KVManager, num_slots: int, step_tokens: int, decode_tokens: int = 1,
                 prefill_step_tokens: int | None = None):
        if num_slots < 1:
            raise ValueError(f"slots must be >= 1, got {num_slots}")
        if step_tokens < num_slots * decode_tokens:
            # otherwise some live sequence could not advance in a step
            raise ValueError(f"step_tokens ({step_tokens}) must be >= slots x tokens per decode ({num_slots} x {decode_tokens})")
        self.kv, self.num_slots, self.step_tokens, self.decode_tokens = kv, num_slots, step_tokens, decode_tokens
        # the budget of a step in which nobody decodes: one long prompt is not cut into step_tokens
        # chunks when no one's latency depends on it
        self.prefill_step_tokens = max(step_tokens, prefill_step_tokens or step_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.free_slots: list[int] = list(range(num_slots))
        self.num_preemptions = 0
        self.held: dict[Sequence, PrefixWait] = {}  # running (a slot) but waiting for a leader's snapshot
        self.steps = 0  # schedule() calls so far: the clock of the waits
        self.counters = {"prefix_waits": 0, "prefix_wait_steps": 0, "prefix_wait_timeouts": 0}

    # ---- queue management
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out: its blocks and slot return at once."""
        self.held.pop(seq, None)
        if seq in self.running:
            self._free_resources(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _free_resources(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        seq.slot = None

    def _room_to_finish(self, seq: Sequence) -> bool:
        """The pool can hold seq and every running sequence up to max_tokens."""
        return self.kv.available() >= sum(self.kv.blocks_to_finish(s) for s in (*self.running, seq))

    def _admit(self) -> list[Sequence]:
        admitted = []
        # a request with a token still in flight (preempted mid-step) waits until it is read back
        while self.free_slots and self.waiting and self.waiting[0].pending == 0:
            seq = self.waiting[0]
            if seq.num_preemptions and not self._room_to_finish(seq):
                # a victim stays out (and the queue behind it) until the blocks to finish it exist:
                # readmitted sooner, it recomputes its context only to be preempted again (thrash)
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            seq.status, seq.fresh = SeqStatus.RUNNING, True
            wait = self._wait_for_leader(seq)
            if wait is not None:
                self.held[seq] = wait
                self.counters["prefix_waits"] += 1
            else:
                self.kv.admit(seq)  # a prefix hit maps shared bundles and starts kv_valid past them
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    # ---- shared in-flight prefixes
    def prefill_steps(self, start: int, end: int, share: int) -> int:
        """Steps a prefill from start to end takes with `share` tokens a step, its chunks cut at boundaries
        (unless KVManager.in_step)."""
        n = 0
        while start < end:
            start += self.kv.chunk_tokens_at(start, min(share, end - start))
            n += 1
        return n

    def _wait_for_leader(self, seq: Sequence) -> PrefixWait | None:
        """A wait for the running sequence that will publish the longest prefix of seq beyond what the
        cache holds for it now (the first admitted among equals), or None."""
        if not self.kv.interval:
            return None
        have, best, prefilling = self.kv.hit_length(seq), None, 1
        for lead in self.running:
            if lead in self.held or lead.sampling_done:
                continue
            prefilling += lead.need > self.decode_tokens
            target = self.kv.shared_boundary(seq, lead)
            if target > have and lead.kv_valid < target and (best is None or target > best[1]):
                best = (lead, target)
        if best is None:
            return None
        lead, target = best
        limit = self.prefill_steps(have, target, max(1, self.step_tokens // prefilling)) + 1
        return PrefixWait(lead, target, self.steps + limit, self.steps)

    def _release_waits(self) -> list[Sequence]:
        """Admit to the cache each held request whose target is published, whose leader left, or whose
        wait reached its limit; the rest stay held through this step."""
        released = []
        for seq, w in list(self.held.items()):
            done = self.kv.hit_length(seq) >= w.target
            if done or w.leader not in self.running or self.steps > w.until:
                del self.held[seq]
                self.counters["prefix_wait_steps"] += self.steps - w.since
                self.counters["prefix_wait_timeouts"] += not done and w.leader in self.running
                self.kv.admit(seq)
                released.append(seq)
        return released

    @staticmethod
    def _victim(live: list[Sequence]) -> Sequence:
        """The newest running sequence that was never preempted (else the newest): a victim readmitted
        once its blocks existed is not pushed out again when a later request's prefix hit pins the cache
        entries its room was counted on."""
        return next((s for s in reversed(live) if s.num_preemptions == 0), live[-1])

    def _preempt(self, seq: Sequence, admitted: list[Sequence], preempted: list[Sequence],
                 released: list[Sequence] | None = None) -> None:
        self._free_resources(seq)
        self.running.remove(seq)
        seq.status, seq.fresh = SeqStatus.WAITING, False
        fresh = [q for q in (admitted, released or []) if seq in q]
        if fresh:  # admitted or released this step, nothing computed: just put it back, no preemption
            fresh[0].remove(seq)
        else:
            seq.num_preemptions += 1
            self.num_preemptions += 1
            preempted.append(seq)
        self.waiting.appendleft(seq)

    # ---- the per-step plan
    def token_counts(self, seqs: list[Sequence]) -> list[int]:
        """Decoding sequences send their anchor (+ spec_drafts when speculating); prefilling ones split
        what is left (split_budget), each chunk ending on the next snapshot boundary at the latest unless
        the boundaries' states are taken inside the step (KVManager.in_step). The budget is step_tokens
        while anyone decodes, prefill_step_tokens when all prefill."""
        counts = [s.need + (s.spec_drafts if s.need == 1 else 0) if s.need <= self.decode_tokens else 0 for s in seqs]
        pre = [i for i, s in enumerate(seqs) if s.need > self.decode_tokens]
        budget = self.step_tokens if len(pre) < len(seqs) else self.prefill_step_tokens
        shares = split_budget([seqs[i].need for i in pre], budget - sum(counts))
        # a step with verifications cuts its chunks at boundaries (the verifying GDN path takes no taps)
        cross = not any(s.need == 1 and s.spec_drafts for s in seqs)
        for i, n in zip(pre, shares):
            counts[i] = self.kv.chunk_tokens(seqs[i], n, cross)
        return counts

    def schedule(self) -> StepPlan:
        self.steps += 1
        plan = StepPlan(released=self._release_waits())
        plan.admitted = self._admit()
        stalled: set[Sequence] = set()
        while True:
            # a sequence whose last token is already sampled only waits for read-back; a held one for its leader
            live = [s for s in self.running if not s.sampling_done and s not in self.held and s not in stalled]
            counts = self.token_counts(live)
            if self.kv.reserve(sum(self.kv.new_blocks(s, n) for s, n in zip(live, counts))):
                break
            victim = self._victim(live)
            if victim.num_preemptions and any(s.sampling_done for s in self.running):
                # only former victims are left to push out, and a finished sequence's blocks come back at
                # its read-back: the victim sits this step out (keeping its blocks) instead of a second
                # preemption
                stalled.add(victim)
                continue
            self._preempt(victim, plan.admitted, plan.preempted, plan.released)
        plan.held = list(self.held)
        for seq, n in zip(live, counts):
            if n == 0:
                continue
            self.kv.allocate(seq, n)
            drafts = max(0, seq.kv_valid + n - seq.num_tokens)  # a verification runs past the request
            samples = seq.kv_valid + n - drafts == seq.num_tokens
            plan.scheduled.append(ScheduledSeq(seq, seq.kv_valid, n, samples, seq.num_generated, seq.fresh, drafts))
            self.kv.advance(seq, n - drafts)  # drafts count once accepted (Speculator.commit)
            seq.fresh = False
            if samples:
                seq.pending += 1
        return plan

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "free_slots": len(self.free_slots),
            "preemptions": self.num_preemptions,
            "prefix_waiting": len(self.held),
            **self.counters,
        }
