"""Exclusive jobs: what runs on the worker while no batch step does.

When the arbiter says ``Start``, the actor hands the job's request to
:meth:`Jobs.start`, which runs it as a child task of the actor: a serial
generation (built by ``serial_work``; its tokens are routed to the request's
outbox as they come), an adapter mount or a user function (the request's
``work``). When the call returns, the arbiter hears how the job ended and the
actor's doorbell rings. A serial generation's last event is held until the
job has ended, so that the request ends exactly once, then.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import outcome
import trio

from trio_mlx._core.arbiter import Arbiter, Outcome
from trio_mlx._core.gate import LaneName
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.request import Ending, Phase, Request
from trio_mlx._core.worker import Worker
from trio_mlx._lanes.output import RowEvent

__all__ = ["Jobs", "SerialWork"]

#: Builds the worker-side callable of a serial generation from its request, the
#: callback that routes its events and the one that reports its cached prompt tokens.
SerialWork = Callable[[Request, Callable[[list[RowEvent]], None], Callable[[int], None]], Any]


@attrs.define(eq=False)
class Jobs:
    """Runs the arbiter's exclusive jobs on the worker (Trio thread only)."""

    worker: Worker
    arbiter: Arbiter
    books: Ledger
    serial_work: SerialWork
    #: Cancels a request whose reader stalled (the actor's cancel).
    cancel: Callable[[Request, float], None]
    #: Rings the actor's doorbell: a job ended.
    ring: Callable[[], None]

    def start(self, nursery: trio.Nursery, request: Request) -> None:
        """Run the job of ``request`` as a child task in ``nursery``."""
        request.phase = Phase.RUNNING
        nursery.start_soon(self._run, request)

    async def _run(self, request: Request) -> None:
        if request.lane is LaneName.SERIAL:
            emit = partial(self.worker.call_soon_in_trio, self._route_serial)
            cached = partial(self.worker.call_soon_in_trio, self.books.cached, request)
            work = self.serial_work(request, emit, cached)
        else:
            assert request.work is not None
            work = request.work
        try:
            value = await self.worker.run(work)
        except Exception as exc:
            result: outcome.Outcome[Any] = outcome.Error(exc)
        else:
            result = outcome.Value(value)
        if request.phase is Phase.DONE:
            return
        request.result = result
        self._ended(request, result, trio.current_time())
        self.ring()

    def _ended(self, request: Request, result: outcome.Outcome[Any], now: float) -> None:
        if isinstance(result, outcome.Error):
            if request.lane is LaneName.SERIAL:
                self.books.deliver(request, RowEvent(request.id, error=result.error), now)
            how, ending = Outcome.FAILED, Ending.FAILED
        elif request.cancel_flag.is_set():
            how, ending = Outcome.CANCELLED, Ending.CANCELLED
        else:
            if request.final is not None:
                self.books.deliver(request, request.final, now)
            how, ending = Outcome.FINISHED, Ending.FINISHED
        self.arbiter.job_ended(request.id, how, now)
        self.books.end(request, ending)

    def _route_serial(self, events: list[RowEvent]) -> None:
        now = trio.current_time()
        for event in events:
            request = self.books.get(event.id)
            if request is None or request.phase is not Phase.RUNNING:
                return
            if event.finish_reason is not None:
                # Held until the job has ended, so the request ends exactly once, then.
                request.final = event
                return
            self.books.deliver(request, event, now)
            if self.books.stalled(request):
                self.cancel(request, now)
