"""The bounded in-memory store behind the Responses API's ``store`` and ``previous_response_id``.

A stored response keeps its body (for ``GET /v1/responses/{id}``) and the
conversation it ends (its input messages, without ``instructions``, then its
output as an assistant message), so a later request naming it as
``previous_response_id`` continues that conversation. Both are kept as their
UTF-8 JSON text and parsed again on each read: Python objects take several
times the memory of their JSON (a conversation of short messages about eight
times), so the byte bound is what the store really holds, give or take a
small fixed overhead per entry. The store holds at most ``capacity`` responses
and ``max_bytes`` of them (the whole conversation counted even where it shares
messages with an earlier response) and forgets the least recently used first;
a forgotten id, or one too large to keep at all, is a 400 for the client that
names it, never a silently shorter context. Reads parse what they return, so
call :meth:`ResponseStore.get` off the event loop for a large conversation
(it is thread-safe).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import attrs

from trio_mlx_http._common.images import ImageRef

__all__ = ["DEFAULT_CAPACITY", "DEFAULT_MAX_BYTES", "ResponseStore", "StoredResponse"]

#: Responses kept by default (each holds its whole conversation as text).
DEFAULT_CAPACITY = 1024
#: Bytes of JSON kept by default.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: Bytes counted per entry beyond its JSON: the id, two bytes objects, the map's slot.
_ENTRY_OVERHEAD = 256
#: One stored response: its body's JSON and its conversation's JSON.
_Entry = tuple[bytes, bytes]


@attrs.frozen
class StoredResponse:
    """One stored response."""

    body: dict[str, Any]
    #: Chat messages up to and including this response's output.
    conversation: tuple[dict[str, Any], ...]


def _image_json(value: Any) -> Any:
    """A conversation's image (as the request gave it) in JSON: ``_image_back`` reads it."""
    if isinstance(value, ImageRef):
        return {_IMAGE: attrs.asdict(value)}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _image_back(value: dict[str, Any]) -> Any:
    return ImageRef(**value[_IMAGE]) if len(value) == 1 and _IMAGE in value else value


#: The key a stored image's JSON object has alone.
_IMAGE = "\u0000image"


def _encoded(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_image_json).encode(
        "utf-8", "surrogatepass"
    )


@attrs.define(eq=False)
class ResponseStore:
    """A least-recently-used map from response id to a :class:`StoredResponse`'s JSON."""

    capacity: int = DEFAULT_CAPACITY
    max_bytes: int = DEFAULT_MAX_BYTES
    #: id -> (body JSON, conversation JSON).
    _items: OrderedDict[str, _Entry] = attrs.field(factory=OrderedDict, init=False)
    _bytes: int = attrs.field(default=0, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        if self.capacity < 1 or self.max_bytes < 1:
            raise ValueError(
                f"capacity and max_bytes must be >= 1, not {self.capacity!r}, {self.max_bytes!r}"
            )

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        """The bytes kept: every entry's JSON text and its fixed overhead."""
        return self._bytes

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep ``stored``; forget the least recently used responses while over a bound.

        A response larger than ``max_bytes`` on its own is not kept.
        """
        entry = (_encoded(stored.body), _encoded(list(stored.conversation)))
        size = _size(response_id, entry)
        with self._lock:
            self._delete(response_id)
            if size > self.max_bytes:
                return
            self._items[response_id] = entry
            self._bytes += size
            while len(self._items) > self.capacity or self._bytes > self.max_bytes:
                dropped_id, dropped = self._items.popitem(last=False)
                self._bytes -= _size(dropped_id, dropped)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, parsed anew (now the most recently used), or None."""
        entry = self._take(response_id)
        if entry is None:
            return None
        body, conversation = entry
        messages = json.loads(conversation, object_hook=_image_back)
        return StoredResponse(body=json.loads(body), conversation=tuple(messages))

    def body(self, response_id: str) -> dict[str, Any] | None:
        """Only the stored response's body, parsed anew (now the most recently used), or None."""
        entry = self._take(response_id)
        return None if entry is None else dict(json.loads(entry[0]))

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        with self._lock:
            return self._delete(response_id)

    def _take(self, response_id: str) -> _Entry | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is not None:
                self._items.move_to_end(response_id)
            return entry

    def _delete(self, response_id: str) -> bool:
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= _size(response_id, entry)
        return True


def _size(response_id: str, entry: _Entry) -> int:
    return len(entry[0]) + len(entry[1]) + len(response_id) + _ENTRY_OVERHEAD
