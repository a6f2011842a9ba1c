"""A batch step's results, routed: each row's events to its request's outbox.

The worker hands back one :class:`~trio_mlx._lanes.records.StepResult` per step
call (or the error of a lane that failed as a whole, which fails every running
row). :meth:`StepRouter.route` feeds the planner the step's counts and timings,
counts the prompt tokens the cache supplied, ``put``\\ s each event in its
request's outbox (never waiting on a consumer), tells the arbiter which rows
finished or failed, cancels a request whose reader stalled, and reports the step
done. Trio thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import outcome
import trio

from trio_mlx._core.arbiter import Arbiter, Outcome
from trio_mlx._core.gate import LaneName
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.planner import StepPlanner
from trio_mlx._core.request import Ending, Phase, Request
from trio_mlx._lanes.output import RowEvent
from trio_mlx._lanes.records import EmbedVector, StepResult

__all__ = ["StepRouter"]


@attrs.define(eq=False)
class StepRouter:
    """Routes step results to outboxes, the planner and the arbiter."""

    arbiter: Arbiter
    planner: StepPlanner
    books: Ledger
    #: Cancels a request whose reader stalled (the actor's cancel).
    cancel: Callable[[Request, float], None]

    def route(self, result: outcome.Outcome[StepResult]) -> None:
        """Route one step call's result."""
        embeddings: tuple[EmbedVector, ...] = ()
        if isinstance(result, outcome.Error):
            events = self._failed(result.error)
        else:
            step = result.unwrap()
            events = step.events
            self.books.batch_rows = step.rows
            self.planner.stepped(
                step.decoding, step.steps, seconds=step.seconds, embed_seconds=step.embed_seconds
            )
            self.planner.timed(step.timings)
            for row_id, cached in step.cached.items():
                request = self.books.get(row_id)
                if request is not None:
                    self.books.cached(request, cached)
            embeddings = step.embeddings
        now = trio.current_time()
        for event in events:
            self._route_row(event, now)
        for vector in embeddings:
            self._route_vector(vector, now)
        self.arbiter.step_done(now)

    def _failed(self, error: BaseException) -> list[RowEvent]:
        # The lane itself failed (it contains model failures on its own): fail
        # the running rows and take them out at the next step.
        events = [
            RowEvent(r.id, error=error)
            for r in self.books
            if r.lane is LaneName.BATCH and r.phase is Phase.RUNNING
        ]
        self.planner.remove(*(event.id for event in events))
        self.planner.lane_unknown()
        # Embedding requests whose inputs rode on the failed step fail with it.
        for request in self.books:
            work = request.embed
            if work is not None and request.phase is Phase.RUNNING and work.in_flight:
                self.planner.drop_embed(request.id)
                events.append(RowEvent(request.id, error=error))
        return events

    def _route_vector(self, vector: EmbedVector, now: float) -> None:
        request = self.books.get(vector.id)
        if request is None or request.phase is not Phase.RUNNING or request.embed is None:
            return  # cancelled while its inputs were in the pass
        if vector.error is not None:
            self.planner.drop_embed(request.id)
            self._route_row(RowEvent(request.id, error=vector.error), now)
            return
        request.embed.receive(vector.index, vector.vector)
        if request.embed.complete:
            self.books.embedded(request)
            self._route_row(RowEvent(request.id, finish_reason="stop"), now)

    def _route_row(self, event: RowEvent, now: float) -> None:
        request = self.books.get(event.id)
        if request is None or request.phase is not Phase.RUNNING:
            return
        self.books.deliver(request, event, now)
        if event.error is not None:
            self.arbiter.row_ended(request.id, Outcome.FAILED, now)
            self.books.end(request, Ending.FAILED)
        elif event.finish_reason is not None:
            self.arbiter.row_ended(request.id, Outcome.FINISHED, now)
            self.books.end(request, Ending.FINISHED)
        elif self.books.stalled(request):
            self.cancel(request, now)
