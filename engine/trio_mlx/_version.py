"""The version of trio-mlx, read by the build backend."""

__version__ = "0.1.0"
