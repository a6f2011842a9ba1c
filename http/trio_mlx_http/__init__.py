"""trio-mlx's OpenAI-compatible HTTP server (Quart-Trio on Hypercorn) and CLI.

It uses only the public API of :mod:`trio_mlx`.
"""

from trio_mlx import __version__

__all__ = ["__version__"]
