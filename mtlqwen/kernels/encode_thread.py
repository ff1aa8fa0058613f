"""An encoder thread: MLX encodes one group of an eager forward's layers while the host builds the next.

A prefill step's host time is the Python that builds its graph plus MLX's encoding of its launches, one
after the other on one thread (benchmarks/prefix_cache.md: 11.7 + 20.4 ms for the 9B warm prefix hit's
step on the H200). `mx.async_eval` releases the GIL while it encodes, so a second thread can encode group k
while the engine's thread builds group k + 1.

MLX keeps one command encoder per stream and thread; a stream made by `mx.new_thread_unsafe_stream` has one
encoder for every thread, and MLX leaves the locking to us. The protocol that makes that safe:
- every array the worker may evaluate is built on `EncodeThread.stream` (the engine runs its steps and its
  construction under `mx.stream(...)`), so the worker never meets another thread's stream;
- while the worker holds submitted groups, the engine's thread only builds (no eval, no read-back): `scope`
  drains the worker before the step's last evaluation and read-back, on errors too, and code that must
  evaluate while it builds (a kernel's first-use check, dispatch.py) calls `quiesce()` first;
- groups are encoded in submission order, each after the ones it reads from.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading

import mlx.core as mx

_local = threading.local()  # the engine thread's EncodeThread inside scope(), per building thread
# How often CPython lets another thread take the GIL while the engine's thread builds (5 ms by default):
# the worker needs the GIL for a moment between two groups, and would otherwise wait for the builder.
SWITCH_INTERVAL_S = 1e-4


class EncodeThread:
    """One worker thread that runs `mx.async_eval` on the groups submitted to it, in order."""

    def __init__(self, device: mx.Device | None = None):
        self.stream = mx.new_thread_unsafe_stream(device if device is not None else mx.default_device())
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self.groups = 0  # groups encoded on the worker since construction (tests, stats)
        self._thread = threading.Thread(target=self._work, name="mtlqwen-encode", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            arrays = self._queue.get()
            if arrays is None:
                return
            try:
                if self._error is None:  # after a failure the rest of the step is dropped, not encoded
                    mx.async_eval(*arrays)
                    self.groups += 1
            except BaseException as e:  # noqa: BLE001 - handed to the engine's thread at drain()
                self._error = e
            finally:
                del arrays
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def submit(self, *arrays: mx.array) -> None:
        """Encode these arrays' graph on the worker (mx.async_eval there), after the groups before them."""
        with self._idle:
            self._pending += 1
        self._queue.put(arrays)

    def wait_idle(self) -> None:
        """Wait until every submitted group is encoded (or dropped after an error)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def drain(self, raise_error: bool = True) -> None:
        """Wait until every submitted group is encoded; then raise the worker's first error, if any."""
        self.wait_idle()
        err, self._error = self._error, None
        if err is not None and raise_error:
            raise err

    def close(self) -> None:
        self.drain(raise_error=False)
        self._queue.put(None)
        self._thread.join()


def settle(obj) -> int:
    """Evaluate every array reachable from obj (attributes, lists, tuples, dicts), here: whatever the model
    built lazily on this thread's stream (e.g. a norm's 1 + w) then reads as evaluated data on the worker.
    Returns how many arrays it found."""
    found, seen, todo = [], set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, mx.array):
            found.append(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and type(o).__module__.startswith("mtlqwen"):
            todo.extend(vars(o).values())
    mx.eval(found)
    return len(found)


@contextlib.contextmanager
def scope(encoder: EncodeThread | None):
    """Inside: eval_group() hands groups to `encoder` (None: evaluates them on this thread). On exit the
    worker is drained, so that the caller may evaluate or read back; an error the worker met is raised
    here, unless another error is already on its way out."""
    if encoder is None:
        yield
        return
    prev, _local.encoder = getattr(_local, "encoder", None), encoder
    _short_switches(+1)
    ok = False
    try:
        yield
        ok = True
    finally:
        _local.encoder = prev
        _short_switches(-1)
        encoder.drain(raise_error=ok)


_switch = {"scopes": 0, "saved": None}
_switch_lock = threading.Lock()


def _short_switches(delta: int) -> None:
    """The process's switch interval is short while any thread is inside a scope: set by the first to
    enter, restored by the last to leave (engines on several threads)."""
    with _switch_lock:
        if _switch["scopes"] == 0:
            _switch["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch["saved"], SWITCH_INTERVAL_S))
        _switch["scopes"] += delta
        if _switch["scopes"] == 0:
            sys.setswitchinterval(_switch["saved"])


def quiesce() -> None:
    """Call before this thread evaluates anything while it builds (a kernel's first-use check, a table grown on
    demand): inside a scope, waits until the worker has encoded every group, so that the stream's one encoder
    is free. Errors stay with the worker, for the scope's drain."""
    encoder = getattr(_local, "encoder", None)
    if encoder is not None:
        encoder.wait_idle()


def threaded() -> bool:
    """Whether this thread's eager forward hands its groups to an encoder thread."""
    return getattr(_local, "encoder", None) is not None


def eval_group(*arrays: mx.array) -> None:
    """Launch what an eager forward built so far: on the encoder thread inside scope(), else here."""
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        mx.async_eval(*arrays)
    else:
        encoder.submit(*arrays)
