"""A lower bound on what a prompt renders to, counted before rendering it.

A chat template writes out every message's text, tool calls, content parts and
tool results, and the tool definitions: each string value in them reaches the
rendered text (a template that drops a field only makes the bound generous).
So the UTF-8 bytes of every string value and one byte per other scalar are
about the rendered text's bytes at least, and counting them is a walk over the
parsed request, far cheaper than rendering and tokenizing it. Keys do not
count, nor the values of ``"type"`` (a discriminator a template branches on,
``"function"``, ``"text"``, rarely prints).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["rendered_bytes", "utf8_size"]


def utf8_size(text: str) -> int:
    """The UTF-8 size of ``text`` (lone surrogates counted as three bytes)."""
    return len(text.encode("utf-8", "surrogatepass"))


def rendered_bytes(value: Any, cap: int, *, keys: bool = False) -> int:
    """At most the bytes ``value`` renders to; the count stops once past ``cap``.

    Every string inside mappings and sequences counts its UTF-8 bytes, every
    other scalar one byte. Keys and ``"type"`` values count only with ``keys``
    (tool definitions: templates write them whole, as JSON). The walk keeps its own stack, so
    deep nesting costs no recursion.
    """
    total = 0
    stack: list[Any] = [value]
    while stack and total <= cap:
        item = stack.pop()
        if isinstance(item, str):
            total += utf8_size(item)
        elif isinstance(item, Mapping):
            if keys:
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(v for k, v in item.items() if k != "type")
        elif isinstance(item, Sequence) and not isinstance(item, bytes | bytearray):
            stack.extend(item)
        elif item is not None:
            total += 1
    return total
