"""Step costs the engine learns from its own steps: the adaptive draft policy's table corrected online.

The default table (draft_policy.H200_9B_COMPILED_COSTS) was measured for one pair on one machine. Another
model, drafter or back-end has other ratios: the trained demo pair's speculative step cost several plain
steps where an earlier 9B table said 1.6, and with that table the adaptive policy drafted at half the plain
speed (benchmarks/demo_pair.md). So the engine times its pure decode steps and the policy prices a step as

    step(S, k, N) = rho(N, b(S)) * prior(S, k, N)

prior the table's cost (c(S, 0) + extra(k, N)), b(S) the table's nearest batch (in log scale) and rho(N, b)
the median of the last `window` observed / prior ratios of steps with that draft length (N = 0: plain) at
that batch. A draft length not seen enough at its batch costs the interpolation of the two seen speculative
lengths around it, else the nearest seen length's ratio, else (none seen) the plain one's. An unseen plain
column, or a batch with nothing seen, keeps the table's cost (ratio 1): where that is wrong, the choices it
leads to are timed and correct it (a slower machine's speculative steps look dearer than plain, so plain
steps run and are seen). One case would never correct itself: speculative steps seen faster than the table
says while plain ones are unseen, so the policy runs plain steps at that batch until they are seen
(`plain_unseen`). The first observation of each shape is dropped (new shapes compile); the median rides
over later recompiles.

`StepTimer` turns the engine's read-backs into observations: a step's time is the wall time between its
read-back and the previous one (what a step costs in steady state, pipelined or not), kept only when the
engine was stepping the whole time: host gaps between step calls (an idle server, a slow consumer) above a
quarter of the interval drop it. Observations reach the table at the start of the next step call, so that
within a call the engine's question "might the policy draft?" (which costs a read-back before scheduling)
and the policy's choice after it see the same costs: on the H200 a fresh observation between the two
flipped near-ties, and every other plain step gave up its pipelining for a choice not made.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from .draft_policy import StepCosts


class MeasuredCosts:
    """A StepCosts prior corrected by observed step times (module docstring). Reads as the policy's table:
    `drafts`, `seqs`, `step(S, k, N)`; `observe(S, k, N, seconds)` feeds it."""

    def __init__(self, prior: StepCosts, window: int = 9, min_seen: int = 2):
        if not isinstance(prior, StepCosts):
            raise TypeError(f"prior must be a StepCosts, got {type(prior).__name__}")
        if window < 1 or not 1 <= min_seen <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_seen <= window (got {window}, {min_seen})")
        self.prior, self.window, self.min_seen = prior, window, min_seen
        self._ratios: dict[tuple[int, int], deque] = {}  # (N, batch) -> recent observed / prior
        self._seen: set[tuple[int, int, int]] = set()  # (S, k, N) shapes observed once (their first is dropped)
        self.version = 0  # moves with every kept observation (AdaptiveDrafting keeps prices until it does)
        self._medians: dict[int, dict[int, float]] = {}  # batch -> {N: median ratio}, at this version

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.prior.drafts

    @property
    def seqs(self) -> tuple[int, ...]:
        return self.prior.seqs

    def bucket(self, S: int) -> int:
        """The table's batch nearest S in log scale (ties: the smaller)."""
        return min(self.seqs, key=lambda b: (abs(math.log(max(S, 1) / b)), b))

    def observe(self, S: int, k: int, N: int, seconds: float) -> None:
        """One pure decode step: S decoding sequences, k of them speculating with up to N drafts (k = 0 or
        N = 0: plain), `seconds` its wall time."""
        if S < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        N = N if k > 0 else 0
        N = min(N, self.drafts[-1])
        shape = (S, k if N else 0, N)
        if shape not in self._seen:  # its first step built the trace and compiled the kernels
            self._seen.add(shape)
            return
        ratio = 1e3 * seconds / self.prior.step(S, k, N)  # the tables are in ms
        self._ratios.setdefault((N, self.bucket(S)), deque(maxlen=self.window)).append(ratio)
        self.version += 1
        self._medians = {}

    def ratio(self, N: int, b: int) -> float:
        """rho(N, b): the observed / prior ratio the policy prices with (module docstring's fallbacks)."""
        seen = self._medians.get(b)
        if seen is None:
            seen = self._medians[b] = {n: statistics.median(r) for (n, bb), r in self._ratios.items()
                                       if bb == b and len(r) >= self.min_seen}
        if N in seen:
            return seen[N]
        if N == 0 or not seen:  # the table's own cost: where it is wrong, the steps it leads to are seen and correct it
            return 1.0
        lo = max((n for n in seen if 0 < n < N), default=None)
        hi = min((n for n in seen if n > N), default=None)
        if lo is None and hi is None:  # no speculative step seen: plain's ratio (the table's shape)
            return seen[0]
        if lo is None or hi is None:  # outside the lengths seen: the nearest one's ratio
            return seen[hi if lo is None else lo]
        # between two lengths seen: their costs interpolated (not from plain, which has no speculative step's
        # fixed part: an unseen length would look as cheap as plain and be tried again and again)
        full = {n: self.prior.step(b, b, n) for n in (lo, hi, N)}
        c_lo, c_hi = seen[lo] * full[lo], seen[hi] * full[hi]
        return (c_lo + (c_hi - c_lo) * (N - lo) / (hi - lo)) / full[N]

    def plain_unseen(self, S: int) -> bool:
        """Speculative steps are seen at S's batch and plain ones are not: the policy then runs plain steps until
        they are. Priced by the table, plain would look dear beside speculative steps seen faster than the table
        (the demo pair's were 4x faster on an H100) and would never run to correct it."""
        b = self.bucket(S)
        counts = {n: len(r) for (n, bb), r in self._ratios.items() if bb == b}
        return counts.get(0, 0) < self.min_seen and any(c >= self.min_seen for n, c in counts.items() if n)

    def step(self, S: int, k: int, N: int) -> float:
        """Cost of a step of S decoding sequences, k speculating with N drafts (the prior's units)."""
        N = N if k > 0 else 0
        return self.ratio(N, self.bucket(S)) * self.prior.step(S, k, N)

    def summary(self) -> dict:
        """{"N@b": [ratio, observations]} of every key observed (engine.stats())."""
        return {f"{n}@{b}": [round(statistics.median(r), 3), len(r)] for (n, b), r in sorted(self._ratios.items())}


