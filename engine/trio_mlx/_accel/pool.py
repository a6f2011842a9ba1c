"""Start-up work on CUDA: keep device memory mapped once it was obtained.

Theory of operation
===================

MLX's CUDA allocator keeps freed buffers in its own cache and reuses one only
for a request of the same size (within two 16 KiB pages). A request of a new
size goes to ``cudaMallocAsync`` on the device's default memory pool, and that
pool, with CUDA's default release threshold of 0, hands its unused memory back
to the driver at every synchronisation, which MLX does at least once a step.
So every buffer of a size not met before is new physical memory, mapped while
the step waits. Measured on the H200 (design/performance.md):
when a 4,000-token prompt joins 63 decoding rows, the batch's keys and values
become 8 GiB of buffers of a new size; the join took 13-23 ms the first time
and 4 ms when the same size came again, and fresh zeroed arrays of that size
took 12-22 ms against 2.2-3.0 ms from MLX's cache.

:func:`keep_memory` runs at load on CUDA (``TRIO_MLX_CUDA_POOL_GIB`` tunes it:
unset or ``0`` is the default, ``N`` maps N GiB up front, ``off`` leaves MLX's
allocator as it is) and does three things:

1. sets every device's default pool's release threshold to the maximum, so the
   pool keeps what it has mapped instead of returning it at each sync;
2. with ``N``, maps N GiB into that pool at start-up (allocated through MLX in
   1 GiB blocks, then freed past MLX's cache with ``mx.clear_cache()``), so
   even a first long prompt's buffers come from memory already mapped;
3. bounds MLX's own cache to :data:`MLX_CACHE_BYTES`, so buffers of sizes that
   do not come again go back to the pool (where any later size can use them)
   instead of waiting in MLX's cache for their exact size.

What it changed on the H200 (design/performance.md): with 24 GiB
mapped up front, zeroed arrays of 6-9 GiB of new sizes took 2.3-3.4 ms (MLX's
allocator: 11.9-41.9 ms) and the 4,000-token join 4.1 ms (11.4-18.9 ms); the
served traffic's tok/s did not move beyond its spread. The bound on MLX's cache
also bounds the server's memory. MLX's cache may grow to its memory limit, 95%
of the device, before it gives any back: serving a 2.5 GB model to 64 streams
with long prompts for four minutes, with the bench's bare loops taking turns on
the same GPU, the GPU's memory in use reached 138.5 of its 139 GiB; with a
second server up, it and a bare loop process failed to allocate (out of memory)
and the other server failed every request. With this module's defaults the same
traffic peaked at 27.3 GiB (32.6 with 24 GiB mapped up front): what the pool
keeps is the peak of what the steps really used, plus MLX's bounded cache.

The driver is reached through ``libcuda`` with :mod:`ctypes` (MLX has no
binding for the pool's attributes); the pool is a driver object, so this holds
whatever CUDA runtime MLX was built against. The memory stays reserved for the
process: that is the point, and what a dedicated inference server wants, but
on a shared GPU the peak (and the N GiB) is memory no other process can have.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Mapping
from typing import Protocol

from trio_mlx._accel import settings as _cuda_settings
from trio_mlx._errors import InvalidRequest

__all__ = ["MLX_CACHE_BYTES", "VARIABLE", "Driver", "keep_memory", "requested_gib"]

logger = logging.getLogger("trio_mlx")

VARIABLE = "TRIO_MLX_CUDA_POOL_GIB"

#: MLX's own buffer cache while the pool keeps memory: the step's recurring
#: buffers (a few MB each at 64 rows) fit many times over.
MLX_CACHE_BYTES = 2 << 30

_RELEASE_THRESHOLD = 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
_RESERVED_CURRENT = 5  # CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT


class Driver(Protocol):
    """What :func:`keep_memory` needs of the CUDA driver (a parameter for the tests)."""

    def devices(self) -> int:
        """How many devices the process sees."""
        ...

    def keep_mapped(self, device: int) -> None:
        """Set the device's default pool's release threshold to the maximum."""
        ...

    def reserved(self, device: int) -> int:
        """Bytes the device's default pool holds mapped now."""
        ...


