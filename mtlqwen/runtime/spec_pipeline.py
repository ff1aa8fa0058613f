"""A pipelined speculative step (dflash.md §5.6): Engine(spec_pipeline=True), the default where steps are compiled.

While an all-verify step N is in flight, the engine launches step N+1 for the same sequences without reading
N back, then reads N back, so the device never waits for the host between verifications. N+1's inputs come
from N's device arrays:
  anchor_j     = N's next token (correction or bonus) of sequence j;
  kv_valid_j   = kv_valid_N + accepted_N + 1, i.e. the host's kv_valid (anchor_N + 1, exact: nothing else
                 is unread) plus the device's accepted count; positions, KV write slots and the drafter's
                 kv_valid are derived from it on the device;
  the GDN state is N's candidate pick, already in N's graph ("candidates" commit: a replay needs host counts).
The host sizes everything for the worst case (N accepted all n drafts): blocks for kv_valid_N + (n + 1) +
(n + 1) tokens, the layout's host kv_valid lists as upper bounds (read only for trace buckets and RoPE
sizes: the compiled traces read the arrays, SeqLayout.traced), and N+1 repeats N's draft counts only when
the worst case stays within max_tokens and short of the next snapshot boundary.

Bookkeeping stays with its owners: N+1's anchor is counted (KVManager.advance) and its token marked
pending at launch as the scheduler would, N's accepted drafts at N's read-back (Speculator.commit); the
sum is the same in either order. A sequence that finished at N's read-back (a stop) has N+1's results
dropped and its blocks freed at once, as plain decoding's one-step lag does: N+1's writes are ordered
before any reuse by MLX's data dependencies through the pool arrays. Its slot's state then lies past its
tokens, so no turn entry is kept of it (Sequence.state_ahead).

Anything else falls back to the synchronous rule (Speculator.must_sync): steps with prefill chunks, plain
decoders, requests waiting with a slot free or held for a leader, sampling at temperature > 0 (its noise is keyed by the generated
index, known at read-back), a sequence near max_tokens or a snapshot boundary, a pool that cannot hold
the worst case without preempting, a replay-committed step, an uncompiled engine (the uncompiled drafter
and attention plans read host kv_valid), a draft policy that would change the draft counts.
"""

from __future__ import annotations

import mlx.core as mx

from ..kernels import SeqLayout
from ..model.compiled import padded_tables
from . import speculative
from .failures import EvalFailed
from .scheduler import ScheduledSeq
from .speculative import _Verification


