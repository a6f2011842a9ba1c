"""trio-mlx's OpenAI-compatible HTTP server (Quart-Trio on Hypercorn) and CLI.

It uses only the public API of :mod:`trio_mlx`. To serve an engine from your
own Trio program::

    async with trio_mlx.open_engine(model) as engine, trio.open_nursery() as nursery:
        app = create_app(engine, Settings(api_key="..."))
        stop = trio.Event()
        await nursery.start(partial(hypercorn.trio.serve, app, config,
                                    shutdown_trigger=shutdown_trigger(app, stop)))
"""

from trio_mlx import __version__
from trio_mlx_http._app import create_app, shutdown_trigger
from trio_mlx_http._settings import Settings

__all__ = ["Settings", "__version__", "create_app", "shutdown_trigger"]