class _LibCuda:
    """The driver API through ``libcuda.so.1``."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")

    @staticmethod
    def _check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed with CUDA error {result}")

    def devices(self) -> int:
        count = ctypes.c_int()
        self._check(self.lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        return count.value

    def _pool(self, device: int) -> ctypes.c_void_p:
        handle, pool = ctypes.c_int(), ctypes.c_void_p()
        self._check(self.lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        self._check(
            self.lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), handle),
            "cuDeviceGetDefaultMemPool",
        )
        return pool

    def keep_mapped(self, device: int) -> None:
        value = ctypes.c_uint64(2**64 - 1)
        self._check(
            self.lib.cuMemPoolSetAttribute(
                self._pool(device), _RELEASE_THRESHOLD, ctypes.byref(value)
            ),
            "cuMemPoolSetAttribute",
        )

    def reserved(self, device: int) -> int:
        value = ctypes.c_uint64()
        self._check(
            self.lib.cuMemPoolGetAttribute(
                self._pool(device), _RESERVED_CURRENT, ctypes.byref(value)
            ),
            "cuMemPoolGetAttribute",
        )
        return value.value


def requested_gib(environ: Mapping[str, str]) -> int | None:
    """The GiB :data:`VARIABLE` asks to map up front (unset: 0), or None for ``off``.

    Anything else than ``off`` or a whole number is refused.
    """
    text = environ.get(VARIABLE, "").strip()
    if text.lower() == "off":
        return None
    if not text:
        return 0
    try:
        gib = int(text)
    except ValueError:
        gib = -1
    if gib < 0:
        raise InvalidRequest(
            f"{VARIABLE} must be a whole number of GiB to map up front, or off, not {text!r}",
            param=VARIABLE,
        )
    return gib


def keep_memory(
    environ: Mapping[str, str] | None = None,
    *,
    cuda: bool | None = None,
    driver: Driver | None = None,
) -> dict[str, float]:
    """Keep pool memory mapped and map :data:`VARIABLE` GiB now; return what was done.

    Nothing off CUDA or when the variable is ``off``. If the driver cannot be
    reached or refuses the setting, a warning is logged and MLX's allocator is
    left as it is (a bounded MLX cache over a pool that gives memory back would
    map more, not less). ``environ`` defaults to ``os.environ``, ``cuda`` to
    whether MLX's CUDA backend is available and ``driver`` to ``libcuda``
    (parameters for the tests).
    """
    import mlx.core as mx

    gib = requested_gib(os.environ if environ is None else environ)
    if gib is None:
        return {}
    if not _cuda_settings.on_cuda(cuda):
        return {}
    start = time.perf_counter()
    try:
        driver = _LibCuda() if driver is None else driver
        devices = driver.devices()
        for device in range(devices):
            driver.keep_mapped(device)
    except (OSError, AttributeError, RuntimeError) as exc:
        logger.warning("CUDA memory pool left to MLX: %s", exc)
        return {}
    if gib:
        blocks = [mx.zeros((1 << 30,), dtype=mx.uint8) for _ in range(gib)]
        mx.eval(blocks)
        del blocks
        # On CUDA a buffer returns to MLX's cache only once the stream that used
        # it is done: wait for that first, or clearing finds the cache empty and
        # the GiB stay in it rather than in the pool.
        mx.synchronize()
        mx.clear_cache()  # past MLX's cache, into the pool, which now keeps them
    mx.set_cache_limit(MLX_CACHE_BYTES)
    done = {
        "devices": float(devices),
        "reserved_gib": sum(driver.reserved(d) for d in range(devices)) / 2**30,
        "seconds": time.perf_counter() - start,
    }
    logger.info("CUDA memory pool kept mapped: %s", done)
    return done
