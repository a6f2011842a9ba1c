"""trio-mlx's OpenAI-compatible HTTP server (Quart-Trio on Hypercorn) and CLI.

It uses only the public API of :mod:`trio_mlx`. To serve an engine from your
own Trio program::

    async with trio_mlx.open_engine(model) as engine, trio.open_nursery() as nursery:
        app = create_app(engine, Settings(api_key="..."))
        stop = trio.Event()
        await nursery.start(partial(hypercorn.trio.serve, app, config,
                                    shutdown_trigger=shutdown_trigger(app, stop)))

The public names are imported on first use, so the ``trio-mlx`` command's
``--help`` (``trio_mlx_http._cli``) loads neither the web stack nor the engine.

:func:`maybe_reexec_with_fast_blas` re-runs a program once with an optimized
BLAS preloaded (Linux); an embedding program calls it first thing, before MLX
is imported (``design/blas.md``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trio_mlx import __version__
    from trio_mlx_http._fast_blas import maybe_reexec_with_fast_blas
    from trio_mlx_http._server.app import create_app, shutdown_trigger
    from trio_mlx_http._settings import Settings

__all__ = [
    "Settings",
    "__version__",
    "create_app",
    "maybe_reexec_with_fast_blas",
    "shutdown_trigger",
]

#: Where each public name lives.
_HOMES = {
    "Settings": "trio_mlx_http._settings",
    "__version__": "trio_mlx._version",
    "create_app": "trio_mlx_http._server.app",
    "maybe_reexec_with_fast_blas": "trio_mlx_http._fast_blas",
    "shutdown_trigger": "trio_mlx_http._server.app",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
