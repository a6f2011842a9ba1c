"""An in-process server (engine + Hypercorn in this Trio run), for scenarios that need the engine.

Fault injection goes through ``engine.run_exclusive``, so it needs the engine
object itself; everything else in the harness talks to a subprocess.
"""

from __future__ import annotations

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


@attrs.frozen
class InProcess:
    """A running in-process server."""

    url: str
    engine: trio_mlx.Engine


@asynccontextmanager
async def in_process(
    model: Path | None, settings: Settings | None = None, **options: Any
) -> AsyncIterator[InProcess]:
    """Serve ``model`` on 127.0.0.1 at a free port for the block's duration."""
    async with trio_mlx.open_engine(model, **options) as engine:
        app = create_app(engine, settings or Settings())
        config = hypercorn_config("127.0.0.1", 0, 5.0)
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            serve = partial(
                hypercorn.trio.serve, app, config, shutdown_trigger=shutdown_trigger(app, shutdown)
            )
            binds = await nursery.start(serve)
            try:
                yield InProcess(binds[0], engine)
            finally:
                shutdown.set()
