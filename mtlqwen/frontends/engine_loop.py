"""One engine shared by every HTTP client, stepped by one background thread.

The thread loads the model (so the server can listen and answer /health with "loading" meanwhile),
then steps the engine while any request is live. All MLX work happens on that thread. The asyncio
side hands requests over through a thread-safe inbox and reads each request's deltas from its own
asyncio.Queue, which the engine thread feeds with `call_soon_threadsafe`. Requests submitted
between two steps join the next step, so concurrent clients are batched together.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from .metrics import Metrics

log = logging.getLogger("mtlqwen.serve")


@dataclass
class Accepted:
    """The engine took the request (first item on its queue)."""


@dataclass
class Failed:
    """The request was refused (bad for the engine: too long, bad ids...) or the engine died."""

    message: str
    status: int = 400


@dataclass
class _Sink:
    aloop: asyncio.AbstractEventLoop
    aqueue: asyncio.Queue
    arrival: float
    prompt_tokens: int
    last_token: float | None = None


@dataclass
class RequestHandle:
    """The asyncio side of one request: `await next()` yields Accepted/Failed, then Deltas."""

    request_id: str
    owner: "EngineLoop"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False

    async def next(self) -> Any:
        item = await self.queue.get()
        if isinstance(item, Failed) or getattr(item, "finished", False):
            self._close()
        return item

    def cancel(self) -> None:
        """Free the request's slot and blocks (used when its client goes away)."""
        if not self.done:
            self.owner._inbox.put(("cancel", self.request_id))
            self._close()

    def _close(self) -> None:
        if not self.done:
            self.done = True
            self.owner.live -= 1


