"""Which BLAS serves MLX's CPU backend, and how to preload an optimized one.

Theory of operation
-------------------
MLX's Linux CPU wheel (``mlx-cpu``) links a bundled reference (netlib) BLAS,
``mlx_cpu.libs/libblas-<hash>.so.3.10.0``, and every CPU matmul calls its
``cblas_sgemm``. That is the standard CBLAS symbol, so an optimized CBLAS
(OpenBLAS, MKL) that is in the process's *global* symbol scope before
``libmlx.so`` is loaded serves the call instead: 4-5x faster decoding and
~19x faster training on a small llama. ``LD_PRELOAD`` is the one way to put it
there, and the dynamic loader reads it only when a process starts; hence:

* :func:`find_fast_blas` finds an optimized CBLAS on this machine,
* :func:`preload_env` adds it to an environment (nox sessions use it),
* :func:`backend_info` reports what is active in this process: it asks the
  dynamic loader which library serves ``cblas_sgemm`` to ``libmlx.so``.

Re-executing a process with the preload is start-up policy, not engine: it
lives with the CLI (``trio_mlx_http._fast_blas``), which uses the finding half
of this module. Everything except :func:`backend_info` works without importing
mlx: nox's own Python and the CLI use this module before MLX is loaded.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping
from typing import Literal

import attrs

__all__ = [
    "OPT_OUT_VAR",
    "BackendInfo",
    "add_preload",
    "backend_info",
    "bundled_reference_blas",
    "classify_blas",
    "find_fast_blas",
    "preload_env",
    "preloads_fast_blas",
]


BlasKind = Literal["reference", "openblas", "mkl", "accelerate", "unknown"]

#: ``0`` turns the whole mechanism off (no preload, no re-exec, no hint).
OPT_OUT_VAR = "TRIO_MLX_FAST_BLAS"
#: An explicit CBLAS to preload instead of the ones found at the usual places.
OVERRIDE_VAR = "TRIO_MLX_BLAS"

#: OpenBLAS threads: the core count (OpenBLAS's own default), unless set. Measured on
#: 2 cores: 1 thread decodes 0-15% faster at B=1 and 8 (the
#: Python thread, which builds the next step while MLX computes, competes with the
#: second BLAS thread), equal at B=32; but the core count makes a 1024^3 matmul 2x,
#: prefill 2x and a training step 1.35x faster. MLX's CPU backend runs its ops on
#: one stream thread, so BLAS threads are the only parallelism it gets.
OPENBLAS_THREADS_VAR = "OPENBLAS_NUM_THREADS"

#: Optimized CBLAS libraries at their usual places, best first: Debian/Ubuntu
#: OpenBLAS (pthread, then OpenMP), Fedora/RHEL and Arch OpenBLAS, then MKL's
#: single dynamic library (oneAPI, Debian's intel-mkl, pip/conda ``mkl``).
_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_MKL_CANDIDATES = (
    "/opt/intel/oneapi/mkl/latest/lib/libmkl_rt.so.2",
    "/opt/intel/oneapi/mkl/latest/lib/intel64/libmkl_rt.so.2",
    "/usr/lib/x86_64-linux-gnu/libmkl_rt.so",
)


def _candidates() -> tuple[str, ...]:
    # pip/conda's ``mkl`` wheel lands in the environment's lib directory.
    prefix_mkl = tuple(
        os.path.join(prefix, "lib", "libmkl_rt.so.2")
        for prefix in dict.fromkeys((sys.prefix, os.environ.get("CONDA_PREFIX", "")))
        if prefix
    )
    return (*_OPENBLAS_CANDIDATES, *_MKL_CANDIDATES, *prefix_mkl)


def classify_blas(path: str | None) -> BlasKind:
    """Return which kind of BLAS the library at ``path`` is, from its (resolved) name."""
    if not path:
        return "unknown"
    names = {path.lower(), os.path.realpath(path).lower()}
    if any("mlx_cpu.libs" in name or "/libblas-" in name for name in names):
        return "reference"
    if any("openblas" in name for name in names):
        return "openblas"
    if any("mkl" in name for name in names):
        return "mkl"
    if any("accelerate" in name or "veclib" in name for name in names):
        return "accelerate"
    return "unknown"


def find_fast_blas(environ: Mapping[str, str] | None = None) -> str | None:
    """Return the path of an optimized CBLAS on this machine, or None.

    ``TRIO_MLX_BLAS`` names one explicitly; when set, it is the only candidate.
    """
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return None
    override = env.get(OVERRIDE_VAR)
    if override:
        return override if os.path.exists(override) else None
    return next((path for path in _candidates() if os.path.exists(path)), None)


def _preloaded(environ: Mapping[str, str]) -> list[str]:
    return [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def preloads_fast_blas(environ: Mapping[str, str]) -> bool:
    """Whether ``LD_PRELOAD`` in ``environ`` names an optimized BLAS (OpenBLAS or MKL)."""
    return any(classify_blas(p) in ("openblas", "mkl") for p in _preloaded(environ))


def preload_env(environ: dict[str, str]) -> dict[str, str]:
    """Return ``environ`` with an optimized BLAS added to ``LD_PRELOAD`` when one exists.

    Leaves ``environ`` alone when ``TRIO_MLX_FAST_BLAS=0`` or when an optimized
    BLAS is preloaded already. Otherwise also sets the thread count (keeping an
    explicit ``OPENBLAS_NUM_THREADS``) and, for MKL, the LP64 interface MLX calls.
    """
    if environ.get(OPT_OUT_VAR, "1") == "0" or preloads_fast_blas(environ):
        return environ
    path = find_fast_blas(environ)
    return environ if path is None else add_preload(environ, path)


def add_preload(environ: dict[str, str], path: str) -> dict[str, str]:
    """Put ``path`` first in ``environ``'s ``LD_PRELOAD``, with the thread settings it needs."""
    environ["LD_PRELOAD"] = ":".join([path, *_preloaded(environ)])
    environ.setdefault(OPENBLAS_THREADS_VAR, str(os.cpu_count() or 1))
    if classify_blas(path) == "mkl":
        environ.setdefault("MKL_INTERFACE_LAYER", "LP64")  # MLX passes 32-bit ints
    return environ


