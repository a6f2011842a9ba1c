"""Test support for programs that serve trio-mlx over HTTP: a live server and an SSE parser.

:func:`live_server` runs the engine and Hypercorn in the caller's Trio run, bound
to 127.0.0.1 at a free port (urllib3's pattern: ``nursery.start`` of the server,
port 0, the real address read back), so a test or a harness talks to a real
server with a real client, and can still reach the :class:`~trio_mlx.Engine`
(for fault injection through ``engine.run_exclusive``). :func:`sse_events`
splits a complete ``text/event-stream`` body into its payloads, strictly: a
truncated stream or a block that is not one ``data:`` line is an error.
The project's tests and its soak harness both use this module.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

import trio_mlx
from trio_mlx_http._server.app import create_app
from trio_mlx_http._server.run import hypercorn_config, serve_http
from trio_mlx_http._server.serve import ConnectionGuard, ConnectionLimits
from trio_mlx_http._settings import Settings

__all__ = ["NO_EOS", "LiveServer", "live_server", "sse_events"]

#: A ``logit_bias`` that keeps the bundled model (and ``trio_mlx.testing``'s fixture
#: model) from ending early: its EOS ids 0 and 2 banned.
NO_EOS: dict[str, int] = {"0": -100, "2": -100}


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
    #: The model host, for a server of several models (``live_server(hosted=...)``).
    host: trio_mlx.ModelHost | None = None


@asynccontextmanager
async def live_server(
    model: Path | None,
    settings: Settings | None = None,
    *,
    graceful_timeout: float = 5.0,
    limits: ConnectionLimits | None = None,
    wrap_asgi: Callable[[Any], Any] | None = None,
    hosted: Mapping[str, Any] | None = None,
    **engine_options: Any,
) -> AsyncIterator[LiveServer]:
    """Serve ``model`` (``None``: the bundled one) on 127.0.0.1 at a free port for the block.

    ``engine_options`` go to :func:`trio_mlx.open_engine`; ``wrap_asgi`` wraps the
    app's ASGI callable (e.g. a checker of every response). Leaving the block
    stops the server (``graceful_timeout`` for in-flight requests), then the engine.
    ``hosted`` serves several models instead: :func:`trio_mlx.open_host`'s keywords
    (``model`` is then ignored; ``engine`` is the default model's).
    """
    async with contextlib.AsyncExitStack() as stack:
        host: trio_mlx.ModelHost | None = None
        if hosted is None:
            engine = await stack.enter_async_context(trio_mlx.open_engine(model, **engine_options))
        else:
            host = await stack.enter_async_context(trio_mlx.open_host(**hosted, **engine_options))
            engine = host.loaded(host.default)  # type: ignore[assignment]
        app = create_app(host or engine, settings or Settings())
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
                yield LiveServer(binds[0], engine, shutdown, stopped, guard, host)
            finally:
                shutdown.set()


def sse_events(raw: bytes) -> list[Any]:
    """Split a complete SSE body into its ``data:`` payloads (``"[DONE]"`` kept as text).

    A block of one comment line (``: keep-alive``, what the server sends while a
    stream waits) is skipped, as SSE clients skip it.

    Raises:
        ValueError: the body is truncated, or a block is not exactly one ``data:`` line.
    """
    if not raw.endswith(b"\n\n"):
        raise ValueError(f"truncated stream: {raw[-80:]!r}")
    events: list[Any] = []
    for block in raw[:-2].split(b"\n\n"):
        if block.startswith(b":") and b"\n" not in block:
            continue
        if not block.startswith(b"data: ") or b"\n" in block:
            raise ValueError(f"not one data line: {block[:80]!r}")
        data = block[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events
