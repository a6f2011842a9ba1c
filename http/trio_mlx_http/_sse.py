"""Server-sent events framing, as OpenAI streams it: ``data: <json>\\n\\n`` ... ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CONTENT_TYPE", "DONE", "SSE_HEADERS", "event", "named_event"]

#: The last event of every stream.
DONE = b"data: [DONE]\n\n"

CONTENT_TYPE = "text/event-stream; charset=utf-8"

#: Response headers of a stream: no caching, no proxy buffering.
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


#: Characters that JSON allows raw but that line splitters such as Python's
#: ``str.splitlines`` (used by httpx's ``aiter_lines``) treat as line breaks.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event on exactly one line, whatever text the model produced."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return b"data: " + body.encode() + b"\n\n"


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    """One ``event: <name>`` + ``data:`` event, as the Responses and Anthropic streams send them."""
    return b"event: " + name.encode() + b"\n" + event(payload)
