"""The Responses API's stored responses (`store`, `previous_response_id`, GET / DELETE /v1/responses/{id}): each
finished response kept in memory with the conversation it ends, the least recently used dropped past a count.

What is kept for a response: its body (what GET returns) and its conversation as Responses input items: the items
of the response it continued, the request's input, then its output items. A request naming it as
`previous_response_id` continues that conversation with its own input; the `instructions` are the new request's
only (OpenAI's rule). The chat template renders the continued conversation as the client would have sent it whole,
so its prompt extends the previous one's and the prefix cache restores it (a turn entry).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_STORED = 1024


class ResponseStore:
    """At most `capacity` responses (0: none kept); called from the event loop and worker threads alike."""

    def __init__(self, capacity: int = DEFAULT_STORED):
        if capacity < 0:
            raise ValueError(f"the stored responses' capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, body: dict, conversation: list[dict]) -> None:
        """A finished response's body and the input items of its whole conversation, its output included."""
        if not self.capacity:
            return
        with self._lock:
            self._items[body["id"]] = (body, conversation)
            self._items.move_to_end(body["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def conversation(self, rid: str) -> list[dict] | None:
        with self._lock:
            got = self._items.get(rid)
            if got is not None:
                self._items.move_to_end(rid)
            return None if got is None else list(got[1])

    def body(self, rid: str) -> dict | None:
        with self._lock:
            got = self._items.get(rid)
            return None if got is None else got[0]

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)
