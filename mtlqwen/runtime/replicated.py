"""One engine schedule on every rank of a tensor-parallel group, with requests arriving on rank 0 only.

Every rank holds an `Engine` over its shard, built from the same arguments. Rank 0's front-end talks to
a `ReplicatedEngine`: submit / cancel / clear_prefix_cache apply at once (so errors and request ids are
rank 0's, synchronously) and are recorded; each `step()` first broadcasts the recorded operations, then
steps. The other ranks run `follow`: receive the operations, apply them in the same order, step. Engines
are deterministic given the same operations between the same steps (the scheduler is pure Python, the
logits are identical on every rank after the vocabulary gather, sampling seeds come from an engine seed
the ranks agree on), so block pools, prefix cache and scheduler decisions agree without further talk.

A Python program that runs the same code on every rank (e.g. `engine.generate(prompts)` on each) needs
none of this: identical inputs already give identical schedules.
"""

from __future__ import annotations

import atexit
import pickle
import threading

from ..model.distributed import broadcast_bytes

_STOP = "stop"


class ReplicatedEngine:
    """Rank 0's handle on the group's engines (the Engine API the front-ends use). Anything not listed
    here is read from the local engine (stats, config, max_model_len, ...); `generate` / `stream` are
    refused, as they would step rank 0 alone."""

    def __init__(self, engine, group):
        self._engine, self._group = engine, group
        self._ops: list[tuple] = []
        self._closed = False
        self._lock = threading.Lock()  # close() at exit may run on another thread than step()
        atexit.register(self.close)  # the followers stop even when rank 0's front-end raises

    def __getattr__(self, name):
        if name in ("generate", "stream"):
            raise AttributeError(f"{name}() is not available on a replicated engine: use submit() and step() "
                                 "(or call engine.generate with the same prompts on every rank)")
        return getattr(self._engine, name)

    def submit(self, prompt, sampling=None, request_id=None):
        rid = self._engine.submit(prompt, sampling, request_id)  # raises before anything is recorded
        self._ops.append(("submit", prompt, sampling, rid))
        return rid

    def cancel(self, request_id) -> bool:
        done = self._engine.cancel(request_id)
        if done:
            self._ops.append(("cancel", request_id))
        return done

    def clear_prefix_cache(self) -> int:
        self._ops.append(("clear_prefix_cache",))
        return self._engine.clear_prefix_cache()

    def step(self):
        self._send()
        return self._engine.step()

    def _send(self, stop: bool = False) -> None:
        with self._lock:
            if self._closed:
                if stop:
                    return
                raise RuntimeError("the replicated engine is closed: the other ranks have stopped")
            ops, self._ops = self._ops, []
            if stop:
                ops.append((_STOP,))
                self._closed = True
            broadcast_bytes(pickle.dumps(ops), self._group)

    def close(self) -> None:
        """Tell the followers to return (idempotent)."""
        self._send(stop=True)


def follow(engine, group) -> None:
    """A rank other than 0: apply rank 0's operations and step, until rank 0 closes."""
    while True:
        ops = pickle.loads(broadcast_bytes(None, group))
        for op in ops:
            kind = op[0]
            if kind == _STOP:
                return
            if kind == "submit":
                _, prompt, sampling, rid = op
                engine.submit(prompt, sampling, rid)
            elif kind == "cancel":
                engine.cancel(op[1])
            elif kind == "clear_prefix_cache":
                engine.clear_prefix_cache()
            else:
                raise RuntimeError(f"unknown operation from rank 0: {kind!r}")
        engine.step()


def replicate(engine, group):
    """Rank 0: a ReplicatedEngine. Other ranks: follow rank 0 until it closes, then exit the process
    (SystemExit(0)); the front-end code after this call runs on rank 0 only. group None: the engine."""
    if group is None:
        return engine
    if group.rank() == 0:
        return ReplicatedEngine(engine, group)
    follow(engine, group)
    raise SystemExit(0)
