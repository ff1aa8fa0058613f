"""How many drafts each decoding sequence verifies in a step: the fixed rule or adaptive drafting.

A speculative step costs several plain decode steps (benchmarks/spec.md), so drafting pays only when the
tokens a step yields grow faster than its cost. `AdaptiveDrafting` picks, per step, a draft length N (0:
plain decode) and which sequences speculate, maximising expected tokens per unit of time

    rate(N, k) = (S + sum of the k largest gains_i(N)) / (c(S, 0) + c(k, N) - c(k, 0))

where S is the number of decoding sequences in the step, c the step-cost table (`StepCosts`),
gains_i(N) = E[tau_i(N)] - 1 the expected accepted drafts of sequence i. The extra cost of k speculating
sequences is the table's at k sequences (`StepCosts.extra`): the drafter pass and the verification rows
are theirs, and a speculative step has a fixed part that one probing sequence pays alone (below the
table's smallest batch, a share of its first row). tau_i(N) = 1 + a + ... + a^N for a sequence whose
drafts are accepted with probability a each (one rejection ends the run), a estimated from its own
verifications (`AcceptanceEstimate`). N = 0 always competes, so by the table a drafter never makes a step
yield fewer tokens per unit of time than plain decoding.

A sequence the estimate turns off is probed again (at the prior; with the cheapest draft length by which the
step still pays, since a probe asks only whether its next draft is accepted) after a backoff of plain steps: 4, doubled
by each probe that accepts nothing up to 128, reset by an accepted draft, and never shorter than what
amortises its share of its last speculative step's extra cost to `probe_share` (5%) / S of the plain steps in
between, S the step's sequences, so that all of them together spend at most 5% (past 128 steps where need
be). Where the drafter never pays, it costs its first steps' drafts, then at most 5% (`test_draft_policy.py`
checks the bound over random tables); a sequence whose text turns predictable is found within one backoff.

The table prices steps; with learn_draft_costs the engine corrects it with its own step times
(measured_costs.py), since the built-in one was measured for one pair on one machine.

`FixedDrafting` is the engine's original rule: every eligible sequence verifies all the drafts it may.

Draft lengths: whatever a policy chooses, a sequence sends a draft length from `draft_lengths(n_draft)`
(the buckets 1, 3, 7, 15 up to n_draft, and n_draft itself), rounded down by `bucket_drafts`: every
distinct length makes its own compiled trace and kernel instantiations, so a workload meets few of them.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path


# ------------------------------------------------------------------------------------ draft lengths
DRAFT_BUCKETS = (1, 3, 7, 15)


def draft_lengths(n_draft: int) -> tuple[int, ...]:
    """The draft lengths a speculative step may send with the engine's n_draft: the buckets up to it and
    n_draft itself (ascending)."""
    return tuple(sorted({b for b in DRAFT_BUCKETS if b <= n_draft} | ({n_draft} if n_draft > 0 else set())))


def bucket_drafts(n: int, lengths: tuple[int, ...]) -> int:
    """The largest of `lengths` that does not exceed n (0 when none does)."""
    return max((b for b in lengths if b <= n), default=0)


# ------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class StepCosts:
    """Wall time of one engine step, by decoding sequences S (rows of the table) and drafts per speculating
    sequence N (columns; N = 0 is a plain decode step). Units are free (ms, or ratios to one cell): only
    ratios matter. Between grid points the cost is linear in S and in N; past the largest S it grows along
    the last segment (a single row: constant in S); below the smallest S it is the first row."""

    seqs: tuple[int, ...]  # ascending, >= 1
    drafts: tuple[int, ...]  # ascending, starting at 0
    ms: tuple[tuple[float, ...], ...]  # ms[i][j]: cost at seqs[i], drafts[j]

    def __post_init__(self):
        if not self.seqs or list(self.seqs) != sorted(set(self.seqs)) or self.seqs[0] < 1:
            raise ValueError(f"StepCosts.seqs must be ascending distinct ints >= 1, got {self.seqs!r}")
        if len(self.drafts) < 2 or self.drafts[0] != 0 or list(self.drafts) != sorted(set(self.drafts)):
            raise ValueError(f"StepCosts.drafts must be ascending distinct ints starting at 0 with at least one "
                             f"draft length, got {self.drafts!r}")
        if len(self.ms) != len(self.seqs) or any(len(r) != len(self.drafts) for r in self.ms):
            raise ValueError(f"StepCosts.ms must be {len(self.seqs)} rows of {len(self.drafts)} costs")
        if any(not v > 0 for r in self.ms for v in r):
            raise ValueError("StepCosts.ms must be positive")

    def cost(self, S: int, N: int) -> float:
        """Step cost at S decoding sequences with N drafts each (interpolated)."""
        if N < 0 or N > self.drafts[-1]:
            raise ValueError(f"N={N} outside the table's drafts 0..{self.drafts[-1]}")
        row = [self._in_drafts(r, N) for r in self.ms]
        if len(row) == 1 or S <= self.seqs[0]:
            return row[0]
        i = min(bisect_right(self.seqs, S), len(self.seqs) - 1)  # segment [i-1, i], the last one beyond
        s0, s1 = self.seqs[i - 1], self.seqs[i]
        return row[i - 1] + (row[i] - row[i - 1]) * (S - s0) / (s1 - s0)

    def extra(self, k: int, N: int) -> float:
        """What k sequences speculating with N drafts add to a step: c(k, N) - c(k, 0), interpolated; below
        the smallest batch measured, its share k / seqs[0] of that batch's."""
        s0 = self.seqs[0]
        if k >= s0:
            return self.cost(k, N) - self.cost(k, 0)
        return (self.cost(s0, N) - self.cost(s0, 0)) * k / s0

    def step(self, S: int, k: int, N: int) -> float:
        """A step of S decoding sequences, k of them speculating with N drafts: c(S, 0) + extra(k, N) (the
        policy's price of a step; measured_costs.MeasuredCosts corrects it online)."""
        return self.cost(S, 0) + (self.extra(k, N) if k > 0 and N > 0 else 0.0)

    def _in_drafts(self, r: tuple[float, ...], N: int) -> float:
        j = bisect_right(self.drafts, N) - 1
        if self.drafts[j] == N:
            return r[j]
        n0, n1 = self.drafts[j], self.drafts[j + 1]
        return r[j] + (r[j + 1] - r[j]) * (N - n0) / (n1 - n0)

    @classmethod
    def from_rows(cls, rows: list[dict], compiled: bool | None = None) -> StepCosts:
        """From spec_bench.py's JSON rows ({"seqs", "n_draft", "commit", "compiled", "plain_step_ms",
        "spec_step_ms"}): with `compiled` given, only the rows measured that way (spec_bench --compile
        on / off) where the table has any, as the engine will run its speculative steps;
        n_draft 0 rows give the plain column (a drafter loaded, nobody speculating) where present, else each
        batch's plain_step_ms; of several rows at one (seqs, n_draft) the engine's own commit mode ("auto",
        or the one speculative.commit_mode_for picks) is taken when measured, else the cheapest."""
        from .speculative import commit_mode_for  # noqa: PLC0415 (speculative imports this module)

        if compiled is not None:
            want = "on" if compiled else "off"
            rows = [r for r in rows if r.get("compiled", "off") == want] or rows
        cells: dict[tuple[int, int], list[dict]] = {}
        for r in rows:
            cells.setdefault((int(r["seqs"]), int(r["n_draft"])), []).append(r)
        seqs = sorted({s for s, _ in cells})
        drafts = sorted({n for _, n in cells} | {0})
        ms = []
        for S in seqs:
            row = []
            for N in drafts:
                got = cells.get((S, N))
                if N == 0 and not got:
                    plain = [r["plain_step_ms"] for (s, _), rs in cells.items() if s == S for r in rs]
                    if not plain:
                        raise ValueError(f"no plain step time at {S} sequences")
                    row.append(float(min(plain)))
                    continue
                if not got:
                    raise ValueError(f"the table has no row at {S} sequences, n_draft {N}")
                own = [r for r in got if r.get("commit") in ("auto", commit_mode_for(N, S))] if N else []
                row.append(float(min(r["spec_step_ms"] for r in (own or got))))
            ms.append(tuple(row))
        return cls(tuple(seqs), tuple(drafts), tuple(ms))

    @classmethod
    def load(cls, path: str | Path, compiled: bool | None = None) -> StepCosts:
        """A JSON file: spec_bench.py --json output ({"rows": [...]}, `compiled` as in from_rows) or
        {"seqs", "drafts", "ms"}."""
        d = json.loads(Path(path).read_text())
        if "rows" in d:
            return cls.from_rows(d["rows"], compiled)
        return cls(tuple(d["seqs"]), tuple(d["drafts"]), tuple(tuple(r) for r in d["ms"]))


