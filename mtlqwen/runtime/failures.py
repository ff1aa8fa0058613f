"""What a failed step does to requests and state.

A step that raises while it is built (host code: packing, graph construction, the sampler) has not run:
the cache's pools are lazy graphs of valid ops, so only the step's sequences are failed and their slots
and blocks freed (a new sequence in the slot starts from zeroed state as always); a verification it
launched is simply dropped with it. A step whose evaluation fails (async_eval at launch or the read-back
raises) leaves pool contents undefined (MLX marks the arrays evaluated with whatever the failed kernel
left), so every running sequence fails and the cache, drafter context and prefix cache start again from
zero. A request whose own sampling raised fails alone. Waiting requests are untouched either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from .outputs import Delta
from .sequence import Sequence, SeqStatus

log = logging.getLogger("mtlqwen.engine")

# the engine's one way to end a request: (sequence, finish reason, tokens, now, error) -> its final Delta
Finish = Callable[..., Delta]


class EvalFailed(Exception):
    """Evaluating a step raised (at launch or at read-back): device state is undefined. `flight`: the
    step being launched, when it was its launch."""

    def __init__(self, cause: Exception, flight=None):
        super().__init__(str(cause))
        self.cause, self.flight = cause, flight


def reason(e: BaseException) -> str:
    """The `error` of a request that failed with e."""
    return f"generation failed: {type(e).__name__}: {e}"


class Failures:
    """The engine's failure paths. finish: the engine's way to end a request (releases its slot and
    blocks); cache: the ModelCache; kv: the KVManager (its prefix entries live in the cache's pools)."""

    def __init__(self, finish: Finish, cache, kv):
        self.finish, self.cache, self.kv = finish, cache, kv

    def step(self, scheduled, e: Exception) -> list[Delta]:
        """A step raised while it was built: its scheduled sequences (ScheduledSeq) still running fail. With
        grouped prefill launches (SELECT "prefill_eval_layers") part of the step may have run; what it wrote
        is these sequences' own (their slots' states, zeroed when a slot is reused; K/V past their kv_valid in
        their own blocks), so the cache needs no reset."""
        log.error("a step failed while it was built; failing its %d requests", len(scheduled), exc_info=e)
        msg, now = reason(e), time.perf_counter()
        return [self.finish(s.seq, "error", [], now, msg) for s in scheduled if s.seq.status is SeqStatus.RUNNING]

    def requests(self, failed: list[tuple[Sequence, Exception]]) -> list[Delta]:
        """Requests whose own sampling raised: they alone fail; the step in flight writes into their freed
        slot and blocks as it would for a cancelled request."""
        now, out = time.perf_counter(), []
        for seq, e in failed:
            log.error("sampling failed for request %r", seq.request_id, exc_info=e)
            if seq.status is not SeqStatus.FINISHED:
                out.append(self.finish(seq, "error", [], now, reason(e)))
        return out

    def device(self, e: Exception, flights: list, live: Iterable[Sequence]) -> list[Delta]:
        """A step's evaluation failed. flights: the engine's in-flight steps (None where absent), dropped
        with their unpublished captures; live: every live sequence. Running ones and those the flights
        compute fail; the cache and the prefix cache are reset."""
        log.error("a step failed on the device; failing the running requests and resetting the cache", exc_info=e)
        msg, now = reason(e), time.perf_counter()
        hit = {seq for f in flights if f is not None for seq in f.seqs}
        for f in flights:
            if f is not None and f.snapshots is not None:  # their bundle references go back
                f.snapshots.discard()
        out = [self.finish(seq, "error", [], now, msg) for seq in list(live)
               if seq.status is SeqStatus.RUNNING or seq in hit]
        self.cache.reset()  # with the drafter's context pools
        self.kv.clear()  # entries' bundles live in the pools just zeroed
        return out
