"""trio-mlx: an LLM generation engine for MLX, built as a Trio actor.

Public names live here; the implementation sits in private ``_modules``.
The engine never imports the web stack (quart, hypercorn, trio_mlx_http).
"""

from trio_mlx._version import __version__

__all__ = ["__version__"]