def decode_shape(scheduled) -> tuple[int, int, int] | None:
    """(rows, speculating rows, their most drafts) of a step in which every scheduled sequence decodes (its
    anchor plus its drafts, sampled); None when any row prefills."""
    if not scheduled or any(s.num_tokens != 1 + s.drafts or not s.samples for s in scheduled):
        return None
    n = [s.drafts for s in scheduled]
    return len(n), sum(1 for d in n if d > 0), max(n)


class StepTimer:
    """The engine's clock for MeasuredCosts (module docstring): `call_started` / `call_ended` around each
    Engine._step, `read_back(shape)` after each step's read-back; shape (S, k, N) for a pure decode step,
    None for one with prefill chunks (timed for no one, though it still ends an interval)."""

    def __init__(self, observe, max_gap_share: float = 0.25, clock=time.perf_counter):
        self.observe, self.max_gap_share, self.clock = observe, max_gap_share, clock
        self._last_done: float | None = None  # the previous read-back
        self._gaps = 0.0  # host time between step calls since then
        self._call_end: float | None = None
        self._pending: list[tuple] = []  # this call's observations, handed over at the next call's start

    def call_started(self) -> None:
        if self._call_end is not None:
            self._gaps += self.clock() - self._call_end
        pending, self._pending = self._pending, []
        for obs in pending:
            self.observe(*obs)

    def call_ended(self) -> None:
        self._call_end = self.clock()

    def read_back(self, shape: tuple[int, int, int] | None) -> None:
        now = self.clock()
        if self._last_done is not None and shape is not None:
            interval = now - self._last_done
            if interval > 0 and self._gaps <= self.max_gap_share * interval:
                self._pending.append((*shape, interval))
        self._last_done, self._gaps = now, 0.0