# H200, Qwen3.5-9B shape 4-bit g64 target + the 9B drafter shape (bf16), 512-token context, forced
# acceptance of 4 drafts, uncompiled speculative steps, the engine's commit mode per N (benchmarks/spec.md,
# results/spec.json): ms per engine step. Plain column: the plain engine without a drafter.
H200_9B_COSTS = StepCosts(
    seqs=(1, 8),
    drafts=(0, 4, 8, 15),
    ms=((5.41, 26.27, 32.16, 36.24),
        (15.70, 64.69, 66.47, 71.44)),
)


# The same pair, compiled steps (Engine(compile_decode=True): decode-with-taps, all-verify steps, the drafter
# pass and its context write through mx.compile), pipelined as the engine runs them, forced acceptance of
# min(6, N) drafts, the engine's commit mode, at every draft length the engine sends (draft_lengths: 1, 3, 7, 15),
# so that no cost is interpolated across the fixed cost of a speculative step. Column 0: the engine with the
# drafter loaded and nobody drafting. The engine's default table when it compiles, and the prior it corrects
# with its own step times (measured_costs.py; benchmarks/spec.md "The cost table pipelined";
# results/spec-costs-pipelined.json):
#   source .device/env.sh && python benchmarks/spec_bench.py --seqs 1 8 32 --n-draft 0 1 3 7 15 --commit auto \
#     --accept 6 --compile on --pipeline on --no-parts --steps 10 --warmup 2
H200_9B_COMPILED_COSTS = StepCosts(
    seqs=(1, 8, 32),
    drafts=(0, 1, 3, 7, 15),
    ms=((3.95, 9.69, 10.22, 9.84, 12.17),
        (6.26, 9.01, 13.60, 16.19, 27.47),
        (8.53, 17.86, 26.87, 22.58, 42.76)),
)


