"""A live trio-mlx server for tests: the engine and Hypercorn in the test's nursery.

The pieces are public, in :mod:`trio_mlx_http.testing` (the soak harness uses them
too): ``live_server`` (urllib3's pattern: ``nursery.start`` of the server binds
port 0 and hands back the real address), the SSE body parser, and ``NO_EOS``.

Here ``live_server`` also checks every body and stream event the OpenAI
endpoints send against OpenAI's response schemas (``openai_schemas.py``): a
test whose server sent a non-conforming answer fails when its block ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from openai_schemas import SchemaChecker
from trio_mlx_http._settings import Settings
from trio_mlx_http.testing import NO_EOS, LiveServer, sse_events
from trio_mlx_http.testing import live_server as _live_server

__all__ = ["NO_EOS", "LiveServer", "live_server", "sse_events"]


@asynccontextmanager
async def live_server(
    model: Path | None, settings: Settings | None = None, **options: Any
) -> AsyncIterator[LiveServer]:
    """Serve ``model`` on 127.0.0.1; every OpenAI-endpoint answer is schema-checked."""
    checker = SchemaChecker()
    async with _live_server(model, settings, wrap_asgi=checker.wrap, **options) as server:
        yield server
    assert not checker.problems, "answers that break OpenAI's schema:\n" + "\n".join(
        checker.problems[:20]
    )
