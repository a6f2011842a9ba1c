"""The arbiter: who gets the GPU. A pure, synchronous state machine.

Theory of operation
===================

The engine actor owns one model and one GPU, and two kinds of work compete for
them:

- **rows**: batchable generations, decoded together in one continuous batch;
- **exclusive jobs**: work that needs the model alone (a serial generation, an
  adapter mount or unmount, a user ``run_exclusive`` function).

The actor feeds the arbiter *events* (``submit_row``, ``row_ended``,
``step_done``, ...) and, in a loop, asks :meth:`Arbiter.decide` what to do next;
it carries out each *decision* (``Admit``, ``Resume``, ``Step``, ``Park``,
``Start``, ``Wait``) and reports back with more events. The arbiter has no clock
and no I/O: every call takes ``now`` (the caller's clock, never going
backwards), so tests drive time and steps exactly.

The rules
---------

1. **States.** ``ADMITTING``: the batch lane is open. ``DRAINING``: a job waits
   and the batch lane is winding down: nothing is admitted, running rows keep
   stepping. ``EXCLUSIVE``: the jobs of one *cycle* run, one at a time, with no
   row running. ``CLOSED``: terminal.
2. **Admission** (``ADMITTING`` only): parked rows resume first, then queued
   rows are admitted in arrival order, while fewer than ``max_batch`` run and,
   with a KV memory budget (``ArbiterPolicy.memory``), while the worst case of
   the running and parked rows with the next queued one fits it (each row
   counts its prompt plus ``max_tokens``, priced by
   :class:`~trio_mlx._memory.KVBudget`). The first queued row that does not
   fit stops admission: no later row jumps it, so it waits only for running
   rows to end, never for newer ones.
3. **A drain begins** as soon as a job waits and the batch lane has had its
   turn: ``min_batch_steps`` decode steps since the last cycle ended, or no rows
   at all (queued, parked or running). Before the first cycle the lane's turn
   counts as taken. The drain deadline is ``drain_timeout`` after the drain
   began (``None``: no deadline).
4. **While draining**, running rows step until they have all ended (then the
   first job starts) or the deadline has passed (then every running row is
   parked, its KV cache kept, and the first job starts). If every waiting job
   is cancelled, admission resumes at once.
5. **A cycle** is the set of jobs waiting when the first of them starts.
   They run first come, first served. Jobs arriving later wait for the next
   cycle. When the cycle's last job has ended the batch lane reopens, and rule 3
   gives it ``min_batch_steps`` steps before the next drain, whenever it has
   rows. So a stream of jobs cannot starve the batch, and the drain deadline
   keeps long rows from starving a job. ``min_batch_steps=0`` gives jobs strict
   priority.
6. **Bounded queue.** ``max_queue`` bounds the items *waiting*: queued rows plus
   waiting jobs. A row that will be admitted at the next ``decide`` does not
   wait: in ``ADMITTING`` with no job waiting, the batch's free slots count as
   extra room. A submission past the bound is rejected at once
   (``Rejection.QUEUE_FULL``); on ``CLOSED`` every submission is rejected
   (``Rejection.CLOSED``); a row or job whose tokens alone exceed the KV memory
   budget could never run and is rejected too (``Rejection.TOO_LARGE``). All
   count as ``Outcome.REJECTED``. So a queued row always fits an empty batch,
   and admission never deadlocks.
7. **One step at a time.** After ``Step`` the arbiter waits for ``step_done``;
   the batch changes only between steps, and an exclusive job never starts while
   a step is in flight.
8. **Every item ends exactly once**, with one ``Outcome``: rows through
   ``row_ended`` (running) or ``cancel_row`` (queued or parked), jobs through
   ``job_ended`` (running) or ``cancel_job`` (waiting), everything still
   pending through ``close``.
9. **Illegal events raise** :class:`ArbiterError` and change nothing: an event
   that :data:`EVENTS` does not allow in the current state, an unknown or
   duplicate id, an item in the wrong place, a clock that goes backwards, a
   negative token count.

How the code is laid out
------------------------

:data:`EVENTS` says which events each state accepts (h11-style). :data:`TABLE`
holds every transition as data, and the code runs it: after each event the
arbiter applies the first ``AFTER_EVENT`` row of its state whose condition
holds (repeatedly; these rows change state without the actor doing anything),
and :meth:`Arbiter.decide` applies the first matching ``DECIDE`` row and
returns its decision. :func:`render_mermaid` and :func:`render_table` draw the
same table into ``design/arbiter.md``; regenerate it with
``python -m trio_mlx._core.arbiter_diagram design/arbiter.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeAlias, assert_never

import attrs

from trio_mlx._memory import KVBudget

__all__ = [
    "EVENTS",
    "TABLE",
    "Admit",
    "Arbiter",
    "ArbiterError",
    "ArbiterPolicy",
    "ArbiterStatistics",
    "Decision",
    "Does",
    "Event",
    "On",
    "Outcome",
    "Park",
    "Rejection",
    "Resume",
    "Start",
    "State",
    "Step",
    "Transition",
    "Wait",
    "When",
]


class ArbiterError(Exception):
    """An illegal event: the arbiter raised it and is exactly as it was before."""


class State(enum.Enum):
    """Who owns the GPU."""

    ADMITTING = "ADMITTING"
    DRAINING = "DRAINING"
    EXCLUSIVE = "EXCLUSIVE"
    CLOSED = "CLOSED"


class Outcome(enum.Enum):
    """How an item ended; every submitted item gets exactly one."""

    FINISHED = "FINISHED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    REJECTED = "REJECTED"
    CLOSED = "CLOSED"


class Rejection(enum.Enum):
    """Why a submission was refused."""

    QUEUE_FULL = "QUEUE_FULL"
    CLOSED = "CLOSED"
    #: Its tokens alone exceed the KV memory budget: it could never run.
    TOO_LARGE = "TOO_LARGE"


# The outcomes the actor may report for a running item; the arbiter assigns the rest.
_REPORTABLE = frozenset({Outcome.FINISHED, Outcome.CANCELLED, Outcome.FAILED})


def _at_least(minimum: int) -> Callable[[Any, Any, int], Any]:
    return attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(minimum))


def _timeout(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not (isinstance(value, int | float) and value >= 0):
        raise ValueError(f"'{attribute.name}' must be None or a number >= 0: {value!r}")


@attrs.frozen
class ArbiterPolicy:
    """How the arbiter shares the GPU (see the rules at the top of the module)."""

    max_batch: int = attrs.field(default=8, validator=_at_least(1))
    max_queue: int = attrs.field(default=256, validator=_at_least(0))
    drain_timeout: float | None = attrs.field(default=1.0, validator=_timeout)
    min_batch_steps: int = attrs.field(default=8, validator=_at_least(0))
    #: The rows' KV memory budget (None: rows are bounded by count only).
    memory: KVBudget | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(KVBudget))
    )


# --- decisions -------------------------------------------------------------------------


@attrs.frozen
class Admit:
    """Insert these queued rows into the batch (they are running now)."""

    ids: tuple[int, ...]


@attrs.frozen
class Resume:
    """Re-insert these parked rows, with the KV caches kept at ``Park``."""

    ids: tuple[int, ...]


@attrs.frozen
class Step:
    """Run one decode step of the running rows, then call ``step_done``."""


@attrs.frozen
class Park:
    """Take these running rows out of the batch, keeping their KV caches."""

    ids: tuple[int, ...]


@attrs.frozen
class Start:
    """Run this job alone now, then call ``job_ended``."""

    job_id: int


@attrs.frozen
class Wait:
    """Nothing to do until the next event, or until ``deadline`` (caller's clock).

    Every current rule re-decides on an event, so ``deadline`` is ``None``; the
    field lets a time-based rule arrive without changing the actor.
    """

    deadline: float | None = None


Decision: TypeAlias = Admit | Resume | Step | Park | Start | Wait


# --- the tables -----------------------------------------------------------------------


class Event(enum.Enum):
    """The arbiter's inputs, named after the methods that take them."""

    SUBMIT_ROW = "submit_row"
    SUBMIT_JOB = "submit_job"
    ROW_ENDED = "row_ended"
    CANCEL_ROW = "cancel_row"
    CANCEL_JOB = "cancel_job"
    JOB_ENDED = "job_ended"
    STEP_DONE = "step_done"
    CLOSE = "close"
    DECIDE = "decide"


_ALWAYS = frozenset({Event.SUBMIT_ROW, Event.SUBMIT_JOB, Event.CLOSE, Event.DECIDE})
_WITHDRAW = frozenset({Event.CANCEL_ROW, Event.CANCEL_JOB})
_BATCH = frozenset({Event.ROW_ENDED, Event.STEP_DONE})

#: Which events each state accepts; any other raises ArbiterError.
EVENTS: Mapping[State, frozenset[Event]] = MappingProxyType(
    {
        State.ADMITTING: _ALWAYS | _WITHDRAW | _BATCH,
        State.DRAINING: _ALWAYS | _WITHDRAW | _BATCH,
        State.EXCLUSIVE: _ALWAYS | _WITHDRAW | {Event.JOB_ENDED},
        State.CLOSED: _ALWAYS,
    }
)


class On(enum.Enum):
    """When a transition row is tried."""

    AFTER_EVENT = "after any event"
    DECIDE = "decide"
    CLOSE = "close"


class When(enum.Enum):
    """A row's condition, in words; ``Arbiter._holds`` evaluates it."""

    ALWAYS = "always"
    OTHERWISE = "otherwise"
    CYCLE_DUE = "a job waits, batch lane had its turn"
    NO_JOB_WAITS = "every waiting job was cancelled"
    CYCLE_OVER = "cycle over"
    STEP_IN_FLIGHT = "a step is in flight"
    PARKED_AND_ROOM = "rows parked, room in batch"
    QUEUED_AND_ROOM = "rows queued, room in batch, first fits KV memory"
    ROWS_RUNNING = "rows running"
    BEFORE_DEADLINE = "rows running, before drain deadline"
    JOB_RUNNING = "a job runs"


class Does(enum.Enum):
    """What a row does; for ``decide`` rows, the decision it returns."""

    BEGIN_DRAIN = "begin drain"
    END_DRAIN = "end drain"
    END_CYCLE = "end cycle"
    WAIT = "Wait"
    RESUME = "Resume(parked)"
    ADMIT = "Admit(queued)"
    STEP = "Step"
    PARK = "Park(running)"
    START_CYCLE = "Start(first job), cycle = jobs waiting"
    START_NEXT = "Start(next job of cycle)"
    CLOSE = "close every pending item"


@attrs.frozen
class Transition:
    """One row: in ``state``, on ``on``, if ``when`` holds, do ``does`` and go to ``to``."""

    state: State
    on: On
    when: When
    to: State
    does: Does


def _rows(state: State, on: On, *rows: tuple[When, State, Does]) -> list[Transition]:
    return [Transition(state, on, when, to, does) for when, to, does in rows]


_A, _D, _E, _C = State.ADMITTING, State.DRAINING, State.EXCLUSIVE, State.CLOSED

#: Every transition. Rows of one (state, on) are tried in order; the first whose
#: condition holds applies. Every ``decide`` list ends in a catch-all.
TABLE: tuple[Transition, ...] = (
    *_rows(_A, On.AFTER_EVENT, (When.CYCLE_DUE, _D, Does.BEGIN_DRAIN)),
    *_rows(_D, On.AFTER_EVENT, (When.NO_JOB_WAITS, _A, Does.END_DRAIN)),
    *_rows(_E, On.AFTER_EVENT, (When.CYCLE_OVER, _A, Does.END_CYCLE)),
    *_rows(
        _A,
        On.DECIDE,
        (When.STEP_IN_FLIGHT, _A, Does.WAIT),
        (When.PARKED_AND_ROOM, _A, Does.RESUME),
        (When.QUEUED_AND_ROOM, _A, Does.ADMIT),
        (When.ROWS_RUNNING, _A, Does.STEP),
        (When.OTHERWISE, _A, Does.WAIT),
    ),
    *_rows(
        _D,
        On.DECIDE,
        (When.STEP_IN_FLIGHT, _D, Does.WAIT),
        (When.BEFORE_DEADLINE, _D, Does.STEP),
        (When.ROWS_RUNNING, _D, Does.PARK),
        (When.OTHERWISE, _E, Does.START_CYCLE),
    ),
    *_rows(
        _E,
        On.DECIDE,
        (When.JOB_RUNNING, _E, Does.WAIT),
        (When.OTHERWISE, _E, Does.START_NEXT),
    ),
    *_rows(_C, On.DECIDE, (When.OTHERWISE, _C, Does.WAIT)),
    *(Transition(state, On.CLOSE, When.ALWAYS, _C, Does.CLOSE) for state in (_A, _D, _E)),
)

#: TABLE's rows by (state, on), in table order: what ``Arbiter._first`` tries.
_ROWS: dict[tuple[State, On], tuple[Transition, ...]] = {
    key: tuple(row for row in TABLE if (row.state, row.on) == key)
    for key in dict.fromkeys((row.state, row.on) for row in TABLE)
}


# --- statistics -----------------------------------------------------------------------


@attrs.frozen
class ArbiterStatistics:
    """A snapshot of the arbiter, as of the last event.

    ``outcomes`` counts items per ``Outcome`` name; ``time_in_state`` sums the
    caller's clock per ``State`` name; ``drains`` counts drains begun,
    ``preemptions`` rows parked, ``steps`` decode steps completed.
    ``drain_deadline`` is set while ``DRAINING`` with a timeout.
    ``kv_bytes_reserved`` is the worst case of the running and parked rows'
    KV caches, ``kv_bytes_budget`` the policy's budget (None: none).
    """

    state: State
    running_rows: int
    queued_rows: int
    parked_rows: int
    waiting_jobs: int
    running_job: int | None
    outcomes: Mapping[str, int]
    time_in_state: Mapping[str, float]
    drains: int
    preemptions: int
    steps: int
    step_in_flight: bool
    drain_deadline: float | None
    kv_bytes_reserved: int = 0
    kv_bytes_budget: int | None = None


# --- the machine ----------------------------------------------------------------------


class _Place(enum.Enum):
    QUEUED = "a queued row"
    PARKED = "a parked row"
    RUNNING = "a running row"
    WAITING = "a waiting job"
    JOB_RUNNING = "the running job"


@attrs.define(eq=False)
class Arbiter:
    """Decides who gets the GPU; see the module docstring for the rules.

    ``Arbiter(policy, now=t0)``: ``now`` starts the caller's clock.
    """

    _policy: ArbiterPolicy = attrs.field(factory=ArbiterPolicy)
    _now: float = attrs.field(default=0.0, kw_only=True)
    _state: State = attrs.field(init=False, default=State.ADMITTING)
    # Live items: where each id is, and one insertion-ordered dict per place.
    _where: dict[int, _Place] = attrs.field(init=False, factory=dict)
    _queued: dict[int, None] = attrs.field(init=False, factory=dict)
    _parked: dict[int, None] = attrs.field(init=False, factory=dict)
    _running: dict[int, None] = attrs.field(init=False, factory=dict)
    _waiting: dict[int, None] = attrs.field(init=False, factory=dict)
    _running_job: int | None = attrs.field(init=False, default=None)
    # Each live row's worst-case tokens (prompt + max_tokens), for the KV budget.
    _tokens: dict[int, int] = attrs.field(init=False, factory=dict)
    # The jobs of the current cycle that still wait (rule 5).
    _cycle: set[int] = attrs.field(init=False, factory=set)
    _step_in_flight: bool = attrs.field(init=False, default=False)
    _drain_deadline: float | None = attrs.field(init=False, default=None)
    # Steps the batch lane is still owed before the next drain may begin (rule 3).
    _steps_owed: int = attrs.field(init=False, default=0)
    _outcomes: dict[Outcome, int] = attrs.field(
        init=False, factory=lambda: dict.fromkeys(Outcome, 0)
    )
    _time_in_state: dict[State, float] = attrs.field(
        init=False, factory=lambda: dict.fromkeys(State, 0.0)
    )
    _drains: int = attrs.field(init=False, default=0)
    _preemptions: int = attrs.field(init=False, default=0)
    _steps: int = attrs.field(init=False, default=0)

    @property
    def state(self) -> State:
        """The current state."""
        return self._state

    @property
    def jobs_waiting(self) -> bool:
        """Whether a serial or exclusive job waits for the model (cheaper than statistics())."""
        return bool(self._waiting)

    # --- events ---

    def submit_row(self, row_id: int, now: float, tokens: int = 0) -> Rejection | None:
        """Queue a row of at most ``tokens`` tokens; ``None`` means accepted, else why not."""
        return self._submit(Event.SUBMIT_ROW, row_id, now, tokens)

    def submit_job(self, job_id: int, now: float, tokens: int = 0) -> Rejection | None:
        """Queue an exclusive job (a generation of at most ``tokens`` tokens, or 0);
        ``None`` means accepted, else why it was rejected."""
        return self._submit(Event.SUBMIT_JOB, job_id, now, tokens)

    def row_ended(self, row_id: int, outcome: Outcome, now: float) -> None:
        """A running row finished, failed or was cancelled."""
        self._check(Event.ROW_ENDED, now)
        self._check_reported(outcome)
        self._check_place(
            Event.ROW_ENDED, row_id, {_Place.RUNNING}, "cancel_row withdraws queued and parked rows"
        )
        self._advance(now)
        del self._running[row_id]
        self._end(row_id, outcome)
        self._settle()

    def cancel_row(self, row_id: int, now: float) -> None:
        """Withdraw a queued or parked row (``Outcome.CANCELLED``)."""
        self._check(Event.CANCEL_ROW, now)
        place = self._check_place(
            Event.CANCEL_ROW,
            row_id,
            {_Place.QUEUED, _Place.PARKED},
            "the actor reports a running row's end with row_ended",
        )
        self._advance(now)
        del (self._queued if place is _Place.QUEUED else self._parked)[row_id]
        self._end(row_id, Outcome.CANCELLED)
        self._settle()

    def cancel_job(self, job_id: int, now: float) -> None:
        """Withdraw a waiting job (``Outcome.CANCELLED``)."""
        self._check(Event.CANCEL_JOB, now)
        self._check_place(
            Event.CANCEL_JOB,
            job_id,
            {_Place.WAITING},
            "the actor reports the running job's end with job_ended",
        )
        self._advance(now)
        del self._waiting[job_id]
        self._cycle.discard(job_id)
        self._end(job_id, Outcome.CANCELLED)
        self._settle()

    def job_ended(self, job_id: int, outcome: Outcome, now: float) -> None:
        """The running job finished, failed or was cancelled."""
        self._check(Event.JOB_ENDED, now)
        self._check_reported(outcome)
        if self._running_job != job_id:
            running = "no job" if self._running_job is None else f"job {self._running_job}"
            raise ArbiterError(f"job_ended({job_id}): {running} is running")
        self._advance(now)
        self._running_job = None
        self._end(job_id, outcome)
        self._settle()

    def step_done(self, now: float) -> None:
        """The decode step the last ``Step`` asked for has completed."""
        self._check(Event.STEP_DONE, now)
        if not self._step_in_flight:
            raise ArbiterError("step_done() without a Step in flight")
        self._advance(now)
        self._step_in_flight = False
        self._steps += 1
        self._steps_owed = max(0, self._steps_owed - 1)
        self._settle()

    def close(self, now: float) -> tuple[int, ...]:
        """Move to ``CLOSED``; return the ids of every pending item (each ``Outcome.CLOSED``)."""
        self._check(Event.CLOSE, now)
        self._advance(now)
        row = self._first(On.CLOSE, now)
        if row is None:
            return ()
        pending = self._pending()
        self._apply(row, now)
        return pending

    def decide(self, now: float) -> Decision:
        """Return what the actor should do next, with its bookkeeping already applied.

        The actor calls it in a loop: it carries out ``Admit``, ``Resume`` and
        ``Park`` and asks again; after ``Step`` or ``Start`` it reports the end
        with ``step_done`` or ``job_ended``; after ``Wait`` it waits for an event.
        """
        self._check(Event.DECIDE, now)
        self._advance(now)
        row = self._first(On.DECIDE, now)
        assert row is not None, f"no decide row matched in {self._state}"
        decision = self._apply(row, now)
        self._settle()
        assert decision is not None, f"{row} returned no decision"
        return decision

    def statistics(self) -> ArbiterStatistics:
        """A frozen snapshot of the arbiter."""
        return ArbiterStatistics(
            state=self._state,
            running_rows=len(self._running),
            queued_rows=len(self._queued),
            parked_rows=len(self._parked),
            waiting_jobs=len(self._waiting),
            running_job=self._running_job,
            outcomes=MappingProxyType({o.name: n for o, n in self._outcomes.items()}),
            time_in_state=MappingProxyType({s.name: t for s, t in self._time_in_state.items()}),
            drains=self._drains,
            preemptions=self._preemptions,
            steps=self._steps,
            step_in_flight=self._step_in_flight,
            drain_deadline=self._drain_deadline,
            kv_bytes_reserved=self._reserved_bytes(),
            kv_bytes_budget=None if self._policy.memory is None else self._policy.memory.limit,
        )

    def _reserved_bytes(self) -> int:
        memory = self._policy.memory
        if memory is None:
            return 0
        return memory.profile.batch_bytes(self._lengths((*self._running, *self._parked)))

    def _lengths(self, ids: Iterable[int]) -> list[int]:
        return [self._tokens[row_id] for row_id in ids]

    # --- validation: raise before touching anything ---

    def _check(self, event: Event, now: float) -> None:
        if event not in EVENTS[self._state]:
            raise ArbiterError(f"{event.value}() is illegal in state {self._state.name}")
        if now < self._now:
            raise ArbiterError(
                f"{event.value}(now={now!r}): the clock went backwards (last now={self._now!r})"
            )

    def _check_reported(self, outcome: Outcome) -> None:
        if outcome not in _REPORTABLE:
            raise ArbiterError(f"{outcome} is assigned by the arbiter, not reported by the actor")

    def _check_place(self, event: Event, item_id: int, wanted: set[_Place], hint: str) -> _Place:
        place = self._where.get(item_id)
        if place is None:
            raise ArbiterError(f"{event.value}({item_id}): no pending item has this id")
        if place not in wanted:
            names = " or ".join(sorted(p.value for p in wanted))
            raise ArbiterError(
                f"{event.value}({item_id}): it is {place.value}, not {names} ({hint})"
            )
        return place

    def _submit(self, event: Event, item_id: int, now: float, tokens: int) -> Rejection | None:
        self._check(event, now)
        if item_id in self._where:
            raise ArbiterError(f"{event.value}({item_id}): id already {self._where[item_id].value}")
        if type(tokens) is not int or tokens < 0:
            raise ArbiterError(f"{event.value}({item_id}, tokens={tokens!r}): not an int >= 0")
        self._advance(now)
        rejection = self._admission(event, tokens)
        if rejection is not None:
            self._outcomes[Outcome.REJECTED] += 1
            return rejection
        if event is Event.SUBMIT_ROW:
            self._tokens[item_id] = tokens
            self._queued[item_id] = None
            self._where[item_id] = _Place.QUEUED
        else:
            self._waiting[item_id] = None
            self._where[item_id] = _Place.WAITING
        self._settle()
        return None

    def _admission(self, event: Event, tokens: int) -> Rejection | None:
        if self._state is State.CLOSED:
            return Rejection.CLOSED
        memory = self._policy.memory
        if memory is not None and not memory.fits([tokens]):
            return Rejection.TOO_LARGE
        room = self._policy.max_queue
        if event is Event.SUBMIT_ROW and self._state is State.ADMITTING and not self._waiting:
            room += max(0, self._policy.max_batch - len(self._running) - len(self._parked))
        if len(self._queued) + len(self._waiting) >= room:
            return Rejection.QUEUE_FULL
        return None

    # --- bookkeeping ---

    def _advance(self, now: float) -> None:
        self._time_in_state[self._state] += now - self._now
        self._now = now

    def _end(self, item_id: int, outcome: Outcome) -> None:
        del self._where[item_id]
        self._tokens.pop(item_id, None)
        self._outcomes[outcome] += 1

    def _pending(self) -> tuple[int, ...]:
        job = () if self._running_job is None else (self._running_job,)
        return (*self._queued, *self._parked, *self._running, *self._waiting, *job)

    def _room(self) -> int:
        return self._policy.max_batch - len(self._running)

    def _admissible(self) -> tuple[int, ...]:
        """The queued rows to admit now: the longest prefix of the queue (arrival order)
        that fits the batch's free slots and the KV memory budget (rule 2)."""
        queued = tuple(self._queued)[: max(0, self._room())]
        memory = self._policy.memory
        if memory is None:
            return queued
        lengths = self._lengths((*self._running, *self._parked))
        taken = 0
        for row_id in queued:
            lengths.append(self._tokens[row_id])
            if not memory.fits(lengths):
                break
            taken += 1
        return queued[:taken]

    def _first(self, on: On, now: float) -> Transition | None:
        for row in _ROWS.get((self._state, on), ()):
            if self._holds(row.when, now):
                return row
        return None

    def _settle(self) -> None:
        while (row := self._first(On.AFTER_EVENT, self._now)) is not None:
            self._apply(row, self._now)

    def _apply(self, row: Transition, now: float) -> Decision | None:
        decision = self._do(row.does, now)
        self._state = row.to
        return decision

    def _holds(self, when: When, now: float) -> bool:
        match when:
            case When.ALWAYS | When.OTHERWISE:
                return True
            case When.CYCLE_DUE:
                lane_empty = not (self._queued or self._parked or self._running)
                return bool(self._waiting) and (self._steps_owed == 0 or lane_empty)
            case When.NO_JOB_WAITS:
                return not self._waiting
            case When.CYCLE_OVER:
                return self._running_job is None and not self._cycle
            case When.STEP_IN_FLIGHT:
                return self._step_in_flight
            case When.PARKED_AND_ROOM:
                return bool(self._parked) and self._room() > 0
            case When.QUEUED_AND_ROOM:
                return bool(self._admissible())
            case When.ROWS_RUNNING:
                return bool(self._running)
            case When.BEFORE_DEADLINE:
                deadline = self._drain_deadline
                return bool(self._running) and (deadline is None or now < deadline)
            case When.JOB_RUNNING:
                return self._running_job is not None
        assert_never(when)

    def _do(self, does: Does, now: float) -> Decision | None:
        match does:
            case Does.BEGIN_DRAIN:
                timeout = self._policy.drain_timeout
                self._drain_deadline = None if timeout is None else now + timeout
                self._drains += 1
                return None
            case Does.END_DRAIN:
                self._drain_deadline = None
                return None
            case Does.END_CYCLE:
                self._steps_owed = self._policy.min_batch_steps
                return None
            case Does.WAIT:
                return Wait(None)
            case Does.RESUME:
                return Resume(self._move(self._parked, _Place.RUNNING))
            case Does.ADMIT:
                return Admit(self._move(self._queued, _Place.RUNNING, len(self._admissible())))
            case Does.STEP:
                self._step_in_flight = True
                return Step()
            case Does.PARK:
                count = len(self._running)
                self._preemptions += count
                return Park(self._move(self._running, _Place.PARKED, count))
            case Does.START_CYCLE:
                self._drain_deadline = None
                self._cycle = set(self._waiting)
                return self._start_next()
            case Does.START_NEXT:
                return self._start_next()
            case Does.CLOSE:
                for item_id in self._pending():
                    self._end(item_id, Outcome.CLOSED)
                for place in (self._queued, self._parked, self._running, self._waiting):
                    place.clear()
                self._running_job = None
                self._cycle.clear()
                self._tokens.clear()
                self._step_in_flight = False
                self._drain_deadline = None
                return None
        assert_never(does)

    def _move(
        self, source: dict[int, None], to: _Place, limit: int | None = None
    ) -> tuple[int, ...]:
        """Move the first ids of ``source`` to ``to`` (default: as many as fit in the batch)."""
        count = self._room() if limit is None else limit
        ids = tuple(source)[:count]
        target = self._parked if to is _Place.PARKED else self._running
        for item_id in ids:
            del source[item_id]
            target[item_id] = None
            self._where[item_id] = to
        return ids

    def _start_next(self) -> Start:
        job_id = next(iter(self._waiting))
        assert job_id in self._cycle, "jobs run in arrival order, the cycle first"
        del self._waiting[job_id]
        self._cycle.discard(job_id)
        self._running_job = job_id
        self._where[job_id] = _Place.JOB_RUNNING
        return Start(job_id)