def bundled_reference_blas() -> str | None:
    """Return the reference BLAS the installed ``mlx-cpu`` wheel bundles, without importing mlx."""
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        libs = os.path.join(os.path.dirname(location), "mlx_cpu.libs")
        found = sorted(glob.glob(os.path.join(libs, "libblas-*.so*")))
        if found:
            return found[0]
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


class _DlPhdrInfo(ctypes.Structure):
    _fields_ = (("dlpi_addr", ctypes.c_void_p), ("dlpi_name", ctypes.c_char_p))


_PhdrCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_DlPhdrInfo), ctypes.c_size_t, ctypes.c_void_p
)


def _loaded_objects(libc: ctypes.CDLL) -> list[str]:
    """Shared objects of this process in link-map (load) order."""
    names: list[str] = []

    def visit(info: ctypes._Pointer[_DlPhdrInfo], size: int, data: int | None) -> int:
        names.append((info.contents.dlpi_name or b"").decode(errors="replace"))
        return 0

    libc.dl_iterate_phdr(_PhdrCallback(visit), None)
    return names


def _provider(libc: ctypes.CDLL, handle: int | None, symbol: bytes) -> str | None:
    libc.dlsym.restype = ctypes.c_void_p
    libc.dlsym.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
    libc.dladdr.argtypes = (ctypes.c_void_p, ctypes.POINTER(_DlInfo))
    address = libc.dlsym(handle, symbol)
    info = _DlInfo()
    if not address or not libc.dladdr(address, ctypes.byref(info)):
        return None
    name: bytes | None = info.dli_fname
    return os.path.normpath(name.decode(errors="replace")) if name else None


def _linux_active_blas(libmlx: str) -> str | None:
    """The library that serves ``cblas_sgemm`` to ``libmlx.so`` in this process.

    libmlx.so is loaded RTLD_LOCAL by the mlx extension, so its calls bind to the
    global scope first (the executable and LD_PRELOAD'ed objects), then to its
    own dependencies. A global provider counts only if it was loaded before
    libmlx (symbols are bound when libmlx is loaded: Python dlopens with RTLD_NOW).
    """
    libc = ctypes.CDLL(None)
    global_provider = _provider(libc, None, b"cblas_sgemm")
    if global_provider is not None:
        order = [os.path.realpath(name) for name in _loaded_objects(libc) if name]
        where = {name: i for i, name in reversed(list(enumerate(order)))}
        mine, theirs = (
            where.get(os.path.realpath(libmlx)),
            where.get(os.path.realpath(global_provider)),
        )
        if mine is None or theirs is None or theirs < mine:
            return global_provider
    own = ctypes.CDLL(libmlx)  # already loaded: this only takes a reference
    return _provider(libc, own._handle, b"cblas_sgemm")


def _blas_threads(path: str | None, kind: BlasKind) -> int | None:
    function = {"openblas": "openblas_get_num_threads", "mkl": "mkl_get_max_threads"}.get(kind)
    if kind == "reference":
        return 1
    if function is None or path is None:
        return None
    try:
        getter = getattr(ctypes.CDLL(path), function)
    except (OSError, AttributeError):
        return None
    getter.restype = ctypes.c_int
    return int(getter())


@attrs.frozen
class BackendInfo:
    """A snapshot of what serves MLX in this process (see :func:`backend_info`)."""

    #: ``sys.platform`` and the machine, e.g. ``linux-x86_64``.
    platform: str
    #: MLX's default device, e.g. ``cpu`` or ``gpu``.
    device: str
    #: Which BLAS serves MLX's CPU matmuls.
    blas: BlasKind
    #: The library file that serves ``cblas_sgemm``; None when unknown (or Accelerate).
    blas_path: str | None
    #: Whether that library came in through ``LD_PRELOAD``.
    preloaded: bool
    #: The BLAS's thread count, when it can be asked.
    threads: int | None

    def describe(self) -> str:
        """One line for a log."""
        where = f" ({self.blas_path})" if self.blas_path else ""
        how = ", preloaded" if self.preloaded else ""
        threads = f", {self.threads} threads" if self.threads is not None else ""
        return f"MLX on {self.device} [{self.platform}]: BLAS {self.blas}{where}{how}{threads}"


def backend_info() -> BackendInfo:
    """Return which device and BLAS serve MLX in this process (imports mlx)."""
    import mlx.core as mx

    plat = f"{sys.platform}-{platform.machine()}"
    device = str(mx.default_device().type).removeprefix("DeviceType.")
    path: str | None = None
    kind: BlasKind = "unknown"
    if sys.platform == "darwin":
        kind = "accelerate"
    elif sys.platform.startswith("linux"):
        libmlx = os.path.join(os.path.dirname(mx.__file__ or ""), "lib", "libmlx.so")
        try:
            path = _linux_active_blas(libmlx) if os.path.exists(libmlx) else None
        except (OSError, AttributeError):
            path = None
        kind = classify_blas(path)
    real = os.path.realpath(path) if path else None
    preloaded = real is not None and any(
        os.path.realpath(p) == real for p in _preloaded(os.environ)
    )
    return BackendInfo(plat, device, kind, path, preloaded, _blas_threads(path, kind))