# ---------------------------------------------------------------------------------- per-sequence state
@dataclass
class AcceptanceEstimate:
    """A sequence's running acceptance: exponentially decayed counts of accepted drafts and of rejections
    (a run of n drafts with k accepted is k successes, then one failure unless k == n), pulled towards a
    prior of `prior` acceptance worth `weight` observations; the counts move only when it verifies.
    idle: plain steps since it last verified; backoff: the plain steps after which it is probed again
    (`AdaptiveDrafting.due`)."""

    accepted: float = 0.0
    rejected: float = 0.0
    idle: int = 0
    backoff: int = 4
    step_extra: float = 0.0  # its share of its last speculative step's extra cost x S (AdaptiveDrafting.planned)

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)


def expected_tokens(a: float, n: int) -> float:
    """E[tau] for n drafts accepted with probability a each: 1 + a + ... + a^n (the bonus included)."""
    return float(n + 1) if a >= 1.0 else (1.0 - a ** (n + 1)) / (1.0 - a)


# ------------------------------------------------------------------------------------------- policies
class FixedDrafting:
    """Every eligible sequence verifies every draft it may (up to the engine's n_draft)."""

    name = "fixed"

    def choose(self, seqs: list, caps: list[int], rows: int) -> list[int]:
        return list(caps)

    def planned(self, seqs: list, drafts: list[int], rows: int) -> None:
        pass

    def record(self, seq, drafts: int, accepted: int) -> None:
        pass

    def skipped(self, seq) -> None:
        pass


