"""A request's n choices (OpenAI's `n`, at most api_requests.MAX_CHOICES): n engine requests on one prompt, read as one stream of
(choice index, item); a completion's batch of prompts is n choices for each, grouped by prompt. Choice i samples with seed + i when the request gives a seed (the engine keys its noise
on the seed, so one seed would give n equal replies); the prefix cache computes the shared prompt once for
requests that arrive together. n = 1 is the same path with one handle.
"""

from __future__ import annotations

import asyncio

from .engine_loop import Accepted, Failed, RequestHandle


def choice_ids(rid: str, n: int) -> list[str]:
    """The engine's request ids of a request's choices (the request's own id when n = 1)."""
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


class Choices:
    """The handles of one request's choices, merged: `next()` gives (index, Delta or Failed) as they come."""

    def __init__(self, handles: list[RequestHandle]):
        self.handles = handles
        self.queue: asyncio.Queue = asyncio.Queue()
        self.open = len(handles)
        self.tasks: list[asyncio.Task] = []

    async def accepted(self) -> Failed | None:
        """Each choice's first item: the first refusal (every choice then cancelled), or None when the engine took
        them all; then the choices' items are merged."""
        for h in self.handles:
            first = await h.next()
            if not isinstance(first, Accepted):
                self.cancel()
                return first
        self.tasks = [asyncio.ensure_future(self._pump(i, h)) for i, h in enumerate(self.handles)]
        return None

    async def _pump(self, i: int, h: RequestHandle) -> None:
        while True:
            item = await h.next()
            self.queue.put_nowait((i, item))
            if isinstance(item, Failed) or getattr(item, "finished", False):
                return

    async def next(self) -> tuple[int, object]:
        i, item = await self.queue.get()
        if isinstance(item, Failed) or getattr(item, "finished", False):
            self.open -= 1
        return i, item

    @property
    def done(self) -> bool:
        return self.open == 0

    def cancel(self) -> None:
        """Free every choice's slot and blocks (the client left, or one choice failed the request)."""
        for h in self.handles:
            h.cancel()
        for t in self.tasks:
            t.cancel()
