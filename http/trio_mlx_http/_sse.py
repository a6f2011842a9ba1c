"""Server-sent events framing, as OpenAI streams it: ``data: <json>\\n\\n`` ... ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["CONTENT_TYPE", "DONE", "SSE_HEADERS", "event"]

#: The last event of every stream.
DONE = b"data: [DONE]\n\n"

CONTENT_TYPE = "text/event-stream; charset=utf-8"

#: Response headers of a stream: no caching, no proxy buffering.
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event; compact JSON never holds a newline, so one line suffices."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )
