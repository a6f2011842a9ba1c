"""Several models served from one MLX thread, loaded on demand and unloaded when idle.

A :class:`ModelHost` owns one :class:`~trio_mlx._core.worker.Worker` (the one MLX
thread) and opens an :class:`~trio_mlx.Engine` per loaded model on it. Each engine keeps
its own actor and arbiter, which decide for its rows as they do alone; the thread runs
their calls in the order they come, so the loaded models' batches are stepped in turn
(each actor sends its next step when its last one came back). A load is one call on
that thread: the other models' streams pause for it (``design/engine.md``, "Several
models").

Requests hold a model through :meth:`ModelHost.use` (a lease): a model is never
unloaded while one is held. Which idle model makes room, and when one has idled long
enough, is :mod:`trio_mlx._host.residency`'s pure rule.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from trio_mlx._core.engine import Engine
from trio_mlx._core.opening import free_memory, open_on
from trio_mlx._core.worker import Worker
from trio_mlx._errors import EngineClosed, InvalidRequest, ModelUnavailable, NotFound
from trio_mlx._host.catalog import ModelEntry, catalog
from trio_mlx._host.residency import Resident, evictions, expired, fits_alone
from trio_mlx._start.settings import EngineSettings

__all__ = ["ModelHost", "ModelInfo", "ModelState", "open_host"]

logger = logging.getLogger("trio_mlx.host")

#: Seconds a request waits for its model to load (or for room) before ``ModelUnavailable``.
DEFAULT_LOAD_TIMEOUT = 300.0


class ModelState(enum.Enum):
    """Where a model of a host is."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@attrs.frozen
class ModelInfo:
    """One model of a host, as :meth:`ModelHost.models` reports it."""

    name: str
    path: str
    state: ModelState
    #: Bytes of its weights (on disk before its first load; in memory after).
    weight_bytes: int
    #: Requests holding it now.
    in_use: int
    loads: int
    unloads: int
    #: Unix time of its last use (None: never used).
    last_used: float | None
    #: Why its last load failed (None: it did not).
    error: str | None


@attrs.define(eq=False)
class _Slot:
    entry: ModelEntry
    weight_bytes: int
    state: ModelState = ModelState.UNLOADED
    engine: Engine | None = None
    leases: int = 0
    #: The host's clock (``trio.current_time``) at its last release.
    last_used: float = 0.0
    last_used_wall: float | None = None
    loads: int = 0
    unloads: int = 0
    #: Counts load attempts: a waiter tells its own attempt's failure from a later one's.
    attempts: int = 0
    error: BaseException | None = None
    stop: trio.Event = attrs.field(factory=trio.Event)

    def loading(self) -> bool:
        """Whether it is loading (a call: the state changes across awaits)."""
        return self.state is ModelState.LOADING


