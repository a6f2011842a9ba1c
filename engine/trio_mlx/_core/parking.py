"""Rows in and out of the batch as the arbiter says: admitted, parked, resumed.

``Admit`` and ``Resume`` only queue rows with the step planner: new rows are
inserted by the next step, parked ones resumed from their kept KV caches.
``Park`` (so that a waiting job gets the GPU) takes effect in two halves: the
bookkeeping at once, when the decision is made (:meth:`Parking.mark`: the
arbiter counts the rows parked from then on, so must a cancel that arrives
before the park itself has run), and one worker call that takes the rows'
caches out of the lane (:meth:`Parking.park`). A row cancelled in between is
parked anyway and removed afterwards (:meth:`StepPlanner.remove`). If parking
fails, its rows fail with the error and leave the arbiter. Cancelled rows
leave the lane with the next step, or, when none is due soon, by
:meth:`Parking.discard`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import attrs
import trio

from trio_mlx._core.arbiter import Arbiter
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.planner import StepPlanner
from trio_mlx._core.request import Ending, Phase
from trio_mlx._core.worker import Worker
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.output import RowEvent

__all__ = ["Parking"]


@attrs.define(eq=False)
class Parking:
    """Carries out Admit, Resume and Park for the actor (Trio thread only)."""

    worker: Worker
    lane: BatchLane
    arbiter: Arbiter
    planner: StepPlanner
    books: Ledger
    #: Whether the engine has stopped (a failed park then fails nobody).
    stopped: Callable[[], bool]
    #: Rows of the last Park decision that the lane has still to park.
    _pending: list[int] = attrs.field(init=False, factory=list)

    def queue(self, ids: tuple[int, ...]) -> None:
        """Admitted or resumed rows join the next step: new ones inserted, parked ones resumed."""
        now = trio.current_time()
        for row_id in ids:
            request = self.books[row_id]
            request.phase = Phase.RUNNING
            if request.embed is not None:
                self.planner.embed(request.embed)
            elif request.inserted:
                self.planner.resume(row_id)
            else:
                assert request.spec is not None
                self.planner.insert(request.spec, now)

    def mark(self, ids: tuple[int, ...]) -> None:
        """The bookkeeping of a Park decision, done when it is made."""
        in_lane = []
        for row_id in ids:
            request = self.books[row_id]
            request.phase = Phase.PENDING
            if request.embed is not None:  # never in the lane: its inputs wait to resume
                self.planner.drop_embed(row_id)
            elif not self.planner.unqueue(row_id):
                in_lane.append(row_id)
        self._pending = in_lane

    async def park(self) -> None:
        """Take the marked rows' KV caches out of the lane (one worker call)."""
        in_lane, self._pending = self._pending, []
        self.planner.lane_unknown()
        if not in_lane:
            return
        try:
            await self.worker.run(partial(self.lane.park, in_lane))
        except Exception as exc:
            if self.stopped():
                return
            now = trio.current_time()
            for row_id in in_lane:
                request = self.books.get(row_id)
                if request is None:
                    continue
                self.arbiter.cancel_row(row_id, now)
                self.planner.remove(row_id)
                self.books.deliver(request, RowEvent(row_id, error=exc), now)
                self.books.end(request, Ending.FAILED)

    async def discard(self) -> None:
        """Free cancelled rows' caches now, when no step would do it soon."""
        removes = self.planner.take_removes()
        with contextlib.suppress(Exception):
            # Best effort: failing here only keeps the rows' caches a while longer.
            self.books.batch_rows = await self.worker.run(partial(self.lane.discard, removes))
        self.planner.lane_unknown()
