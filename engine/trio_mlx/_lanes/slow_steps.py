"""The slow-step log and its readings: GC time, kernels compiled, memory, buffer length."""

from __future__ import annotations

import gc
import logging
import math
import time
from typing import Any

import attrs

__all__ = [
    "SlowStepLog",
    "buffer_length",
    "gc_seconds",
    "kernels_compiled",
    "memory_now",
    "memory_report",
]

logger = logging.getLogger("trio_mlx")


def buffer_length(generator: Any) -> int | None:
    """Positions in the decoding batch's first layer's buffer (None: no batch, or not
    one of mlx-lm's ``BatchKVCache``s); for the slow-step log."""
    batch = getattr(generator, "_generation_batch", None)
    caches = getattr(batch, "prompt_cache", None)
    keys = getattr(caches[0], "keys", None) if caches else None
    return None if keys is None else int(keys.shape[2])


#: Seconds Python's garbage collector has run in this process since the import
#: (index 0), and when the running collection started (index 1); for the slow-step log.
gc_seconds: list[float] = [0.0, 0.0]


def _gc_timer(phase: str, _info: dict[str, int]) -> None:
    if phase == "start":
        gc_seconds[1] = time.perf_counter()
    else:
        gc_seconds[0] += time.perf_counter() - gc_seconds[1]


gc.callbacks.append(_gc_timer)


def kernels_compiled(since: float) -> str:
    """The kernel modules MLX's CUDA backend compiled since ``since`` (a ``time.time()``),
    for the slow-step log.

    MLX compiles a module with NVRTC the first time a process meets it (a fused
    graph, a gather of a new dtype; a second or more each on the H200) and writes
    it to its PTX cache directory, ``MLX_PTX_CACHE_DIR`` or
    ``<temp>/mlx/<version>/ptx`` (a long module name as nested folders); modules
    written during a slow step are the ones it compiled then. Not listed: a module
    read back from that directory, a custom kernel's (``mx.fast.cuda_kernel``, such
    as the fused decode attention: MLX 0.32 compiles those in every process and
    never writes them), anything where the directory is absent (the CPU).
    """
    import os
    import tempfile
    from pathlib import Path

    chosen = os.environ.get("MLX_PTX_CACHE_DIR")
    roots = [Path(chosen)] if chosen else sorted(Path(tempfile.gettempdir()).glob("mlx/*/ptx"))
    names: list[str] = []
    for root in roots:
        try:
            names += sorted(
                "".join(p.relative_to(root).with_suffix("").parts)
                for p in root.rglob("*.ptx")
                if p.stat().st_mtime >= since
            )
        except OSError:  # gone meanwhile: nothing to say about it
            continue
    if not names:
        return "no kernel compiled"
    shown = ", ".join(name[:60] for name in names[:4])
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return f"{len(names)} kernel modules compiled: {shown}{more}"


def memory_now() -> tuple[int, int]:
    """MLX's active and cached memory in bytes (read before each decode step)."""
    import mlx.core as mx

    return mx.get_active_memory(), mx.get_cache_memory()


def memory_report(before: tuple[int, int] | None = None) -> str:
    """MLX's memory figures, for the slow-step log, from ``before`` (if given) to now:
    a stall that is the allocator's (a large new buffer, a cache cleared) shows as a
    jump in them."""
    import mlx.core as mx

    mib = 1 << 20
    active, cached = memory_now()
    was = "" if before is None else f"{before[0] // mib} -> "
    was_cached = "" if before is None else f"{before[1] // mib} -> "
    return (
        f"memory active {was}{active // mib} MiB, cached {was_cached}{cached // mib} MiB, "
        f"peak {mx.get_peak_memory() // mib} MiB"
    )


@attrs.define(eq=False)
class SlowStepLog:
    """Log lines for slow decode steps and slow admissions, each kind at most once per
    quiet period, with what the step carried: so that a stall can be told apart (a
    long prefill, a first trace, Python's garbage collector, kernels compiled, MLX's
    allocator, or none of these)."""

    _unlogged: list[int] = attrs.field(init=False, factory=lambda: [0, 0])
    _logged_at: list[float] = attrs.field(init=False, factory=lambda: [-math.inf] * 2)

    def _due(self, kind: int, quiet: float) -> int | None:
        """None inside ``kind``'s quiet period (counted); else the count not logged before."""
        now = time.perf_counter()
        if now - self._logged_at[kind] < quiet:
            self._unlogged[kind] += 1
            return None
        unlogged, self._unlogged[kind] = self._unlogged[kind], 0
        self._logged_at[kind] = now
        return unlogged

    def step(
        self,
        quiet: float,
        generator: Any,
        *,
        elapsed: float,
        gc: float,
        memory: tuple[int, int],
        carried: str,
        step: int,
    ) -> None:
        """A slow decode step: ``carried`` says what the step held."""
        unlogged = self._due(0, quiet)
        if unlogged is None:
            return
        generation = generator._generation_batch
        phases, arrivals = generation.phases, generation.arrivals_step
        if phases is not None:
            passes = (
                "the decode pass built in {:.0f} ms, queued in {:.0f} ms, the pass before it "
                "waited for {:.0f} ms".format(*(seconds * 1000 for seconds in phases))
            )
        elif arrivals is not None:
            passes = f"the arrivals' first step (mlx-lm's own) took {arrivals * 1000:.0f} ms"
        else:
            passes = "no decode pass"
        logger.info(
            "slow decode step: %.0f ms; step %d, %.0f ms of it in Python's garbage collector; "
            "%s; %s; %s; %s; %d slow steps not logged before it",
            elapsed * 1000,
            step,
            gc * 1000,
            passes,
            carried,
            kernels_compiled(time.time() - elapsed - 0.01),
            memory_report(memory),
            unlogged,
        )

    def admission(self, quiet: float, what: str) -> None:
        """A slow removal and admission (the work before a step's decoding); its quiet
        period is its own."""
        unlogged = self._due(1, quiet)
        if unlogged is None:
            return
        logger.info(
            "slow admission: %s; %s; %d slow steps not logged before it",
            what,
            memory_report(),
            unlogged,
        )