class SpecPipeline:
    """The engine's pipelined all-verify steps (module docstring); `step` is its one seam in Engine._step."""

    def __init__(self, engine):
        self.engine = engine
        self.spec = engine.spec
        self.kv, self.scheduler = engine.kv, engine.scheduler
        self.spec.pipelined = True

    # ---- which steps pipeline
    def carried(self, flight) -> list[int] | None:
        """Rows of flight's verification whose sequences go on into a pipelined step, or None: the
        synchronous rule."""
        v, spec = flight.spec, self.spec
        if v is None or flight.sampling or len(flight.seqs) != len(v.seqs) or spec.compiled is None:
            return None
        if v.stash.mode != "candidates" or not v.stash.committed:
            return None
        sched = self.scheduler
        rows = [j for j, s in enumerate(v.seqs) if s.seq.active]
        # a waiting request with a free slot would be admitted by the next schedule(): its step is synchronous
        if not rows or (sched.waiting and sched.free_slots) or sched.held or len(sched.running) != len(rows):
            return None
        if {v.seqs[j].seq for j in rows} != set(sched.running):
            return None
        seqs, n = [v.seqs[j].seq for j in rows], [v.n[j] for j in rows]
        for seq, nj in zip(seqs, n):
            p = seq.params
            if not (p.greedy and p.drafts) or seq.pending != 1 or seq.kv_valid < 1:
                return None
            # worst case: N yields nj + 1 tokens, N+1 another nj + 1 (num_generated counts N's one pending)
            if seq.num_generated - 1 + 2 * (nj + 1) > p.max_tokens:
                return None
            # N+1's anchor lies at most at kv_valid + nj (host kv_valid = N's anchor + 1)
            if self.kv.max_drafts_at(seq.kv_valid + nj, nj) != nj:
                return None
        if list(spec.policy.choose(seqs, n, len(seqs))) != n:  # the policy would draft otherwise: its step
            return None
        if not self.kv.reserve(sum(self.kv.new_blocks(seq, 2 * nj + 1) for seq, nj in zip(seqs, n))):
            return None
        return rows

    # ---- the seam
    def step(self, deltas: list) -> bool:
        """Launch a pipelined step after the one in flight and read that one back; False (nothing done)
        when the synchronous rule applies."""
        eng = self.engine
        flight = eng._inflight
        rows = self.carried(flight) if flight is not None else None
        if rows is None:
            if flight is not None:
                for s in flight.seqs:  # read back with nothing after it: the slot's state is its own
                    s.state_ahead = False
            return False
        scheduled = self._schedule(flight.spec, rows)
        launched, failure = None, None
        try:
            launched = self._launch(flight.spec, rows, scheduled)
        except EvalFailed as e:
            deltas += eng._fail_all(e.cause, [flight, e.flight])
            return True
        except Exception as e:  # raised while building the step: nothing of it ran
            failure = e
        eng._inflight = None
        if not eng._read_back(flight, launched, deltas):
            return True  # the reset failed the new step's sequences too
        for s in scheduled:  # N is on the host: N+1's anchor positions and generated indices are known now
            if s.seq.active:
                s.start, s.sample_index = s.seq.kv_valid - 1, s.seq.num_generated - 1
        if failure is not None:
            deltas += eng.failures.step(scheduled, failure)
            launched = None
        eng._inflight = launched
        return True

    def _schedule(self, v: _Verification, rows: list[int]) -> list[ScheduledSeq]:
        """N+1's host bookkeeping, as Scheduler.schedule does it: worst-case blocks, the anchor counted,
        its token pending. start / sample_index are N's bounds until N is read back."""
        out = []
        for j in rows:
            seq, nj = v.seqs[j].seq, v.n[j]
            self.kv.allocate(seq, 2 * nj + 1)
            out.append(ScheduledSeq(seq, seq.kv_valid + nj, nj + 1, True, seq.num_generated + nj, False, nj))
            self.kv.advance(seq, 1)  # the anchor; the accepted drafts of N and N+1 at their read-backs
            seq.pending += 1
            seq.state_ahead = True
        return out

    def _launch(self, v: _Verification, rows: list[int], scheduled: list[ScheduledSeq]):
        """Draft, verify and commit N+1 from N's device arrays; returns the engine's in-flight record."""
        from .engine import _InFlight  # noqa: PLC0415 (the engine imports this module)

        eng, spec = self.engine, self.spec
        S, bt = len(rows), eng.block_tokens
        n = [s.drafts for s in scheduled]
        N = max(n)
        idx = mx.array(rows, dtype=mx.int32)
        accepted, anchors = v.accepted[idx], v.next_token[idx]  # [S] int32, still on the device
        # host kv_valid is N's anchor + 2 (N's anchor and N+1's counted, N's accepted drafts not yet):
        # N+1's anchor lies at N's anchor + accepted + 1
        start = mx.array([s.seq.kv_valid - 2 for s in scheduled], dtype=mx.int32) + accepted + 1  # [S]
        qsl = [0]
        for nj in n:
            qsl.append(qsl[-1] + nj + 1)
        seg = mx.array([j for j, nj in enumerate(n) for _ in range(nj + 1)], dtype=mx.int32)  # [T]
        off = mx.array([t for nj in n for t in range(nj + 1)], dtype=mx.int32)  # [T]
        positions = start[seg] + off
        tables = [list(s.seq.block_table) for s in scheduled]
        table = padded_tables(tables, max(len(t) for t in tables))  # [S, W]
        lay = SeqLayout(qsl, [s.start for s in scheduled], tables, [s.seq.slot for s in scheduled], bt,
                        verify=[True] * S)  # host kv_valid: upper bounds
        for name, a in (("positions", positions), ("write_blocks", table[seg, positions // bt]),
                        ("write_offsets", positions % bt), ("kv_valid", start)):
            lay.provide(name, a)
        spec.flush()  # rows of plain steps before this run of verifications (none once it is running)
        drafts = spec.propose_on_device(scheduled, anchors, lay, N)  # [S, N]
        block = mx.concatenate([anchors[:, None], drafts], axis=1).reshape(-1)  # [S * (N + 1)]
        ids = block[mx.array([j * (N + 1) + t for j, nj in enumerate(n) for t in range(nj + 1)], dtype=mx.int32)]
        fwd_rows = mx.array(speculative.verify_rows(qsl, range(S), N), dtype=mx.int32)
        logits, taps, stash = spec.compiled.verifying(ids, lay, eng.cache, spec.taps, fwd_rows, "candidates")
        # the Speculator's verifier (looked up there: spec_bench's forced acceptance replaces it)
        k, nxt = speculative.verify(logits.reshape(S, N + 1, -1), drafts, n, [s.seq.params for s in scheduled], None)
        spec.compiled.commit(eng.cache, stash, k)  # N+1's candidate pick, by its device counts
        c, ec = spec.counters, eng.counters
        c["spec_steps"] += 1
        c["spec_pipelined_steps"] += 1
        ec["steps"] += 1
        state = _Verification(scheduled, lay, n, drafts, k, nxt, stash)
        flight = _InFlight([s.seq for s in scheduled], [], None, {}, None, state, shape=(S, S, N))
        try:
            mx.async_eval(k, nxt, drafts)
            spec.write_context(taps, lay)  # the anchor's and every draft's rows, as Speculator.launch
            mx.async_eval(*spec.dcache.arrays(), *eng.cache.arrays())
        except Exception as e:
            raise EvalFailed(e, flight) from e
        return flight
