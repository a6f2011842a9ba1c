"""A live trio-mlx server for tests: the engine and Hypercorn in the test's nursery.

The soak harness has the same needs, so the pieces live there: ``live_server``
(urllib3's pattern: ``nursery.start(hypercorn.trio.serve, ...)`` binds port 0 and
hands back the real address), the SSE body parser, and ``NO_EOS``.
"""

from __future__ import annotations

from soak._answers import NO_EOS
from soak._answers import sse_payloads as sse_events
from soak._inprocess import LiveServer, live_server

__all__ = ["NO_EOS", "LiveServer", "live_server", "sse_events"]