class EngineLoop:
    """build() -> (engine, tokenizer) runs on the engine thread; `state` is loading / ok / failed."""

    def __init__(self, build: Callable[[], tuple[Any, Any]], metrics: Metrics, load_delay: float = 0.0,
                 on_load_error: Callable[[str], None] | None = None):
        self._build = build
        self.metrics = metrics
        self.load_delay = load_delay
        self.on_load_error = on_load_error
        self.state = "loading"
        self.error: str | None = None
        self.engine = None
        self.tokenizer = None
        self.stats: dict = {}  # replaced (never mutated) after each step: safe to read from any thread
        self.live = 0  # accepted, unfinished requests (asyncio thread only)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stop = threading.Event()
        self._handover = threading.Lock()  # orders submit() against the engine thread's death
        self._thread = threading.Thread(target=self._run, name="mtlqwen-engine", daemon=True)
        self.on_stop: Callable[[Any], None] | None = None  # fn(engine) on the engine thread when it stops

    # ---- asyncio side
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        # on_stop (saving the prefix cache) may write gigabytes: waited for, the files are written whole or not
        self._thread.join(None if self.on_stop is not None else timeout)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) run on the engine thread between steps (operator actions such as clearing the
        prefix cache); its result, or its exception re-raised here."""
        aloop = asyncio.get_running_loop()
        future = aloop.create_future()
        with self._handover:
            if self.state != "ok":
                raise RuntimeError(f"the engine is not running: {self.error or self.state}")
            self._inbox.put(("call", (fn, aloop, future)))
        return await future

    def submit(self, request_id: str, prompt_ids: list[int], params) -> RequestHandle:
        """Queue a request (call from the event loop). The handle's first item says whether it ran."""
        handle = RequestHandle(request_id, self)
        self.live += 1
        sink = _Sink(asyncio.get_running_loop(), handle.queue, time.perf_counter(), len(prompt_ids))
        with self._handover:
            if self.state == "failed":
                handle.queue.put_nowait(Failed(self.error or "the engine is not running", 503))
            else:
                self._inbox.put(("submit", (request_id, prompt_ids, params, sink)))
        return handle

    # ---- engine thread
    def _run(self) -> None:
        try:
            if self.load_delay > 0:  # debugging aid (--debug-load-delay): lets tests observe "loading"
                self._stop.wait(self.load_delay)
            self.engine, self.tokenizer = self._build()
            self.stats = self.engine.stats()
            self.state = "ok"
            log.info("model loaded; serving")
        except Exception as e:  # a load error ends the server with one clear line
            # bad flags or paths read as the CLI's errors do; anything else names its type
            self.error = str(e) if isinstance(e, (ValueError, FileNotFoundError)) else f"{type(e).__name__}: {e}"
            self.state = "failed"
            log.error("model load failed: %s", self.error)
            if self.on_load_error:
                self.on_load_error(self.error)
            return
        engine = self.engine
        try:
            self._serve(engine)
        finally:
            if self.on_stop is not None and self.state == "ok":
                try:
                    self.on_stop(engine)
                except Exception:  # shutting down: said, not raised
                    log.error("on stop: %s", traceback.format_exc())

    def _serve(self, engine) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not engine.has_work())
            except Exception as e:  # a cancel the engine choked on: fail everyone loudly rather than hang them
                self._die(e)
                return
            if self._stop.is_set():
                break
            if engine.has_work():
                try:
                    deltas = engine.step()
                except Exception as e:  # an engine bug the engine did not pin on requests: the same
                    self._die(e)
                    return
                # stats first: a client that reads /metrics right after its last delta sees this step
                self.stats = engine.stats()
                now = time.perf_counter()
                for d in deltas:
                    self._deliver(d, now)
            else:
                self.stats = engine.stats()

    def _drain(self, block: bool) -> None:
        try:
            op, arg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(op, arg)
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, op: str, arg) -> None:
        if op == "submit":
            rid, ids, params, sink = arg
            try:
                self.engine.submit(ids, params, request_id=rid)
            except (ValueError, TypeError) as e:  # the request can never run: the client's to fix
                self._post(sink, Failed(str(e), 400))
                return
            except Exception as e:  # the engine could not take it: this request fails, the loop goes on
                log.error("submit of %s failed\n%s", rid, traceback.format_exc())
                self._post(sink, Failed(f"the engine could not take the request: {type(e).__name__}: {e}", 500))
                return
            self._sinks[rid] = sink
            self.metrics.on_admitted(len(ids))
            self._post(sink, Accepted())
        elif op == "call":
            fn, aloop, future = arg
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # handed to the caller, the engine goes on
                result, error = None, e
            self.stats = self.engine.stats()

            def settle():
                if future.done():
                    return
                future.set_exception(error) if error is not None else future.set_result(result)

            try:
                aloop.call_soon_threadsafe(settle)
            except RuntimeError:
                pass  # the event loop is closed
        elif op == "cancel":
            sink = self._sinks.pop(arg, None)
            if sink is not None:
                self.engine.cancel(arg)  # slot and blocks are free before the next step
                self.metrics.on_finished("abort", time.perf_counter(), sink.arrival)  # vLLM's label

    def _deliver(self, d, now: float) -> None:
        sink = self._sinks.get(d.request_id)
        if sink is None:
            return  # cancelled: nobody is listening
        self.metrics.on_tokens(len(d.token_ids), now, sink.arrival, sink.last_token)
        if d.token_ids:
            sink.last_token = now
        if d.finished:
            del self._sinks[d.request_id]
            cached = (getattr(d.output, "cached_tokens", 0) or 0) if d.output is not None else 0
            self.metrics.on_finished(d.finish_reason or "unknown", now, sink.arrival, cached)
        self._post(sink, d)

    def _die(self, e: Exception) -> None:
        with self._handover:  # no submit slips into the inbox after it is emptied below
            self.error = f"engine failed: {type(e).__name__}: {e}"
            self.state = "failed"
            log.error("%s\n%s", self.error, traceback.format_exc())
            for sink in self._sinks.values():
                self._post(sink, Failed(self.error, 500))
            self._sinks.clear()
            while True:  # requests handed over but never applied get the same answer
                try:
                    op, arg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if op == "submit":
                    self._post(arg[3], Failed(self.error, 500))
                elif op == "call":
                    _, aloop, future = arg
                    failed = RuntimeError(self.error)
                    try:
                        aloop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(failed))
                    except RuntimeError:
                        pass

    @staticmethod
    def _post(sink: _Sink, item) -> None:
        try:
            sink.aloop.call_soon_threadsafe(sink.aqueue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down
