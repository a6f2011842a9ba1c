"""The bounded in-memory store behind the Responses API's ``store`` and ``previous_response_id``.

A stored response keeps its body (for ``GET /v1/responses/{id}``) and the
conversation it ends (its input messages, without ``instructions``, then its
output as an assistant message), so a later request naming it as
``previous_response_id`` continues that conversation. The store holds at most
``capacity`` responses and ``max_bytes`` of them (each measured as its JSON, the
whole conversation counted even where it shares messages with an earlier
response) and forgets the least recently used first; a forgotten id, or one
too large to keep at all, is a 400 for the client that names it, never a
silently shorter context.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import attrs

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_MAX_BYTES", "ResponseStore", "StoredResponse"]

#: Responses kept by default (each holds its whole conversation as text).
DEFAULT_CAPACITY = 1024
#: Bytes of JSON kept by default.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


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
    max_bytes: int = DEFAULT_MAX_BYTES
    _items: OrderedDict[str, tuple[StoredResponse, int]] = attrs.field(
        factory=OrderedDict, init=False
    )
    _bytes: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if self.capacity < 1 or self.max_bytes < 1:
            raise ValueError(
                f"capacity and max_bytes must be >= 1, not {self.capacity!r}, {self.max_bytes!r}"
            )

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """The measured size of what is kept."""
        return self._bytes

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep ``stored``; forget the least recently used responses while over a bound.

        A response larger than ``max_bytes`` on its own is not kept.
        """
        self.delete(response_id)
        size = len(json.dumps([stored.body, stored.conversation], ensure_ascii=False))
        if size > self.max_bytes:
            return
        self._items[response_id] = (stored, size)
        self._bytes += size
        while len(self._items) > self.capacity or self._bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        entry = self._items.get(response_id)
        if entry is None:
            return None
        self._items.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry[1]
        return True
