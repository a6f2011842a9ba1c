"""The GPU-owner actor: one Trio task that feeds the arbiter and carries out its decisions.

Theory of operation
===================

Submissions wait in the bounded :mod:`~trio_mlx._core.inbox` until the actor
takes them to the arbiter; cancellations are synchronous calls on the Trio
thread, the actor's own, so they are never dropped or blocked
(:mod:`~trio_mlx._core.endings`). Both ring the actor's doorbell. The actor
drains the inbox, asks ``arbiter.decide(now)`` and carries the decision out:

- ``Admit`` / ``Resume``: the rows join the next step (:mod:`~trio_mlx._core.parking`);
- ``Step``: ONE worker call removes cancelled rows, inserts admitted ones and
  decodes, as the :class:`~trio_mlx._core.planner.StepPlanner` plans; in plain
  decoding it may run a short *burst* of steps, which stops at the first step
  in which a row finishes, fails or gets its first token, and as soon as the
  doorbell rings, so the arbiter misses nothing it would act on. The result
  comes back as a ``run_sync_soon`` callback that routes the events
  (:mod:`~trio_mlx._core.routing`), decides again and, in steady decoding,
  sends the next step right there: a step costs one wake-up of the Trio loop;
- ``Park``: one worker call takes the rows' KV caches out of the batch;
- ``Start``: a child task runs the exclusive job (:mod:`~trio_mlx._core.jobs`);
- ``Wait``: sleep until the doorbell rings.

The worker thread is the only place MLX runs. When it dies, or when the engine
shuts down, the arbiter closes and every pending request ends with
:class:`~trio_mlx.EngineClosed`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import outcome
import trio

from trio_mlx._core import endings
from trio_mlx._core.arbiter import (
    Admit,
    Arbiter,
    ArbiterPolicy,
    Decision,
    Park,
    Resume,
    Start,
    Step,
    Wait,
)
from trio_mlx._core.gate import LaneName
from trio_mlx._core.inbox import Inbox
from trio_mlx._core.jobs import Jobs, SerialWork
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.parking import Parking
from trio_mlx._core.planner import StepPlanner
from trio_mlx._core.request import EngineStatistics, Request
from trio_mlx._core.routing import StepRouter
from trio_mlx._core.snapshot import engine_statistics
from trio_mlx._core.worker import Worker
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.embed import EmbedLane, embed_then_step
from trio_mlx._lanes.records import StepResult

__all__ = ["Actor"]


@attrs.define(eq=False)
class Actor:
    """Owns the arbiter, the worker and the lanes; one per engine."""

    policy: ArbiterPolicy
    worker: Worker
    lane: BatchLane
    #: Decides what each step call carries (rows in and out, burst length).
    planner: StepPlanner
    #: Builds the worker-side callable of a serial generation.
    serial_work: SerialWork
    adapters: Callable[[], tuple[str, ...]]
    #: Called with each decision and the arbiter's statistics after it (tests record them).
    decision_hook: Callable[[Any, Any], None] | None = None
    #: Processes the model is sharded over (reported in statistics).
    ranks: int = 1
    #: A request whose unread output passes this is cancelled (None: no limit).
    max_unread: int | None = None
    #: Runs the embedding inputs a step carries (None: the engine serves no embeddings).
    embedder: EmbedLane | None = None
    _arbiter: Arbiter = attrs.field(init=False)
    #: The live requests and the counts of the ended ones.
    _books: Ledger = attrs.field(init=False)
    _inbox: Inbox = attrs.field(init=False)
    _jobs: Jobs = attrs.field(init=False)
    _parking: Parking = attrs.field(init=False)
    _router: StepRouter = attrs.field(init=False)
    _ids: Any = attrs.field(init=False, factory=lambda: itertools.count(1))
    _wake: trio.Event = attrs.field(init=False, factory=trio.Event)
    _stopped: bool = attrs.field(init=False, default=False)
    #: A decision the step chain took from the arbiter, for the actor task to carry out.
    _handoff: Decision | None = attrs.field(init=False, default=None)
    _chain_done: trio.Event = attrs.field(init=False, factory=trio.Event)
    _chain_error: BaseException | None = attrs.field(init=False, default=None)
    #: Set by the doorbell, read by the MLX thread: a burst stops at the next step boundary.
    _news: threading.Event = attrs.field(init=False, factory=threading.Event)

    def __attrs_post_init__(self) -> None:
        arbiter = self._arbiter = Arbiter(self.policy, now=trio.current_time())
        books = self._books = Ledger(self.max_unread)
        self._inbox = Inbox(self.policy, arbiter, books)
        self._jobs = Jobs(self.worker, arbiter, books, self.serial_work, self._cancel, self._ring)
        self._parking = Parking(
            self.worker, self.lane, arbiter, self.planner, books, lambda: self._stopped
        )
        self._router = StepRouter(arbiter, self.planner, books, self._cancel)

    # --- the synchronous core, called from the Trio thread ---

    def new_id(self) -> int:
        """A fresh request id (unique across rows and jobs)."""
        return int(next(self._ids))

    @property
    def closed(self) -> bool:
        """Whether new submissions are refused."""
        return self._inbox.closed

    def submit_nowait(self, request: Request) -> None:
        """Put a request in the inbox, or raise EngineOverloaded / EngineClosed at once."""
        self._inbox.put_nowait(request)
        self._ring(interrupt=self._ends_burst(request, request.submitted))

    async def submit(self, request: Request) -> None:
        """Submit and wait until the actor accepts (queues) the request, or raise why not."""
        self.submit_nowait(request)
        try:
            await request.accepted.wait()
        except BaseException:
            self.cancel_nowait(request)
            raise
        if request.rejection is not None:
            raise request.rejection

    def cancel_nowait(self, request: Request) -> None:
        """Withdraw a request; a running row leaves the batch at the next step."""
        self._cancel(request, trio.current_time())

    def _cancel(self, request: Request, now: float) -> None:
        if endings.cancel(request, now, self._arbiter, self.planner, self._books):
            self._ring()

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot: arbiter state, counters, worker liveness."""
        return engine_statistics(
            self._arbiter,
            self._books,
            self.planner,
            self.worker,
            adapters=self.adapters(),
            ranks=self.ranks,
        )

    async def wait_idle(self) -> None:
        """Wait until no request is pending."""
        await self._books.wait_idle()

    def close_nowait(self, reason: str = "the engine is shutting down") -> None:
        """Close the arbiter: every pending request ends with EngineClosed."""
        self._inbox.refuse()
        if self._stopped:
            return
        self._stopped = True
        self._chain_done.set()
        self._inbox.close()
        endings.close_all(self._arbiter, self._books, reason, trio.current_time())
        self._ring()

    def begin_close(self) -> None:
        """Refuse new submissions; in-flight work carries on."""
        self._inbox.refuse()

    def on_worker_death(self, death: BaseException | None) -> None:
        """The worker thread ended: if that was not the plan, the engine is dead."""
        if not self._stopped:
            self.close_nowait(f"the MLX worker thread died: {death!r}")

    # --- the actor task ---

    async def run(self, ready: Any = None, *, task_status: trio.TaskStatus[Any]) -> None:
        """The actor loop; reports ``ready`` as started (the model is loaded and warm)."""
        async with trio.open_nursery() as nursery:
            task_status.started(ready)
            try:
                await self._loop(nursery)
            except BaseException:
                # Cancelled from outside, or a bug: nobody may wait forever.
                self.close_nowait("the engine's actor stopped")
                raise

    async def _loop(self, nursery: trio.Nursery) -> None:
        while not self._stopped:
            self._wake = trio.Event()
            decision, self._handoff = self._handoff, None
            if decision is None:
                self._chain_done = trio.Event()
                decision = self._advance()
            match decision:
                case None:
                    # Decode runs as a chain of worker callbacks (see _step_finished);
                    # this task sleeps until the chain hands back another decision.
                    await self._chain_done.wait()
                    if self._chain_error is not None:
                        raise self._chain_error
                case Park():
                    await self._parking.park()
                case Start(job_id):
                    self._jobs.start(nursery, self._books[job_id])
                case Wait(deadline):
                    if self.planner.discard_due(self._arbiter.state):
                        await self._parking.discard()
                        continue
                    with trio.move_on_at(deadline if deadline is not None else float("inf")):
                        await self._wake.wait()

    def _advance(self) -> Decision | None:
        """Decide what comes next: the one place that does, for the actor task and the chain.

        A ``Step`` is sent to the worker right here and None returned: the step
        chain goes on (the result comes back to :meth:`_step_finished`, which
        advances again). Any other decision is returned for the actor task.
        """
        decision = self._decide()
        if isinstance(decision, Step):
            self._submit_step()
            return None
        return decision

    def _decide(self) -> Decision:
        """Take the inbox to the arbiter and ask it what next.

        ``Admit`` and ``Resume`` only queue rows for the next step, so they are
        carried out here; any other decision is returned.
        """
        while True:
            self._inbox.take()
            decision = self._arbiter.decide(trio.current_time())
            if self.decision_hook is not None:
                self.decision_hook(decision, self._arbiter.statistics())
            match decision:
                case Admit(ids) | Resume(ids):
                    self._parking.queue(ids)
                case Park(ids):
                    # The arbiter counts these rows parked from now on: so must
                    # a cancel that arrives before the park itself has run.
                    self._parking.mark(ids)
                    return decision
                case _:
                    return decision

    def _ends_burst(self, request: Request, now: float) -> bool:
        """Whether a submission ends the burst in flight (see StepPlanner.ends_burst)."""
        if request.lane is LaneName.EMBED:
            return self.planner.embed_due(self._arbiter.state, self._arbiter.jobs_waiting)
        if request.lane is not LaneName.BATCH:
            return True
        return self.planner.ends_burst(
            now, self._arbiter.state, self._arbiter.jobs_waiting, self._inbox.waiting
        )

    def _submit_step(self) -> None:
        """Send the planner's next step to the worker."""
        plan = self.planner.next_step(
            trio.current_time(), self._arbiter.state, self._arbiter.jobs_waiting
        )
        for spec in plan.inserts:
            self._books[spec.id].inserted = True
        # Cleared right after the decision (on this thread, with no checkpoint
        # in between): any later ring ends the burst at the next step.
        self._news.clear()
        call: Callable[[], StepResult] = partial(
            self.lane.step,
            plan,
            seconds=self.planner.burst_seconds,
            interrupt=self._news.is_set,
        )
        if self.embedder is not None:  # times every step: the embeddings' share reads it
            call = partial(embed_then_step, self.embedder, plan, call)
        self.worker.submit(call, self._step_finished)

    def _step_finished(self, result: outcome.Outcome[StepResult]) -> None:
        """A step's results, on the Trio thread: route them, then decide at once.

        In steady decoding the next step is sent from here, so a step costs
        one wake-up of the Trio loop and the actor task does not run at all.
        This runs as a ``run_sync_soon`` callback, where an exception would
        crash the whole Trio run: one is handed to the actor task instead.
        """
        try:
            self._route_step(result)
        except BaseException as exc:
            self._chain_error = exc
            self._chain_done.set()

    def _route_step(self, result: outcome.Outcome[StepResult]) -> None:
        if self._stopped:
            self._chain_done.set()
            return
        if not self.worker.alive:
            self.close_nowait("the MLX worker thread died")
            self._chain_done.set()
            return
        self._router.route(result)
        decision = self._advance()
        if decision is None:
            return
        # A Wait is not handed over: the actor task asks again after making a
        # fresh doorbell, so a submission that rings in between is not lost.
        if not isinstance(decision, Wait):
            self._handoff = decision
        self._chain_done.set()

    def _ring(self, *, interrupt: bool = True) -> None:
        self._wake.set()
        if interrupt:
            self._news.set()
