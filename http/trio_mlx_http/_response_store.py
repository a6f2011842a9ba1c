"""The bounded in-memory store behind the Responses API's ``store`` and ``previous_response_id``.

A stored response keeps its body (for ``GET /v1/responses/{id}``) and the
conversation it ends (its input messages, without ``instructions``, then its
output as an assistant message), so a later request naming it as
``previous_response_id`` continues that conversation. The store holds at most
``capacity`` responses and forgets the least recently used first; a forgotten
id is a 400 for the client that names it, never a silently shorter context.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

__all__ = ["DEFAULT_CAPACITY", "ResponseStore", "StoredResponse"]

#: Responses kept by default (each holds its whole conversation as text).
DEFAULT_CAPACITY = 1024


@attrs.frozen
class StoredResponse:
    """One stored response."""

    body: dict[str, Any]
    #: Chat messages up to and including this response's output.
    conversation: tuple[dict[str, Any], ...]


@attrs.define(eq=False)
class ResponseStore:
    """A least-recently-used map from response id to :class:`StoredResponse`."""

    capacity: int = DEFAULT_CAPACITY
    _items: OrderedDict[str, StoredResponse] = attrs.field(factory=OrderedDict, init=False)

    def __attrs_post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {self.capacity!r}")

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep ``stored``; forget the least recently used response if full."""
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        return self._items.pop(response_id, None) is not None