@attrs.define(eq=False)
class ModelHost:
    """Models loaded on demand on one MLX thread; use it through :func:`open_host`."""

    _slots: dict[str, _Slot]
    _worker: Worker
    _settings: EngineSettings
    _nursery: trio.Nursery
    max_models: int | None
    max_model_memory: int | None
    idle_unload: float | None
    load_timeout: float
    _changed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _closing: bool = attrs.field(init=False, default=False)

    @property
    def default(self) -> str:
        """The model a request that names none gets: the first one given."""
        return next(iter(self._slots))

    @property
    def names(self) -> tuple[str, ...]:
        """Every model the host can load, in the order given."""
        return tuple(self._slots)

    def loaded(self, name: str) -> Engine | None:
        """``name``'s engine if it is loaded now (no lease: for reading its settings)."""
        slot = self._slot(name)
        return slot.engine if slot.state is ModelState.LOADED else None

    def engines(self) -> tuple[Engine, ...]:
        """The loaded models' engines (for shutdown: closing them ends their requests)."""
        return tuple(
            s.engine
            for s in self._slots.values()
            if s.engine is not None and s.state is not ModelState.UNLOADED
        )

    def active_memory(self) -> int:
        """MLX's active memory in bytes (a plain read of its allocator's gauge)."""
        import mlx.core as mx

        return int(mx.get_active_memory())

    def models(self) -> tuple[ModelInfo, ...]:
        """Every model's state, in the order given."""
        return tuple(
            ModelInfo(
                name=s.entry.name,
                path=s.entry.path,
                state=s.state,
                weight_bytes=s.weight_bytes,
                in_use=s.leases,
                loads=s.loads,
                unloads=s.unloads,
                last_used=s.last_used_wall,
                error=None if s.error is None else str(s.error),
            )
            for s in self._slots.values()
        )

    @asynccontextmanager
    async def use(self, name: str | None = None) -> AsyncIterator[Engine]:
        """Hold ``name``'s engine (``None``: the default model) for the block, loading it
        first if it is not loaded (making room as :mod:`residency` says). Raises
        :class:`~trio_mlx.NotFound` for a name the host does not know and
        :class:`~trio_mlx.ModelUnavailable` when the model is not ready within
        ``load_timeout`` seconds."""
        slot = self._slot(self.default if name is None else name)
        engine = await self._acquire(slot)
        try:
            yield engine
        finally:
            self._release(slot)

    async def load(self, name: str) -> None:
        """Load ``name`` now (nothing if it is loaded)."""
        async with self.use(name):
            pass

    async def unload(self, name: str) -> None:
        """Unload ``name`` once the requests holding it have ended; requests that come
        meanwhile wait and load it again. Returns when it is unloaded."""
        slot = self._slot(name)
        while slot.loading():
            await self._wait_change()
        if slot.state is ModelState.LOADED:
            self._begin_unload(slot)
        while slot.state is not ModelState.UNLOADED:
            await self._wait_change()

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise NotFound(
                f"the model {name!r} does not exist; GET /v1/models lists the models",
                param="model",
                code="model_not_found",
            )
        return slot

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def _resident(self) -> list[Resident]:
        return [
            Resident(
                s.entry.name,
                s.weight_bytes,
                s.leases,
                s.last_used,
                evictable=s.state is ModelState.LOADED,
            )
            for s in self._slots.values()
            if s.state is not ModelState.UNLOADED
        ]

    async def _acquire(self, slot: _Slot) -> Engine:
        name = slot.entry.name
        with trio.move_on_after(self.load_timeout) as waited:
            while True:
                if self._closing:
                    raise EngineClosed("the model host is closing")
                if slot.state is ModelState.LOADED:
                    assert slot.engine is not None
                    slot.leases += 1
                    return slot.engine
                if slot.state is ModelState.UNLOADED:
                    attempt = await self._make_room_and_load(slot)
                    if attempt is None:
                        continue
                    while slot.loading():
                        await self._wait_change()
                    if slot.attempts == attempt and slot.error is not None:
                        raise ModelUnavailable(
                            f"loading the model {name!r} failed: {slot.error}", param="model"
                        ) from slot.error
                    continue
                await self._wait_change()  # loading or unloading: see what comes of it
        assert waited.cancelled_caught
        raise ModelUnavailable(
            f"the model {name!r} was not ready within {self.load_timeout:g} s "
            f"({slot.state.value}); retry later",
            retry_after=min(30.0, max(1.0, self.load_timeout / 10)),
            param="model",
        )

    async def _make_room_and_load(self, slot: _Slot) -> int | None:
        """Start ``slot``'s load once there is room; ``None``: something changed while
        waiting for room, look again."""
        if not fits_alone(slot.weight_bytes, self.max_model_memory):
            raise InvalidRequest(
                f"the model {slot.entry.name!r} ({slot.weight_bytes} bytes of weights) is "
                f"larger than max_model_memory ({self.max_model_memory} bytes)",
                param="model",
            )
        resident = self._resident()
        bounds = {"max_models": self.max_models, "max_bytes": self.max_model_memory}
        if evictions(resident, slot.weight_bytes, **bounds) != ():
            # Models already unloading will give their room: choose among the others.
            staying = [r for r in resident if self._slots[r.name].state is not ModelState.UNLOADING]
            victims = evictions(staying, slot.weight_bytes, **bounds)
            for victim in victims or ():
                logger.info("unloading %s to make room for %s", victim, slot.entry.name)
                self._begin_unload(self._slots[victim])
            await self._wait_change()
            return None
        slot.state = ModelState.LOADING
        slot.attempts += 1
        slot.error = None
        slot.stop = trio.Event()
        self._nursery.start_soon(self._serve, slot)
        self._notify()
        return slot.attempts

    def _release(self, slot: _Slot) -> None:
        slot.leases -= 1
        slot.last_used = trio.current_time()
        slot.last_used_wall = time.time()
        if slot.state is ModelState.UNLOADING and slot.leases == 0:
            slot.stop.set()
        self._notify()

    def _begin_unload(self, slot: _Slot) -> None:
        slot.state = ModelState.UNLOADING
        if slot.leases == 0:
            slot.stop.set()
        self._notify()

    async def _serve(self, slot: _Slot) -> None:
        """A loaded model's task: open its engine on the shared thread, hold it until
        told to stop, then close it and give its memory back."""
        name = slot.entry.name
        logger.info("loading %s from %s", name, slot.entry.path)
        try:
            await self._hold(slot)
            slot.unloads += 1
            logger.info("unloaded %s", name)
        except Exception as exc:
            if slot.state is ModelState.LOADING:
                logger.warning("loading %s failed: %s", name, exc)
                slot.error = exc
            else:  # pragma: no cover - an engine that fails while serving
                logger.exception("the model %s failed", name)
        finally:
            slot.engine = None
            # The engine's arrays sit in reference cycles: collect them now, on the
            # thread that made them, or the memory stays held until Python's next
            # collection (never, after the server's gc.freeze()).
            with trio.CancelScope(shield=True):
                if self._worker.alive:
                    await self._worker.run(free_memory)
            slot.state = ModelState.UNLOADED
            self._notify()

    async def _hold(self, slot: _Slot) -> None:
        """Open ``slot``'s engine and keep it until its stop (no reference kept after)."""
        started = time.perf_counter()
        async with open_on(self._worker, slot.entry.path, self._settings) as engine:
            slot.engine = engine
            slot.state = ModelState.LOADED
            slot.loads += 1
            slot.last_used = trio.current_time()
            elapsed = time.perf_counter() - started
            logger.info("loaded %s in %.2f s", slot.entry.name, elapsed)
            self._notify()
            await slot.stop.wait()
            slot.state = ModelState.UNLOADING
            self._notify()

    async def _unload_idle(self) -> None:
        """Unload models idle for ``idle_unload`` seconds (checked a few times a period)."""
        assert self.idle_unload is not None
        while True:
            await trio.sleep(min(1.0, max(0.01, self.idle_unload / 4)))
            for name in expired(self._resident(), trio.current_time(), self.idle_unload):
                logger.info("unloading %s: idle for %g s", name, self.idle_unload)
                self._begin_unload(self._slots[name])

    async def _close(self) -> None:
        self._closing = True
        self._notify()
        for slot in self._slots.values():
            if slot.state is ModelState.LOADED:
                self._begin_unload(slot)
            slot.stop.set()


