"""The ``trio-mlx`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from trio_mlx import __version__


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``trio-mlx`` command."""
    parser = argparse.ArgumentParser(
        prog="trio-mlx",
        description="An LLM generation engine for MLX with an OpenAI-compatible server.",
    )
    parser.add_argument("--version", action="version", version=f"trio-mlx {__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0
