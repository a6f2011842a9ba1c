"""Which BLAS serves MLX's CPU backend, and how to preload an optimized one.

MLX's Linux CPU wheel links a bundled reference (netlib) BLAS. Loading an
optimized CBLAS (OpenBLAS, MKL) ahead of it serves the same ``cblas_sgemm``
symbol many times faster. This module must not import mlx: nox and the CLI use
it before MLX is loaded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

__all__ = ["find_fast_blas", "preload_env"]

#: Debian/Ubuntu locations of an optimized CBLAS, best first.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
)


def find_fast_blas(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the path of an optimized CBLAS on this machine, or None."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return None
    override = env.get("TRIO_MLX_BLAS")
    if override:
        return override if os.path.exists(override) else None
    return next((path for path in _CANDIDATES if os.path.exists(path)), None)


def preload_env(environ: dict[str, str]) -> dict[str, str]:
    """Return ``environ`` with an optimized BLAS added to ``LD_PRELOAD`` when one exists."""
    if environ.get("TRIO_MLX_FAST_BLAS", "1") == "0":
        return environ
    path = find_fast_blas(environ)
    if path is None:
        return environ
    preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
    if path not in preload:
        environ["LD_PRELOAD"] = ":".join([path, *preload])
    return environ
