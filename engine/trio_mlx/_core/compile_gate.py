"""Who may compile a grammar now: a few slots, a deadline, and a bound on abandoned compiles.

llguidance compiles in a worker thread and offers no way to stop a compile
once begun (its Rust code runs to the end, bounded only by its own fuel
limits). A compile past its deadline is therefore abandoned, not stopped: its
request is refused at once and its slot handed to the next compile, while the
thread runs on. So that abandoned compiles cannot pile up without bound, at
most ``max_abandoned`` of them may be running; past that, new compiles are
refused (:class:`~trio_mlx.EngineOverloaded`, retry later) until one ends.

Fairness: a compile that names its client takes that client's own slot first
(``per_client`` of them, one by default), so one client's flood of new schemas
holds at most that many of the ``slots`` and the others stay open to everyone
else; its own compiles wait for each other, within their deadlines.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Hashable
from typing import TypeVar

import attrs
import trio

from trio_mlx._errors import EngineOverloaded, InvalidGrammar

__all__ = ["CompileGate", "CompileGateStatistics"]

T = TypeVar("T")


@attrs.frozen
class CompileGateStatistics:
    """A snapshot of a :class:`CompileGate`."""

    #: Compiles holding a slot now.
    running: int
    #: Compiles past their deadline whose threads still run.
    abandoned: int
    #: Compiles refused because too many abandoned ones were running.
    refused: int


@attrs.define(eq=False)
class CompileGate:
    """``slots`` compiles at once, each within a deadline; abandoned ones bounded."""

    slots: int = 2
    max_abandoned: int = 4
    #: Slots one client may hold at once (see the module's notes).
    per_client: int = 1
    #: Each client's own slots and how many of its compiles use them (dropped at 0).
    _clients: dict[Hashable, tuple[trio.CapacityLimiter, list[int]]] = attrs.field(
        init=False, factory=dict
    )
    _limiter: trio.CapacityLimiter = attrs.field(init=False)
    _threads: trio.CapacityLimiter = attrs.field(init=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _abandoned: int = attrs.field(init=False, default=0)
    _refused: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._limiter = trio.CapacityLimiter(self.slots)
        # Trio holds a thread's limiter token until the thread returns, abandoned
        # or not: enough for every slot and every abandoned compile, so the
        # default thread limiter (shared by all of the process) is never used.
        self._threads = trio.CapacityLimiter(self.slots + self.max_abandoned)

    def statistics(self) -> CompileGateStatistics:
        """How many compiles run, are abandoned, were refused."""
        with self._lock:
            abandoned = self._abandoned
        return CompileGateStatistics(
            running=self._limiter.borrowed_tokens, abandoned=abandoned, refused=self._refused
        )

    @contextlib.asynccontextmanager
    async def _client_slot(self, client: Hashable | None) -> AsyncIterator[None]:
        """Hold one of ``client``'s own slots (none: no client named)."""
        if client is None:
            yield
            return
        limiter, users = self._clients.setdefault(
            client, (trio.CapacityLimiter(self.per_client), [0])
        )
        users[0] += 1
        try:
            async with limiter:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._clients[client]

    async def run(
        self,
        compile: Callable[[], T],
        *,
        seconds: float,
        param: str,
        client: Hashable | None = None,
    ) -> T:
        """``compile()`` in a worker thread, refused with ``InvalidGrammar`` past ``seconds``.

        The wait for a slot (``client``'s own first, if named) counts toward
        ``seconds``. On time out (or when the caller is cancelled) the slot is
        released at once; the thread is left to finish and counted as abandoned
        until it does.
        """
        with self._lock:
            if self._abandoned >= self.max_abandoned:
                self._refused += 1
                raise EngineOverloaded(
                    f"{self._abandoned} grammar compiles past their deadline are still "
                    "running; retry later",
                    code="grammar_compiles_busy",
                )
        # "waiting" -> "running" -> "done" in the thread; on time out "waiting"
        # becomes "dropped" (the thread, if it ever starts, returns at once) and
        # "running" becomes "abandoned" (counted until the thread returns).
        state = "waiting"

        def work() -> T:
            nonlocal state
            with self._lock:
                if state == "dropped":
                    raise trio.TooSlowError  # nobody waits for this result
                state = "running"
            try:
                return compile()
            finally:
                with self._lock:
                    if state == "abandoned":
                        self._abandoned -= 1
                    state = "done"

        try:
            with trio.move_on_after(seconds):
                async with self._client_slot(client), self._limiter:
                    return await trio.to_thread.run_sync(
                        work, abandon_on_cancel=True, limiter=self._threads
                    )
        finally:
            # Past the deadline, or cancelled from outside ("done" when it returned).
            with self._lock:
                if state == "waiting":
                    state = "dropped"
                elif state == "running":
                    state = "abandoned"
                    self._abandoned += 1
        raise InvalidGrammar(
            f"{param} did not compile within {seconds:g} s; simplify it",
            param=param,
            code="grammar_too_complex",
        )
