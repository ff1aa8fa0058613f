"""DFlash speculative decoding in the engine step (design.md "One engine step", dflash.md §3-§5).

The engine calls four hooks when a drafter is loaded:
  plan(seqs)         before scheduling: how many drafts each decoding sequence sends (Sequence.spec_drafts);
                     the scheduler then gives it 1 + drafts tokens of the step budget.
  launch(plan, b, c) one drafter pass for all verifying sequences, their proposals scattered into the packed
                     ids, one target pass (taps captured) for the whole batch, sampling of the plain rows,
                     verification of the rest and its candidate states picked by the device's accepted
                     counts, drafter context of every row of the step.
  commit(state)      after the one read-back: accepted drafts + the next token per verifying sequence;
                     kv_valid covers them. GDN states are committed by picking candidates on the device in
                     the launched step (by the device's accepted counts), or here by a replay
                     (REPLAY_MIN_ROWS). KV and drafter context of rejected drafts are left where they
                     are, past kv_valid.
  must_sync(flight)  a step that verified, or sampled a sequence that may draft next step, is committed
                     before the next one is scheduled: its drafts need the host to know the anchor and
                     kv_valid. While the draft policy would draft for nobody, plain steps stay pipelined.

How many drafts each sequence sends is the draft policy's choice (draft_policy.py): all it may (fixed) or
what maximises expected tokens per unit of time by a step-cost table (adaptive), rounded down to one of
the engine's draft lengths (draft_policy.draft_lengths: few lengths, few compiled traces).

Drafter context rows are exact for positions < kv_valid whenever the drafter or a prefix entry reads them:
every row a step computes is written in that step (prefill chunks, a verification's anchor and all its
drafts), except the rows of plain decode steps, which wait in a backlog (context_backlog.py) until a
proposal, a snapshot or a turn entry needs them, or LIMIT of them are held.
A rejected draft's row lies past kv_valid, where the drafter never reads (its attention stops at the
anchor's kv_valid), and the step that commits that position writes it again first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from pathlib import Path

import mlx.core as mx

from ..kernels import SeqLayout
from ..model.cache import VerifyStash
from ..model.compiled_draft import CompiledDraft
from ..model.dflash import Drafter, DrafterCache, load_drafter, quantize_drafter
from .draft_policy import FixedDrafting, bucket_drafts, draft_lengths
from .context_backlog import ContextBacklog
from .kv_manager import KVManager
from .rejection import position_noise, sample_drafts, verify
from .scheduler import ScheduledSeq, StepPlan


def resolve_n_draft(block_size: int, n_draft: int | None, slots: int, step_tokens: int | None,
                    default: int | None = None) -> int:
    """Drafts per speculative step: `default` (the drafter's own, else its block_size - 1) when n_draft is
    None, capped so that every slot can verify (slots x (n_draft + 1) <= step_tokens) when step_tokens is
    given (None: the engine sizes its step budget after this draft length); a given value is checked
    against both."""
    cap = block_size - 1 if step_tokens is None else step_tokens // slots - 1
    if n_draft is None:
        n = min(min(default, block_size - 1) if default else block_size - 1, cap)
        if n < 1:
            raise ValueError(f"step_tokens={step_tokens} leaves no room for drafts with {slots} slots "
                             f"(each speculating slot needs at least 2 tokens)")
        return n
    if isinstance(n_draft, bool) or not isinstance(n_draft, int) or not 1 <= n_draft <= block_size - 1:
        raise ValueError(f"n_draft must be an int in 1..{block_size - 1} (the drafter's block_size - 1), got {n_draft!r}")
    if n_draft > cap:
        raise ValueError(f"slots x (n_draft + 1) = {slots} x {n_draft + 1} exceeds step_tokens={step_tokens}")
    return n_draft


def load_draft(model, draft, n_draft, slots: int, step_tokens: int | None, bits: int | None = None) -> tuple[Drafter | None, int]:
    """(drafter, n_draft) for Engine(draft=..., n_draft=..., draft_bits=...): draft is a Drafter, a directory
    or a repo id; bits (8 or 4) quantizes its projections (a loaded Drafter: into a new one)."""
    if draft is None:
        if n_draft is not None:
            raise ValueError("n_draft needs a drafter (draft=...)")
        return None, 0
    quant = None if bits is None else (bits, 64)
    if isinstance(draft, Drafter):
        drafter = draft if quant is None else quantize_drafter(draft, quant)
    else:
        drafter = load_drafter(Path(draft) if Path(draft).exists() else draft, model, quantize=quant)
    if drafter.target is not model:
        raise ValueError("the drafter was loaded for another target model")
    return drafter, resolve_n_draft(drafter.block_size, n_draft, slots, step_tokens,
                                    getattr(drafter, "default_n_draft", None))


@dataclass
class _Verification:
    """What a launched step leaves for commit: device arrays are read back in one go. A candidates commit
    is in the launched step already; a failed step fails its sequences (failures.py), whose slots are
    zeroed before any reuse."""

    seqs: list[ScheduledSeq]
    layout: SeqLayout  # the verifying sequences alone (kv_valid = anchor positions)
    n: list[int]  # drafts per sequence
    drafts: mx.array  # [S, N] int32
    accepted: mx.array  # [S] int32
    next_token: mx.array  # [S] int32: correction or bonus
    stash: VerifyStash  # the verifying forward's GDN parts, applied by Qwen35Model.commit_candidates


# From this many verify rows in a step (sequences x (drafts + 1)), verified GDN states are committed by replay
# rather than by keeping every candidate state (Qwen35Model's verify_commit). Candidates keep one state a row
# and GDN layer (2 MiB at the 9B shape: 16 rows, 768 MiB; 256 rows, 12 GiB); a replay reruns the accepted rows
# in an eager graph after the read-back, which a host-bound step pays in full. H200, 9B shape, 4-bit, compiled
# (benchmarks/spec.md, spec_trace.py): at 1 sequence and 15 drafts candidates 13.15 ms a step against replay
# 15.77; at 8 x 15 (128 rows) a tie (53.4 / 53.2 ms).
REPLAY_MIN_ROWS = 65


def verify_rows(qsl: list[int], seqs, N: int) -> list[int]:
    """Packed rows whose logits a verification reads: N + 1 per verifying sequence i of `seqs` (query_start_loc
    qsl), a shorter run repeating its last row (verify() masks those)."""
    return [min(qsl[i] + t, qsl[i + 1] - 1) for i in seqs for t in range(N + 1)]


def commit_mode_for(drafts: int, seqs: int = 1) -> str:
    """The engine's commit mode for a step in which `seqs` sequences verify up to `drafts` drafts each."""
    return "replay" if seqs * (drafts + 1) >= REPLAY_MIN_ROWS else "candidates"


class Speculator:
    """verify_commit: "candidates" or "replay" for every verification, or None to choose per step by the
    step's verify rows (commit_mode_for). policy: drafts per sequence and step (draft_policy.py;
    default FixedDrafting)."""

    def __init__(self, model, drafter: Drafter, n_draft: int, cache, kv: KVManager,
                 verify_commit: str | None = None, policy=None):
        self.model, self.drafter, self.n_draft, self.cache = model, drafter, n_draft, cache
        self.verify_commit = verify_commit
        self.policy = FixedDrafting() if policy is None else policy
        self.lengths = draft_lengths(n_draft)  # the draft lengths a step may send (bucket_drafts)
        self.compiled = None  # a CompiledDecode when the engine compiles speculative steps (use_compiled)
        self.compiled_draft: CompiledDraft | None = None  # the drafter's proposal and context writes, then
        self.kv = kv  # the snapshot boundary rule and the one writer of kv_valid
        self.dcache: DrafterCache = drafter.make_cache(cache)
        self.backlog = ContextBacklog(kv.block_tokens)  # context rows of plain decode steps, not written yet
        cache.drafter_cache = self.dcache  # ModelCache's declared field: copied and reset with the bundles
        self.taps = tuple(drafter.tap_layers)
        # spec_steps / plain_steps: engine steps with / without a verification; spec_verifications: one per
        # verifying sequence and step; plain_decodes: sequences that decoded one token without drafts
        # spec_pipelined_steps: all-verify steps launched while the previous verification was in flight
        self.counters = {"draft_tokens": 0, "accepted_tokens": 0, "spec_verifications": 0, "spec_steps": 0,
                         "plain_steps": 0, "plain_decodes": 0, "spec_pipelined_steps": 0}
        # set by a spec_pipeline engine: compiled all-verify steps commit candidates (a successor may be
        # launched before their read-back, which a replay commit needs), unless verify_commit says otherwise
        self.pipelined = False

    def use_compiled(self, compiled, scratch_block: int | None) -> None:
        """Run the target's decode-with-taps and all-verify steps and the candidate commits through `compiled`
        (a CompiledDecode), the drafter through a CompiledDraft whose padding rows go to scratch_block;
        None: uncompiled."""
        self.compiled = compiled
        self.compiled_draft = None if compiled is None else CompiledDraft(self.drafter, scratch_block)

    def write_context(self, taps: mx.array, layout: SeqLayout) -> None:
        """Drafter context of layout's tokens from their taps, compiled when the engine is."""
        (self.drafter if self.compiled_draft is None else self.compiled_draft).write_context(taps, layout, self.dcache)

    def flush(self) -> None:
        """Write the held-back context rows (context_backlog.py) in an evaluation of their own: a later
        pass over the drafter's pools (a proposal, another write, a snapshot's copy) must not share it
        (design.md, "In-place writes")."""
        got = self.backlog.take()
        if got is not None:
            self.write_context(*got)
            mx.async_eval(*self.dcache.arrays())

    def finishing(self, seq) -> None:
        """seq is about to finish: its held context rows go into its blocks before a turn entry shares them,
        or, without a prefix cache, are dropped (nothing reads them)."""
        if not self.backlog.holds(seq):
            return
        if self.kv.prefix is not None:
            self.flush()
        else:
            self.backlog.drop(seq)

    def _holds_back(self, plan: StepPlan) -> bool:
        """A step whose context rows may wait: every sequence computes one token, none verifies, and none
        reaches a snapshot boundary (an entry shares the blocks from the step's capture on)."""
        return all(s.num_tokens == 1 and not s.drafts and not self.kv.on_boundary(s.start + 1) for s in plan.scheduled)

    @staticmethod
    def bytes_per_block(drafter: Drafter | None, block_tokens: int, dtype) -> int:
        return 0 if drafter is None else DrafterCache.bytes_per_block(drafter.config, block_tokens, dtype)

    # ---- before scheduling
    def drafts_for(self, seq) -> int:
        """The most drafts a sequence may send this step: only in decode, with its anchor on the host
        (nothing in flight), after its first token is computed, and never past max_tokens (the step yields
        up to drafts + 1). With a prefix cache, a verification stops short of the next interval boundary:
        the boundary is then reached by a plain step, whose state the cache captures at launch (a
        verification's state is only known at read-back). Rounded down to a draft length (draft_lengths)."""
        if not (seq.active and seq.params.drafts and seq.pending == 0 and seq.need == 1 and seq.kv_valid > 0):
            return 0
        return self._cap(seq)

    def _cap(self, seq) -> int:
        """The most drafts seq may send, rounded down to a draft length."""
        n = self.kv.max_drafts(seq, max(0, min(self.n_draft, seq.params.max_tokens - seq.num_generated - 1)))
        return bucket_drafts(n, self.lengths)

    def plan(self, seqs) -> None:
        """Sequence.spec_drafts of every live sequence (a stale count must not survive a preemption), as
        the policy chooses within drafts_for, rounded down to a draft length (the policy sees bucketed caps;
        a choice between lengths, e.g. an adaptive N from its table's columns, is bucketed the same way);
        decoding sequences left plain tell the policy so."""
        seqs = list(seqs)
        rows = sum(s.active for s in seqs)
        n = [bucket_drafts(k, self.lengths) for k in self.policy.choose(seqs, [self.drafts_for(s) for s in seqs], rows)]
        planned = getattr(self.policy, "planned", None)  # a policy object of the caller's may not track costs
        if planned is not None:
            planned(seqs, n, rows)
        for seq, k in zip(seqs, n):
            seq.spec_drafts = k
            if k == 0 and seq.active and seq.params.drafts and seq.num_generated > 0:
                self.policy.skipped(seq)

    def must_sync(self, flight, seqs) -> bool:
        """Commit `flight` before scheduling: it verified, or the policy may draft for one of the sequences
        it sampled once their tokens are on the host (seqs: every live sequence, for the batch size)."""
        if flight.spec is not None:
            return True
        cand = [s.seq for s in flight.sampling if s.seq.active and s.seq.params.drafts]
        if not cand:
            return False
        if isinstance(self.policy, FixedDrafting):  # drafts whenever it may: the original rule
            return True
        seqs = list(seqs)
        return any(self.policy.choose(cand, [self._cap(q) for q in cand], sum(q.active for q in seqs)))

    # ---- drafting
    def propose(self, seqs: list[ScheduledSeq], layout: SeqLayout, n: int) -> tuple[mx.array, mx.array | None]:
        """One drafter pass for all verifying sequences: (greedy drafts [S, n] int32, draft logits
        [S, n, V] or None when every sequence is greedy). Tests replace this to force acceptance."""
        anchors = [s.seq.tokens[s.start] for s in seqs]
        d = self.drafter if self.compiled_draft is None else self.compiled_draft
        if all(s.seq.params.greedy for s in seqs):
            return d.propose(anchors, layout, self.dcache, n), None
        return d.propose_with_logits(anchors, layout, self.dcache, n)

    def propose_on_device(self, seqs: list[ScheduledSeq], anchors: mx.array, layout: SeqLayout, n: int) -> mx.array:
        """Greedy drafts [S, n] int32 of a pipelined step: anchors [S] and layout.array("kv_valid") are device
        arrays, layout.kv_valid their upper bounds (compiled drafter only). Tests replace this too."""
        return self.compiled_draft.propose(anchors, layout, self.dcache, n)

    # ---- the step
    def launch(self, plan: StepPlan, batch, cache, sample) -> tuple[mx.array | None, _Verification | None, list, Any]:
        """Run draft + target for the packed batch; sample(logits of the plain rows, batch) -> (tokens, (sequence,
        error) of rows whose own sampling raised, logprobs) is the engine's. Returns (tokens of the plain
        sampling rows, verification, those failures, the plain rows' logprobs.StepLogprobs or None)."""
        lay, ids = batch.layout, batch.input_ids
        ver = [i for i, v in enumerate(lay.verify or []) if v]
        hold = not ver and self._holds_back(plan)
        # before this step's graph: the proposal reads the context, this step's own write must not share the
        # flush's evaluation, and a full backlog holds only rows of steps already launched
        if not hold or self.backlog.full():
            self.flush()
        rows = batch.logits_rows.tolist() if batch.logits_rows is not None else []
        R = len(rows)
        c = self.counters
        c["spec_steps" if ver else "plain_steps"] += 1
        c["plain_decodes"] += sum(1 for s in plan.scheduled
                                  if not s.drafts and s.num_tokens == 1 and s.samples and s.start >= s.seq.prompt_len)
        if ver:
            vs = [plan.scheduled[i] for i in ver]  # pack keeps plan order: layout sequence i is scheduled[i]
            vl, _ = lay.subset(ver)
            n = [s.drafts for s in vs]
            N, qsl = max(n), lay.query_start_loc
            drafts, q_logits = self.propose(vs, vl, N)
            hot = [j for j, s in enumerate(vs) if not s.seq.params.greedy]
            noise = None
            if hot:  # each sequence's noise rows are keyed by its own (seed, generated index), never by N
                noise = position_noise([vs[j].seq.seed for j in hot], [vs[j].sample_index for j in hot], N + 1,
                                       q_logits.shape[-1])
                h = mx.array(hot, dtype=mx.int32)
                drafts[h] = sample_drafts(q_logits[h], [vs[j].seq.params for j in hot], noise)
            at = [qsl[i] + 1 + t for i, nj in zip(ver, n) for t in range(nj)]
            src = [j * N + t for j, nj in enumerate(n) for t in range(nj)]
            ids[mx.array(at, dtype=mx.int32)] = drafts.reshape(-1)[mx.array(src, dtype=mx.int32)]
            rows += verify_rows(qsl, ver, N)
        fwd_rows = mx.array(rows, dtype=mx.int32)
        compiled = self.compiled is not None and rows and self.compiled.eligible_with_taps(lay)  # decode or all-verify
        stash = None
        if ver:  # the forward stashes in this mode and the commit follows the stash
            mode = self.verify_commit or ("candidates" if self.pipelined and compiled else commit_mode_for(N, len(ver)))
            fwd = self.compiled.verifying if compiled else self.model.forward_verifying
            logits, taps, stash = fwd(ids, lay, cache, self.taps, fwd_rows, mode)
        else:
            fwd = self.compiled.with_taps if compiled else self.model.forward_with_taps
            logits, taps = fwd(ids, lay, cache, self.taps, fwd_rows)
        tokens, failed, logprobs = None, [], None
        if R:
            tokens, failed, logprobs = sample(logits[:R], batch)
        state = None
        if ver:
            tl = logits[R:].reshape(len(ver), N + 1, -1)
            k, nxt = verify(tl, drafts, n, [s.seq.params for s in vs], noise)
            if stash.mode == "candidates":  # the state pick by the device's accepted counts, in this step's graph
                (self.model.commit_candidates if self.compiled is None else self.compiled.commit)(cache, stash, k)
            state = _Verification(vs, vl, n, drafts, k, nxt, stash)
            mx.async_eval(k, nxt, drafts)
        if hold:  # plain decodes: their rows wait in the backlog (taps stay lazy; their inputs are kept)
            self.backlog.add(taps, plan.scheduled)
            return tokens, state, failed, logprobs
        # drafter context of every row, a verification's anchor + all its drafts included: rows past the
        # accepted ones lie past kv_valid, where nothing reads them, until a later step writes them again
        self.write_context(taps, lay)
        mx.async_eval(*self.dcache.arrays())
        return tokens, state, failed, logprobs

    @staticmethod
    def read(v: _Verification) -> tuple[list[int], list[int], list[list[int]]]:
        """The verification's results on the host (accepted, next token, drafts): the read-back's sync."""
        return v.accepted.tolist(), v.next_token.tolist(), v.drafts.tolist()

    def commit(self, v: _Verification, verified=None) -> list[tuple[ScheduledSeq, list[int]]]:
        """Apply a verification: kv_valid covers the accepted drafts, and a replay commit reruns them (a
        candidates commit and the drafter context were part of the launched step). Returns each sequence's
        tokens. verified: what read(v) returned (read here when None)."""
        k, nxt, drafts = verified if verified is not None else self.read(v)
        if not v.stash.committed:  # replay: accepted + 1 rows per sequence, a host-shaped graph
            self.model.commit_candidates(self.cache, v.stash, k)
        c = self.counters
        out = []
        for j, s in enumerate(v.seqs):
            self.kv.advance(s.seq, k[j])  # the anchor was counted at scheduling; the accepted drafts now
            c["draft_tokens"] += v.n[j]
            c["accepted_tokens"] += k[j]
            c["spec_verifications"] += 1
            self.policy.record(s.seq, v.n[j], k[j])
            out.append((s, drafts[j][: k[j]] + [nxt[j]]))
        return out

    def stats(self) -> dict:
        """The counters, n_draft, the policy's name and mean_acceptance_length: tokens per verification
        (accepted drafts + the bonus / correction; 0 before any); with a learning table, its observed step-cost
        ratios (measured_costs.MeasuredCosts.summary)."""
        c = self.counters
        v = c["spec_verifications"]
        tau = (c["accepted_tokens"] + v) / v if v else 0.0
        out = {**c, "n_draft": self.n_draft, "draft_policy": getattr(self.policy, "name", type(self.policy).__name__),
               "mean_acceptance_length": tau}
        summary = getattr(getattr(self.policy, "costs", None), "summary", None)
        if summary is not None:
            out["step_cost_ratios"] = summary()
        return out
