"""An in-process server (engine + Hypercorn in this Trio run), for scenarios that need the engine
and for the HTTP tests.

Fault injection goes through ``engine.run_exclusive``, so it needs the engine
object itself; everything else in the harness talks to a subprocess.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

import trio_mlx
from trio_mlx_http._app import create_app
from trio_mlx_http._run import hypercorn_config, serve_http
from trio_mlx_http._serve import ConnectionGuard, ConnectionLimits
from trio_mlx_http._settings import Settings


@attrs.frozen
class LiveServer:
    """A running server: its base URL, its engine, and the event that stops it."""

    url: str
    engine: trio_mlx.Engine
    shutdown: trio.Event
    #: Set once Hypercorn has returned (in-flight requests done or cut off).
    stopped: trio.Event
    #: Counts connections, refuses past the cap, times writes out.
    guard: ConnectionGuard


@asynccontextmanager
async def live_server(
    model: Path | None,
    settings: Settings | None = None,
    *,
    graceful_timeout: float = 5.0,
    limits: ConnectionLimits | None = None,
    wrap_asgi: Callable[[Any], Any] | None = None,
    **engine_options: Any,
) -> AsyncIterator[LiveServer]:
    """Serve ``model`` on 127.0.0.1 at a free port for the block's duration.

    ``wrap_asgi`` (the tests' response checker) wraps the app's ASGI callable.
    """
    async with trio_mlx.open_engine(model, **engine_options) as engine:
        app = create_app(engine, settings or Settings())
        if wrap_asgi is not None:
            app.asgi_app = wrap_asgi(app.asgi_app)  # type: ignore[method-assign]
        config = hypercorn_config("127.0.0.1", 0, graceful_timeout)
        shutdown, stopped = trio.Event(), trio.Event()
        guard = ConnectionGuard(limits or ConnectionLimits())

        async def serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await serve_http(app, config, guard, shutdown, task_status=task_status)
            finally:
                stopped.set()

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve)
            try:
                yield LiveServer(binds[0], engine, shutdown, stopped, guard)
            finally:
                shutdown.set()
