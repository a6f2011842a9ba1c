"""Pure: which models stay loaded. The rules a :class:`~trio_mlx.ModelHost` follows.

- A model in use (a request holds it) is never chosen to unload.
- To make room for a model, the idle models are unloaded least recently used
  first, as few as give room: at most ``max_models`` loaded, their weights at most
  ``max_bytes``. If unloading every idle model would not give room, none is unloaded
  and the load waits for a model to become idle.
- A model idle for ``idle_unload`` seconds is unloaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["Resident", "evictions", "expired", "fits_alone"]


@attrs.frozen
class Resident:
    """A model that holds memory (loading, loaded or unloading)."""

    name: str
    weight_bytes: int
    #: Requests holding it.
    leases: int
    #: When it was last let go of (the host's clock).
    last_used: float
    #: Whether it may be chosen to unload at all (loaded, not already unloading).
    evictable: bool = True


def _room(
    kept: Sequence[Resident], incoming: int, max_models: int | None, max_bytes: int | None
) -> bool:
    if max_models is not None and len(kept) + 1 > max_models:
        return False
    return max_bytes is None or sum(r.weight_bytes for r in kept) + incoming <= max_bytes


def fits_alone(incoming: int, max_bytes: int | None) -> bool:
    """Whether a model of ``incoming`` bytes fits with nothing else loaded."""
    return max_bytes is None or incoming <= max_bytes


def evictions(
    resident: Sequence[Resident],
    incoming: int,
    *,
    max_models: int | None,
    max_bytes: int | None,
) -> tuple[str, ...] | None:
    """The idle models to unload, least recently used first, so that one more model
    of ``incoming`` bytes fits; ``()``: it fits now; ``None``: not even with every
    idle model unloaded (wait)."""
    kept = list(resident)
    chosen: list[str] = []
    idle = sorted((r for r in resident if r.leases == 0 and r.evictable), key=lambda r: r.last_used)
    for candidate in idle:
        if _room(kept, incoming, max_models, max_bytes):
            break
        kept.remove(candidate)
        chosen.append(candidate.name)
    return tuple(chosen) if _room(kept, incoming, max_models, max_bytes) else None


def expired(resident: Sequence[Resident], now: float, idle_unload: float | None) -> tuple[str, ...]:
    """The models idle for at least ``idle_unload`` seconds (``None``: never)."""
    if idle_unload is None:
        return ()
    return tuple(
        r.name
        for r in resident
        if r.leases == 0 and r.evictable and now - r.last_used >= idle_unload
    )
