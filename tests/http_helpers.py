"""A live trio-mlx server for tests: the engine and Hypercorn in the test's nursery.

urllib3's pattern: ``nursery.start(partial(hypercorn.trio.serve, app, config,
shutdown_trigger=event.wait))`` binds port 0 and hands back the real address.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import hypercorn.trio
import trio

import trio_mlx
from trio_mlx_http._app import create_app, shutdown_trigger
from trio_mlx_http._run import hypercorn_config
from trio_mlx_http._settings import Settings

#: Keeps the tiny random model from ending early: EOS ids 0 and 2 banned.
NO_EOS: dict[str, int] = {"0": -100, "2": -100}


@attrs.frozen
class LiveServer:
    """A running server: its base URL, its engine, and the event that stops it."""

    url: str
    engine: trio_mlx.Engine
    shutdown: trio.Event
    #: Set once Hypercorn has returned (in-flight requests done or cut off).
    stopped: trio.Event


@asynccontextmanager
async def live_server(
    model: Path,
    settings: Settings | None = None,
    *,
    graceful_timeout: float = 5.0,
    **engine_options: Any,
) -> AsyncIterator[LiveServer]:
    """Serve ``model`` on 127.0.0.1 at a free port for the block's duration."""
    async with trio_mlx.open_engine(model, **engine_options) as engine:
        app = create_app(engine, settings or Settings())
        config = hypercorn_config("127.0.0.1", 0, graceful_timeout)
        shutdown, stopped = trio.Event(), trio.Event()

        async def serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await hypercorn.trio.serve(
                    app,
                    config,
                    shutdown_trigger=shutdown_trigger(app, shutdown),
                    task_status=task_status,
                )
            finally:
                stopped.set()

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve))
            yield LiveServer(binds[0], engine, shutdown, stopped)
            shutdown.set()


def sse_events(raw: bytes) -> list[Any]:
    """Split a complete SSE body into parsed ``data:`` payloads (``"[DONE]"`` kept as text)."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    events: list[Any] = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: "), block[:80]
        assert b"\n" not in block, block[:80]
        data = block[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events