@asynccontextmanager
async def open_host(
    models: Sequence[str | os.PathLike[str] | None] | None = None,
    *,
    model_dir: str | os.PathLike[str] | None = None,
    max_models: int | None = None,
    max_model_memory: int | None = None,
    idle_unload: float | None = None,
    load_timeout: float = DEFAULT_LOAD_TIMEOUT,
    preload: bool = True,
    settings: EngineSettings | None = None,
    **overrides: Any,
) -> AsyncIterator[ModelHost]:
    """Serve several models from one MLX thread for the block's duration.

    ``models`` are model folders or Hub ids (``None`` in it: the bundled model; by
    default the bundled model unless ``model_dir`` is given) and ``model_dir`` adds
    every model folder in it; a model's name is its folder's name,
    and the first is the default. ``preload`` loads the default before the block
    starts. At most ``max_models`` are loaded at once, their weights at most
    ``max_model_memory`` bytes (``None``: no bound); a model idle for ``idle_unload``
    seconds is unloaded (``None``: never). A request waits at most ``load_timeout``
    seconds for its model. ``settings`` and the keywords are every engine's
    (:func:`~trio_mlx.open_engine`'s); unless set, ``memory_share`` is one part in
    ``max_models`` (or in the number of models, if fewer).
    """
    _check(max_models, max_model_memory, idle_unload, load_timeout)
    base = settings or EngineSettings()
    if overrides:
        try:
            base = attrs.evolve(base, **overrides)
        except TypeError as bad:
            raise TypeError(f"open_host() got an unexpected keyword: {bad}") from None
    if models is None:
        models = [None] if model_dir is None else []
    entries = await trio.to_thread.run_sync(catalog, list(models), model_dir)
    if "memory_share" not in overrides and base.memory_share == 1.0:
        parts = min(len(entries), max_models or len(entries))
        base = attrs.evolve(base, memory_share=1.0 / parts)
    worker = Worker()
    worker.start()
    # Errors of the start and of the body are re-raised as themselves, not
    # wrapped in the nursery's ExceptionGroup.
    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            host = ModelHost(
                {n: _Slot(e, e.weight_bytes) for n, e in entries.items()},
                worker,
                base,
                nursery,
                max_models,
                max_model_memory,
                idle_unload,
                load_timeout,
            )
            if idle_unload is not None:
                nursery.start_soon(host._unload_idle)
            try:
                if preload:
                    await host.load(host.default)
                yield host
            except BaseException as exc:
                error = exc
            finally:
                with trio.CancelScope(shield=True):
                    await host._close()
                    with trio.move_on_after(max(1.0, base.grace_period * 2)):
                        while any(s.state is not ModelState.UNLOADED for s in host._slots.values()):
                            await host._wait_change()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await worker.stop()
    if error is not None:
        raise error


def _check(
    max_models: int | None,
    max_model_memory: int | None,
    idle_unload: float | None,
    load_timeout: float,
) -> None:
    for name, value in (("max_models", max_models), ("max_model_memory", max_model_memory)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise InvalidRequest(f"{name} must be a positive integer or None", param=name)
    for name, number in (("idle_unload", idle_unload), ("load_timeout", load_timeout)):
        if number is None and name == "idle_unload":
            continue
        if isinstance(number, bool) or not isinstance(number, int | float) or not number > 0:
            raise InvalidRequest(f"{name} must be a positive number of seconds", param=name)