class AdaptiveDrafting:
    """Draft length and speculating sequences per step, from `costs` and each sequence's acceptance (module
    docstring). decay: weight kept by past observations per verification (0.8 forgets with a horizon of ~5);
    prior / prior_weight: the acceptance assumed before a sequence has verified, and by a probe;
    min_backoff / max_backoff: plain steps before the first / the latest probe of a sequence turned off;
    probe_share: the most all sequences' speculative steps may add to the plain steps between their probes."""

    name = "adaptive"

    def __init__(self, costs: StepCosts = H200_9B_COSTS, decay: float = 0.8, prior: float = 0.8,
                 prior_weight: float = 2.0, min_backoff: int = 4, max_backoff: int = 128, probe_share: float = 0.05):
        if not (callable(getattr(costs, "step", None)) and hasattr(costs, "drafts")):
            raise TypeError(f"costs must be a StepCosts or a measured_costs.MeasuredCosts, got {type(costs).__name__}")
        if not 0.0 <= decay < 1.0 or not 0.0 <= prior <= 1.0 or not prior_weight > 0:
            raise ValueError(f"need 0 <= decay < 1, 0 <= prior <= 1, prior_weight > 0 "
                             f"(got {decay}, {prior}, {prior_weight})")
        if not 1 <= min_backoff <= max_backoff or not probe_share > 0:
            raise ValueError(f"need 1 <= min_backoff <= max_backoff and probe_share > 0 "
                             f"(got {min_backoff}, {max_backoff}, {probe_share})")
        self.costs, self.decay, self.prior, self.prior_weight = costs, decay, prior, prior_weight
        self.min_backoff, self.max_backoff, self.probe_share = min_backoff, max_backoff, probe_share
        # (S, N) -> [step(S, k, N) for k in 0..S] at the table's version: choose() asks every step, twice (the
        # engine's "might it draft?" and the plan), and the table's interpolations at 32 sequences took the
        # host 0.4-0.6 ms a call
        self._prices: dict[tuple[int, int], list[float]] = {}
        self._prices_version = None

    def estimate(self, seq) -> AcceptanceEstimate:
        if seq.draft_estimate is None:
            seq.draft_estimate = AcceptanceEstimate(backoff=self.min_backoff)
        return seq.draft_estimate

    def acceptance(self, seq) -> float:
        return self.estimate(seq).rate(self.prior, self.prior_weight)

    def due(self, seq) -> bool:
        """seq has sat out its backoff: this step may probe it (at the prior's acceptance, or its own if higher)."""
        e = self.estimate(seq)
        return e.idle >= e.backoff

    def planned(self, seqs: list, drafts: list[int], rows: int) -> None:
        """The step's drafts as sent: each of the k speculating sequences notes its share of the step's extra
        cost over a plain one, in plain steps, times the S sequences of the step, for the backoff after it:
        each then spends at most probe_share / S of the steps in between, all of them probe_share."""
        k = sum(1 for n in drafts if n > 0)
        if not k:
            return
        S, N = max(rows, k), max(drafts)
        c0 = self.costs.step(S, 0, 0)
        extra = max(0.0, self.costs.step(S, k, N) - c0) / c0 * S / k
        for seq, n in zip(seqs, drafts):
            if n > 0:
                self.estimate(seq).step_extra = extra

    @property
    def learns(self) -> bool:
        """Its table learns from step times (MeasuredCosts): the engine then times its steps for it."""
        return callable(getattr(self.costs, "observe", None))

    def observe(self, S: int, k: int, N: int, seconds: float) -> None:
        """A pure decode step's wall time (the engine's StepTimer), for a table that learns."""
        if self.learns:
            self.costs.observe(S, k, N, seconds)

    def record(self, seq, drafts: int, accepted: int) -> None:
        """A verification's result. An accepted draft resets the backoff; a probe that accepted none doubles
        it, and a run that accepted none (the estimate's, or beside another sequence's probe) keeps it. Either
        way it is at least what amortises the step to probe_share."""
        e = self.estimate(seq)
        backoff = self.min_backoff if accepted > 0 else self._longer(e.backoff) if self.due(seq) else e.backoff
        e.backoff = max(backoff, math.ceil(e.step_extra / self.probe_share - 1e-9))  # past max_backoff if need be
        e.idle = 0
        e.accepted = self.decay * e.accepted + accepted
        e.rejected = self.decay * e.rejected + (1.0 if accepted < drafts else 0.0)

    def skipped(self, seq) -> None:
        """A plain step of a decoding sequence; one that was due and still not chosen backs off further."""
        e = self.estimate(seq)
        if self.due(seq):
            e.idle, e.backoff = 0, self._longer(e.backoff)
        else:
            e.idle += 1

    def prices(self, S: int, N: int) -> list[float]:
        """[costs.step(S, k, N) for k in 0..S], kept while the table's `version` holds (a StepCosts never
        changes; a MeasuredCosts moves with each observation)."""
        version = getattr(self.costs, "version", 0)
        if version != self._prices_version:
            self._prices, self._prices_version = {}, version
        row = self._prices.get((S, N))
        if row is None:
            row = self._prices[(S, N)] = [self.costs.step(S, k, N) for k in range(S + 1)]
        return row

    def _longer(self, backoff: int) -> int:
        """The backoff after a probe that kept nothing: doubled up to max_backoff, never shortened (an
        amortised one may be past it)."""
        return max(backoff, min(2 * backoff, self.max_backoff))

    def choose(self, seqs: list, caps: list[int], rows: int) -> list[int]:
        """Drafts per sequence (0 = plain decode). caps: the most each may verify (0: not eligible); rows:
        decoding sequences in the step (at least the eligible ones). Pure: the engine also asks it whether
        a step would draft before committing to one."""
        live = [i for i, c in enumerate(caps) if c > 0]
        out = [0] * len(caps)
        if not live:
            return out
        S = max(rows, len(live))
        if self.learns and self.costs.plain_unseen(S):  # a plain step, to be timed (MeasuredCosts.plain_unseen)
            return out
        rates = {i: self.acceptance(seqs[i]) for i in live}
        probes = {i for i in live if self.due(seqs[i]) and rates[i] < self.prior}  # due, and kept off by the estimate
        for i in probes:
            rates[i] = self.prior
        n_max = min(max(caps), self.costs.drafts[-1])
        plain = S / self.prices(S, 0)[0]
        best, choice = plain, (0, [])
        for N in sorted({d for d in self.costs.drafts if 0 < d <= n_max} | {n_max}):
            gains = sorted(((expected_tokens(rates[i], min(N, caps[i])) - 1.0, i) for i in live), reverse=True)
            prices = self.prices(S, N)
            tokens = float(S)
            for k, (g, _) in enumerate(gains, 1):
                tokens += g
                rate = tokens / prices[k]
                if rate > best * (1.0 + 1e-9):  # a tie keeps the cheaper choice
                    best, choice = rate, (N, [i for _, i in gains[:k]])
        N, chosen = choice
        L = self._probe_length(S, N, chosen, probes & set(chosen), rates, caps, plain) if N else N
        for i in chosen:
            out[i] = min(L if i in probes else N, caps[i])
        return out

    def _probe_length(self, S: int, N: int, chosen: list, probing: set, rates: dict, caps: list, plain: float) -> int:
        """The draft length of the chosen step's probes: a probe asks whether its next draft is accepted, so of
        the lengths up to N with which the step still beats plain at the prior, the cheapest (at 8 sequences 1
        draft costs a third of 7 by the H200 table; at 1 sequence 7 costs least); of equal prices the longest
        (beside sequences drafting N the step is priced at N whatever the probes send)."""
        if not probing:
            return N
        best, length = None, N
        for L in sorted({d for d in self.costs.drafts if 0 < d <= N} | {N}):
            n = {i: min(L if i in probing else N, caps[i]) for i in chosen}
            step = max(n.values())
            price = self.prices(S, step)[len(chosen)]
            tokens = S + sum(expected_tokens(rates[i], n[i]) - 1.0 for i in chosen)
            if tokens / price > plain * (1.0 + 1e-9) and (best is None or price <= best * (1.0 + 1e-9)):
                best, length = price, L
        return length


def make_policy(policy, costs, compiled: bool | None = None, learn: bool | None = None) -> FixedDrafting | AdaptiveDrafting:
    """EngineConfig's draft_policy ("fixed", "adaptive" or a policy object), draft_costs (None: the H200
    table of compiled steps when `compiled`, else of uncompiled ones; a StepCosts or a JSON path for
    StepCosts.load, read for compiled or uncompiled steps) and learn_draft_costs (the table as the prior of
    a measured_costs.MeasuredCosts; off unless asked for)."""
    if not isinstance(policy, str):
        return policy
    if policy == "fixed":
        return FixedDrafting()
    default = H200_9B_COMPILED_COSTS if compiled else H200_9B_COSTS
    table = default if costs is None else costs if isinstance(costs, StepCosts) else StepCosts.load(costs, compiled)
    if learn:
        from .measured_costs import MeasuredCosts  # noqa: PLC0415 (it builds on this module's StepCosts)

        table = MeasuredCosts(table)
    return AdaptiveDrafting(table)
