"""The GPU-owner actor: one Trio task that feeds the arbiter and carries out its decisions.

Theory of operation
===================

Submissions go through a bounded ``trio`` memory channel, the inbox:
``submit`` is ``send_nowait`` (a full inbox raises EngineOverloaded at once)
and then waits until the actor has taken the request to the arbiter (which
may still say the queue is full, or that the engine is closed).
Cancellations do not queue behind anything: ``cancel_nowait`` is a
synchronous call on the Trio thread, the actor's own thread, so it can never
be dropped or blocked. Both ring the actor's doorbell. The actor task drains
the inbox, then asks ``arbiter.decide(now)`` and carries the decision out:

- ``Admit`` / ``Resume``: remember the rows; they enter the batch with the next step;
- ``Step``: ONE worker call removes cancelled rows, inserts admitted ones, runs one
  decode step and returns every row's events; what it carries is the
  :class:`~trio_mlx._core.planner.StepPlanner`'s :class:`~trio_mlx._lanes.batch.StepPlan`
  (grouped admission may hold admitted rows back a few steps). In plain
  decoding (ADMITTING, no job waiting) that call may run a short *burst* of
  steps (the planner's ``burst_steps``, ``burst_seconds``); it stops at the
  first step in which a row finishes, fails or gets its first token, and as
  soon as the doorbell rings (a cancel, a submission), so the arbiter misses
  nothing it would have acted on and a cancelled row still leaves within one
  decode step. A row's tokens of the burst come as one event: routing and
  consumer wake-ups are per burst.
  Its result arrives as a ``run_sync_soon`` callback that routes the events to the requests' outboxes
  with ``put`` (never awaiting a consumer), reports ``step_done``, decides
  again, and in steady decoding sends the next step right there: a step costs
  one wake-up of the Trio loop, and the actor task sleeps until the decision
  is something other than a step;
- ``Park``: one worker call takes the rows' KV caches out of the batch;
- ``Start``: a child task runs the exclusive job on the worker (a serial
  generation, an adapter mount, a user function) and reports ``job_ended``;
- ``Wait``: sleep until the doorbell rings.

The worker thread is the only place MLX runs. When it dies, or when the engine
shuts down, the arbiter closes and every pending request ends with
:class:`~trio_mlx.EngineClosed`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import outcome
import trio

from trio_mlx._core.arbiter import (
    Admit,
    Arbiter,
    ArbiterPolicy,
    ArbiterStatistics,
    Decision,
    Outcome,
    Park,
    Rejection,
    Resume,
    Start,
    State,
    Step,
    Wait,
)
from trio_mlx._core.gate import LaneName
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.planner import StepPlanner
from trio_mlx._core.request import Ending, EngineStatistics, Phase, Request
from trio_mlx._core.worker import Worker
from trio_mlx._errors import (
    EngineClosed,
    EngineOverloaded,
    InvalidRequest,
)
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.output import RowEvent
from trio_mlx._lanes.records import RowSpec, StepResult
from trio_mlx._memory import KVBudget

__all__ = ["Actor", "too_large"]


def too_large(spec: RowSpec, memory: KVBudget) -> InvalidRequest:
    """The refusal of a request whose KV cache alone could never fit the budget."""
    prompt, max_tokens = len(spec.prompt), spec.params.max_tokens
    capacity = memory.row_capacity()
    needed = memory.profile.row_bytes(prompt + max_tokens)
    return InvalidRequest(
        f"the request needs a KV cache of {prompt + max_tokens} tokens ({prompt} prompt + "
        f"{max_tokens} max_tokens), {needed} bytes; the engine's KV memory budget is "
        f"{memory.limit} bytes, which holds at most {capacity} tokens for one request",
        param="prompt",
        code="kv_memory_exceeded",
    )


@attrs.define(eq=False)
class Actor:
    """Owns the arbiter, the worker and the lanes; one per engine."""

    policy: ArbiterPolicy
    worker: Worker
    lane: BatchLane
    #: Builds the worker-side callable of a serial generation.
    serial_work: Callable[[Request, Callable[[list[RowEvent]], None], Callable[[int], None]], Any]
    adapters: Callable[[], tuple[str, ...]]
    #: Called with each decision and the arbiter's statistics after it (tests record them).
    decision_hook: Callable[[Any, ArbiterStatistics], None] | None = None
    #: Processes the model is sharded over (reported in statistics).
    ranks: int = 1
    #: A request whose unread output passes this is cancelled (None: no limit).
    max_unread: int | None = None
    _arbiter: Arbiter = attrs.field(init=False)
    #: The live requests and the counts of the ended ones.
    _books: Ledger = attrs.field(init=False)
    _ids: Any = attrs.field(init=False, factory=lambda: itertools.count(1))
    _wake: trio.Event = attrs.field(init=False, factory=trio.Event)
    #: Decides what each step call carries (rows in and out, burst length); its
    #: fields are the burst and grouped-admission knobs.
    planner: StepPlanner = attrs.field(init=False)
    #: Rows of the last Park decision that the lane has still to park.
    _parking: list[int] = attrs.field(init=False, factory=list)
    _closing: bool = attrs.field(init=False, default=False)
    _stopped: bool = attrs.field(init=False, default=False)
    _batch_rows: int = attrs.field(init=False, default=0)
    _inbox_send: trio.MemorySendChannel[Request] = attrs.field(init=False)
    _inbox: trio.MemoryReceiveChannel[Request] = attrs.field(init=False)
    #: A decision the step chain took from the arbiter, for the actor task to carry out.
    _handoff: Decision | None = attrs.field(init=False, default=None)
    _chain_done: trio.Event = attrs.field(init=False, factory=trio.Event)
    _chain_error: BaseException | None = attrs.field(init=False, default=None)
    #: Set by the doorbell, read by the MLX thread: a burst stops at the next step boundary.
    _news: threading.Event = attrs.field(init=False, factory=threading.Event)

    def __attrs_post_init__(self) -> None:
        self._arbiter = Arbiter(self.policy, now=trio.current_time())
        self.planner = StepPlanner(
            lambda: self.lane.prefill_batch_size, lambda: self.lane.prefill_budget
        )
        # Room for a full queue plus a full batch: the arbiter, not the inbox,
        # is what normally says no.
        size = self.policy.max_queue + self.policy.max_batch
        self._inbox_send, self._inbox = trio.open_memory_channel[Request](size)
        self._books = Ledger(self.max_unread)

    # --- the synchronous core, called from the Trio thread ---

    def new_id(self) -> int:
        """A fresh request id (unique across rows and jobs)."""
        return int(next(self._ids))

    @property
    def closed(self) -> bool:
        """Whether new submissions are refused."""
        return self._closing or self._stopped

    def submit_nowait(self, request: Request) -> None:
        """Put a request in the inbox, or raise EngineOverloaded / EngineClosed at once."""
        if self.closed:
            self._books.refused(request.lane)
            raise EngineClosed("the engine is closed")
        try:
            self._inbox_send.send_nowait(request)
        except trio.WouldBlock:
            self._books.refused(request.lane)
            raise EngineOverloaded("the engine's inbox is full", retry_after=1.0) from None
        request.submitted = now = trio.current_time()
        self._books.open(request)
        self._ring(interrupt=self._ends_burst(request, now))

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

    def _take_inbox(self) -> None:
        """Move everything in the inbox to the arbiter (the actor's side of ``submit``)."""
        while True:
            try:
                request = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if request.phase is Phase.INBOX:
                self._accept(request)

    def _accept(self, request: Request) -> None:
        now = trio.current_time()
        spec = request.spec
        # A generation's worst case: its prompt and every token it may generate.
        tokens = 0 if spec is None else len(spec.prompt) + spec.params.max_tokens
        if request.lane is LaneName.BATCH:
            rejection = self._arbiter.submit_row(request.id, now, tokens)
        else:
            rejection = self._arbiter.submit_job(request.id, now, tokens)
        if rejection is None:
            request.phase = Phase.PENDING
            self._books.queued(request)
        elif rejection is Rejection.CLOSED:
            request.rejection = EngineClosed("the engine is closed")
            self._end(request, Ending.REJECTED)
        elif rejection is Rejection.TOO_LARGE:
            assert spec is not None
            assert self.policy.memory is not None
            request.rejection = too_large(spec, self.policy.memory)
            self._end(request, Ending.REJECTED)
        else:
            request.rejection = EngineOverloaded(
                f"the engine's queue is full ({self.policy.max_queue} waiting)", retry_after=1.0
            )
            self._end(request, Ending.REJECTED)
        request.accepted.set()

    def cancel_nowait(self, request: Request) -> None:
        """Withdraw a request; a running row leaves the batch at the next step."""
        self._cancel(request, trio.current_time())

    def _cancel(self, request: Request, now: float) -> None:
        if request.phase is Phase.DONE or request.id not in self._books:
            return
        request.cancel_flag.set()
        if request.phase is Phase.INBOX:
            # Never reached the arbiter; the actor skips it in the inbox.
            self._end(request, Ending.CANCELLED)
        elif request.lane is LaneName.BATCH:
            if request.phase is Phase.RUNNING:
                self._arbiter.row_ended(request.id, Outcome.CANCELLED, now)
                self.planner.withdraw(request.id)
            else:
                self._arbiter.cancel_row(request.id, now)
                if request.inserted:
                    self.planner.remove(request.id)
            self._end(request, Ending.CANCELLED)
        elif request.phase is Phase.PENDING:
            self._arbiter.cancel_job(request.id, now)
            self._end(request, Ending.CANCELLED)
        # A running job sees cancel_flag (a serial generation stops within a token).
        self._ring()

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot: arbiter state, counters, worker liveness."""
        arb = self._arbiter.statistics()
        books = self._books
        return EngineStatistics(
            state=arb.state.name,
            running_rows=arb.running_rows,
            queued_rows=arb.queued_rows,
            parked_rows=arb.parked_rows,
            waiting_jobs=arb.waiting_jobs,
            running_jobs=int(arb.running_job is not None),
            worker_alive=self.worker.alive,
            worker_busy_seconds=self.worker.busy_seconds,
            batch_rows=self._batch_rows,
            adapters=self.adapters(),
            requests=books.requests(),
            prompt_tokens=books.tokens("prompt"),
            cached_prompt_tokens=books.tokens("cached"),
            generated_tokens=books.tokens("generated"),
            drains=arb.drains,
            preemptions=arb.preemptions,
            steps=arb.steps,
            arbiter=arb,
            ranks=self.ranks,
            admissions=self.planner.admissions,
            prefill_chunk=self.planner.last_chunk,
            decode_step_seconds=self.planner.decode_seconds,
            prompt_token_seconds=self.planner.token_seconds,
            adapter_requests=books.adapter_requests(),
            adapter_rows=books.adapter_rows(),
            kv_memory_budget=arb.kv_bytes_budget or 0,
            kv_memory_reserved=arb.kv_bytes_reserved,
        )

    async def wait_idle(self) -> None:
        """Wait until no request is pending."""
        await self._books.wait_idle()

    def close_nowait(self, reason: str = "the engine is shutting down") -> None:
        """Close the arbiter: every pending request ends with EngineClosed."""
        self._closing = True
        if self._stopped:
            return
        self._stopped = True
        self._chain_done.set()
        self._inbox_send.close()
        if self._arbiter.state is not State.CLOSED:
            for item_id in self._arbiter.close(trio.current_time()):
                request = self._books.get(item_id)
                if request is not None:
                    self._close_request(request, reason)
        for request in self._books:
            self._close_request(request, reason)
        self._ring()

    def _close_request(self, request: Request, reason: str) -> None:
        request.cancel_flag.set()
        error = EngineClosed(reason)
        if request.phase is Phase.INBOX:
            request.rejection = error
        request.result = outcome.Error(error)
        request.outbox.put(RowEvent(request.id, error=error))
        self._end(request, Ending.CLOSED)

    def begin_close(self) -> None:
        """Refuse new submissions; in-flight work carries on."""
        self._closing = True

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
                case Park(ids):
                    await self._park(ids)
                case Start(job_id):
                    self._start(nursery, self._books[job_id])
                case Wait(deadline):
                    if self.planner.discard_due(self._arbiter.state):
                        await self._discard()
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
            self._take_inbox()
            decision = self._arbiter.decide(trio.current_time())
            if self.decision_hook is not None:
                self.decision_hook(decision, self._arbiter.statistics())
            match decision:
                case Admit(ids) | Resume(ids):
                    self._queue_rows(ids)
                case Park(ids):
                    # The arbiter counts these rows parked from now on: so must
                    # a cancel that arrives before the park itself has run.
                    self._parking = self._mark_parked(ids)
                    return decision
                case _:
                    return decision

    async def _discard(self) -> None:
        """Free cancelled rows' caches now, when no step would do it soon."""
        removes = self.planner.take_removes()
        with contextlib.suppress(Exception):
            # Best effort: failing here only keeps the rows' caches a while longer.
            self._batch_rows = await self.worker.run(partial(self.lane.discard, removes))
        self.planner.lane_unknown()

    def _queue_rows(self, ids: tuple[int, ...]) -> None:
        """Admitted or resumed rows join the next step: new ones inserted, parked ones resumed."""
        now = trio.current_time()
        for row_id in ids:
            request = self._books[row_id]
            request.phase = Phase.RUNNING
            if request.inserted:
                self.planner.resume(row_id)
            else:
                assert request.spec is not None
                self.planner.insert(request.spec, now)

    def _ends_burst(self, request: Request, now: float) -> bool:
        """Whether a submission ends the burst in flight (see StepPlanner.ends_burst)."""
        if request.lane is not LaneName.BATCH:
            return True
        arriving = self._inbox_send.statistics().current_buffer_used
        return self.planner.ends_burst(
            now, self._arbiter.state, self._arbiter.jobs_waiting, arriving
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
        call = partial(
            self.lane.step,
            plan,
            seconds=self.planner.burst_seconds,
            interrupt=self._news.is_set,
        )
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
        if isinstance(result, outcome.Error):
            # The lane itself failed (it contains model failures on its own):
            # fail the running rows and take them out at the next step.
            error = result.error
            events = [
                RowEvent(r.id, error=error)
                for r in self._books
                if r.lane is LaneName.BATCH and r.phase is Phase.RUNNING
            ]
            self.planner.remove(*(event.id for event in events))
            self.planner.lane_unknown()
        else:
            step = result.unwrap()
            events = step.events
            self._batch_rows = step.rows
            self.planner.stepped(step.decoding, step.steps)
            self.planner.timed(step.timings)
            for row_id, cached in step.cached.items():
                request = self._books.get(row_id)
                if request is not None:
                    self._books.cached(request, cached)
        now = trio.current_time()
        for event in events:
            self._route_row(event, now)
        self._arbiter.step_done(now)
        decision = self._advance()
        if decision is None:
            return
        # A Wait is not handed over: the actor task asks again after making a
        # fresh doorbell, so a submission that rings in between is not lost.
        if not isinstance(decision, Wait):
            self._handoff = decision
        self._chain_done.set()

    def _route_row(self, event: RowEvent, now: float) -> None:
        request = self._books.get(event.id)
        if request is None or request.phase is not Phase.RUNNING:
            return
        self._books.deliver(request, event, now)
        if event.error is not None:
            self._arbiter.row_ended(request.id, Outcome.FAILED, now)
            self._end(request, Ending.FAILED)
        elif event.finish_reason is not None:
            self._arbiter.row_ended(request.id, Outcome.FINISHED, now)
            self._end(request, Ending.FINISHED)
        elif self._books.stalled(request):
            self._cancel(request, now)

    def _mark_parked(self, ids: tuple[int, ...]) -> list[int]:
        """Bookkeeping of a Park decision; returns the rows the lane must park."""
        in_lane = []
        for row_id in ids:
            request = self._books[row_id]
            request.phase = Phase.PENDING
            if not self.planner.unqueue(row_id):
                in_lane.append(row_id)
        return in_lane

    async def _park(self, ids: tuple[int, ...]) -> None:
        # ``ids`` were marked parked when the decision was made (_decide); a row
        # cancelled since is parked anyway and then removed (StepPlanner.remove).
        in_lane, self._parking = self._parking, []
        self.planner.lane_unknown()
        if in_lane:
            try:
                await self.worker.run(partial(self.lane.park, in_lane))
            except Exception as exc:
                if self._stopped:
                    return
                now = trio.current_time()
                for row_id in in_lane:
                    request = self._books.get(row_id)
                    if request is None:
                        continue
                    self._arbiter.cancel_row(row_id, now)
                    self.planner.remove(row_id)
                    self._books.deliver(request, RowEvent(row_id, error=exc), now)
                    self._end(request, Ending.FAILED)

    def _start(self, nursery: trio.Nursery, request: Request) -> None:
        request.phase = Phase.RUNNING
        nursery.start_soon(self._run_job, request)

    async def _run_job(self, request: Request) -> None:
        if request.lane is LaneName.SERIAL:
            emit = partial(self.worker.call_soon_in_trio, self._route_serial)
            cached = partial(self.worker.call_soon_in_trio, self._books.cached, request)
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
        now = trio.current_time()
        request.result = result
        if isinstance(result, outcome.Error):
            if request.lane is LaneName.SERIAL:
                self._books.deliver(request, RowEvent(request.id, error=result.error), now)
            self._arbiter.job_ended(request.id, Outcome.FAILED, now)
            self._end(request, Ending.FAILED)
        elif request.cancel_flag.is_set():
            self._arbiter.job_ended(request.id, Outcome.CANCELLED, now)
            self._end(request, Ending.CANCELLED)
        else:
            if request.final is not None:
                self._books.deliver(request, request.final, now)
            self._arbiter.job_ended(request.id, Outcome.FINISHED, now)
            self._end(request, Ending.FINISHED)
        self._ring()

    def _route_serial(self, events: list[RowEvent]) -> None:
        now = trio.current_time()
        for event in events:
            request = self._books.get(event.id)
            if request is None or request.phase is not Phase.RUNNING:
                return
            if event.finish_reason is not None:
                # Held until the job has ended, so the request ends exactly once, then.
                request.final = event
                return
            self._books.deliver(request, event, now)
            if self._books.stalled(request):
                self._cancel(request, now)

    def _end(self, request: Request, how: Ending) -> None:
        self._books.end(request, how)

    def _ring(self, *, interrupt: bool = True) -> None:
        self._wake.set()
        if interrupt:
            self._news.set()
