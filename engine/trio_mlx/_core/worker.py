"""The one MLX thread: every mlx / mlx-lm call of an engine runs here.

MLX streams belong to the thread that made them, so the engine pins a single
OS thread for its whole life instead of borrowing ``trio.to_thread`` threads.
Trio hands it plain callables; each result comes back through
``TrioToken.run_sync_soon``, so the event loop never blocks on the GPU.

If a call raises ``BaseException`` that is not an ``Exception`` (SystemExit,
KeyboardInterrupt...), the call gets it and the thread ends: the worker is
dead, every later call raises :class:`~trio_mlx.EngineClosed`, and the owner
hears about it through ``on_death`` (and every callback given to ``watch``: the
engines of a :class:`~trio_mlx.ModelHost` share one worker).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import outcome
import trio

from trio_mlx._errors import EngineClosed

__all__ = ["Worker"]

T = TypeVar("T")

_STOP = object()
#: The longest wait for the OS thread to finish its C++ thread-local destructors.
_THREAD_EXIT_TIMEOUT = 5.0


async def _os_thread_gone(native_id: int | None) -> None:
    """Wait until the OS thread has really ended (Linux), not just its Python part.

    ``Thread.join`` returns before the OS thread runs its C++ thread-local
    destructors; MLX's take the GIL. If the interpreter is finalizing by then
    (a program that exits right after closing the engine), the process aborts
    with "terminate called without an active exception". Waiting here keeps
    that work inside the engine's lifetime.
    """
    # procfs reads never touch a disk: no thread hop for them.
    if native_id is None or not os.path.isdir("/proc/self/task"):  # noqa: ASYNC240
        return
    task = f"/proc/self/task/{native_id}"
    with trio.move_on_after(_THREAD_EXIT_TIMEOUT):
        # Nothing signals the end of an OS thread to Python: poll /proc.
        while os.path.exists(task):  # noqa: ASYNC110, ASYNC240
            await trio.sleep(0.001)


@attrs.define(eq=False)
class Worker:
    """A pinned OS thread that runs callables in order, one at a time."""

    name: str = "trio-mlx-worker"
    #: Called on the Trio thread once the worker thread has ended, for any reason.
    on_death: Callable[[BaseException | None], None] | None = None
    _queue: queue.SimpleQueue[Any] = attrs.field(init=False, factory=queue.SimpleQueue)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _token: trio.lowlevel.TrioToken | None = attrs.field(init=False, default=None)
    _alive: bool = attrs.field(init=False, default=False)
    _ended: trio.Event = attrs.field(init=False, factory=trio.Event)
    _busy: float = attrs.field(init=False, default=0.0)
    _watchers: list[Callable[[BaseException | None], None]] = attrs.field(init=False, factory=list)

    def watch(self, callback: Callable[[BaseException | None], None]) -> Callable[[], None]:
        """Call ``callback`` (like ``on_death``) when the thread ends; returns the undo."""
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback) if callback in self._watchers else None

    @property
    def alive(self) -> bool:
        """Whether the thread is running and accepts calls."""
        return self._alive

    @property
    def busy_seconds(self) -> float:
        """Seconds the thread has spent running calls (the rest it waited for work)."""
        return self._busy

    def start(self) -> None:
        """Start the thread; must be called from Trio."""
        if self._thread is not None:
            raise RuntimeError("the worker was already started")
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._alive = True
        self._thread.start()

    def submit(self, fn: Callable[[], T], deliver: Callable[[outcome.Outcome[T]], None]) -> None:
        """Queue ``fn`` on the thread; ``deliver(outcome)`` runs later on the Trio thread."""
        if not self._alive:
            deliver(outcome.Error(EngineClosed("the MLX worker thread is not running")))
            return
        self._queue.put((fn, deliver))

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the thread and return its result.

        The call cannot be taken back once queued, so waiting for it is
        shielded: calls are short (a decode step) or check a cancellation flag
        of their own (a serial generation).
        """
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        self.submit(fn, deliver)
        with trio.CancelScope(shield=True):
            await done.wait()
        return box[0].unwrap()

    def call_soon_in_trio(self, fn: Callable[..., Any], *args: Any) -> None:
        """From the worker thread: run ``fn(*args)`` on the Trio thread soon."""
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    async def stop(self) -> None:
        """Let queued calls finish, end the thread and join it."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        with trio.CancelScope(shield=True):
            await self._ended.wait()
            self._thread.join()
            await _os_thread_gone(self._thread.native_id)

    def _main(self) -> None:
        death: BaseException | None = None
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                fn, deliver = item
                start = time.perf_counter()
                result = outcome.capture(fn)
                self._busy += time.perf_counter() - start
                if isinstance(result, outcome.Error) and not isinstance(result.error, Exception):
                    death = result.error
                    error = EngineClosed(f"the MLX worker thread died: {death!r}")
                    error.__cause__ = death
                    self.call_soon_in_trio(deliver, outcome.Error(error))
                    break
                self.call_soon_in_trio(deliver, result)
        except BaseException as exc:  # pragma: no cover - a bug in this loop
            death = exc
        finally:
            self._alive = False
            self._drain_queue()
            self.call_soon_in_trio(self._finished, death)

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                _fn, deliver = item
                error = EngineClosed("the MLX worker thread ended")
                self.call_soon_in_trio(deliver, outcome.Error(error))

    def _finished(self, death: BaseException | None) -> None:
        self._ended.set()
        if self.on_death is not None:
            self.on_death(death)
        for callback in list(self._watchers):
            callback(death)
