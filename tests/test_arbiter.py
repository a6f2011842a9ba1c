"""Example tests for the arbiter: one per table row, the illegal events, the seed's scenario."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import attrs
import pytest

from trio_mlx._core.arbiter import (
    EVENTS,
    TABLE,
    Admit,
    Arbiter,
    ArbiterError,
    ArbiterPolicy,
    Event,
    Outcome,
    Park,
    Rejection,
    Resume,
    Start,
    State,
    Step,
    Wait,
)
from trio_mlx._core.arbiter_diagram import replace_block

DESIGN_DOC = Path(__file__).parent.parent / "design" / "arbiter.md"


def make(**policy: Any) -> Arbiter:
    return Arbiter(ArbiterPolicy(**policy))


def snapshot(arbiter: Arbiter) -> dict[str, Any]:
    """Every field of the arbiter, deep-copied: "unchanged" means all of them."""
    return copy.deepcopy(attrs.asdict(arbiter, recurse=False))


def running(arbiter: Arbiter, *row_ids: int, now: float = 0.0) -> None:
    """Submit rows and admit them."""
    for row_id in row_ids:
        assert arbiter.submit_row(row_id, now) is None
    assert arbiter.decide(now) == Admit(row_ids)


def in_state(state: State) -> Arbiter:
    """An arbiter in ``state``, with a row queued and one running where the state allows."""
    arbiter = make(max_batch=1)
    running(arbiter, 1)
    if state is State.ADMITTING:
        return arbiter
    arbiter.submit_job(2, 0.0)
    if state is State.DRAINING:
        return arbiter
    arbiter.row_ended(1, Outcome.FINISHED, 0.0)
    assert arbiter.decide(0.0) == Start(2)
    if state is State.EXCLUSIVE:
        return arbiter
    arbiter.close(0.0)
    return arbiter


# --- after-event rows ---------------------------------------------------------------


def test_job_begins_drain_at_once_while_rows_run() -> None:
    arbiter = make(drain_timeout=2.0)
    running(arbiter, 1, 2)
    assert arbiter.submit_job(3, 0.5) is None
    stats = arbiter.statistics()
    assert (stats.state, stats.drain_deadline, stats.drains) == (State.DRAINING, 2.5, 1)


def test_job_waits_in_admitting_until_batch_lane_had_its_steps() -> None:
    arbiter = make(min_batch_steps=2)
    arbiter.submit_job(1, 0.0)
    assert arbiter.decide(0.0) == Start(1)
    arbiter.submit_row(2, 0.5)  # arrives during the cycle
    arbiter.job_ended(1, Outcome.FINISHED, 1.0)
    assert arbiter.decide(1.0) == Admit((2,))
    arbiter.submit_job(3, 1.0)
    assert arbiter.state is State.ADMITTING
    for now in (1.1, 1.2):
        assert arbiter.decide(now) == Step()
        arbiter.step_done(now)
    assert (arbiter.state, arbiter.statistics().drain_deadline) == (State.DRAINING, 2.2)


def test_cancelling_every_waiting_job_resumes_admission_at_once() -> None:
    arbiter = make(max_batch=2)
    running(arbiter, 1)
    arbiter.submit_job(2, 0.0)
    arbiter.submit_row(3, 0.0)
    assert arbiter.decide(0.0) == Step()  # row 3 is not admitted while draining
    arbiter.cancel_job(2, 0.1)
    assert (arbiter.state, arbiter.statistics().drain_deadline) == (State.ADMITTING, None)
    arbiter.step_done(0.2)
    assert arbiter.decide(0.2) == Admit((3,))


def test_cycle_over_reopens_the_batch_lane() -> None:
    arbiter = make()
    arbiter.submit_job(1, 0.0)
    assert arbiter.decide(0.0) == Start(1)
    arbiter.submit_row(2, 0.5)
    arbiter.job_ended(1, Outcome.FAILED, 1.0)
    assert arbiter.state is State.ADMITTING
    assert arbiter.decide(1.0) == Admit((2,))


def test_cancelling_the_last_job_of_a_cycle_between_jobs_ends_the_cycle() -> None:
    arbiter = make()
    arbiter.submit_job(1, 0.0)
    arbiter.submit_job(2, 0.0)
    assert arbiter.decide(0.0) == Start(1)
    arbiter.job_ended(1, Outcome.FINISHED, 1.0)
    assert arbiter.state is State.EXCLUSIVE
    arbiter.cancel_job(2, 1.0)
    assert arbiter.state is State.ADMITTING
    assert arbiter.decide(1.0) == Wait(None)


# --- decide rows: ADMITTING ---------------------------------------------------------


def test_admitting_waits_while_a_step_is_in_flight() -> None:
    arbiter = make()
    running(arbiter, 1)
    assert arbiter.decide(0.0) == Step()
    arbiter.submit_row(2, 0.0)
    assert arbiter.decide(0.0) == Wait(None)
    arbiter.step_done(0.1)
    assert arbiter.decide(0.1) == Admit((2,))


def test_parked_rows_resume_before_queued_rows_are_admitted() -> None:
    arbiter = make(max_batch=2, drain_timeout=0.0)
    running(arbiter, 1, 2)
    arbiter.submit_job(3, 0.0)
    arbiter.submit_row(4, 0.0)
    assert arbiter.decide(0.0) == Park((1, 2))
    assert arbiter.decide(0.0) == Start(3)
    arbiter.job_ended(3, Outcome.FINISHED, 1.0)
    assert arbiter.decide(1.0) == Resume((1, 2))
    assert arbiter.decide(1.0) == Step()  # the batch is full: row 4 stays queued
    assert arbiter.statistics().queued_rows == 1


def test_queued_rows_are_admitted_in_order_up_to_max_batch() -> None:
    arbiter = make(max_batch=3)
    for row_id in (5, 3, 9, 1):
        arbiter.submit_row(row_id, 0.0)
    assert arbiter.decide(0.0) == Admit((5, 3, 9))
    arbiter.row_ended(3, Outcome.CANCELLED, 0.0)
    assert arbiter.decide(0.0) == Admit((1,))


def test_admitting_steps_running_rows() -> None:
    arbiter = make()
    running(arbiter, 1)
    assert arbiter.decide(0.0) == Step()
    arbiter.step_done(0.1)
    assert arbiter.statistics().steps == 1


def test_idle_arbiter_waits_for_an_event() -> None:
    assert make().decide(0.0) == Wait(None)


# --- decide rows: DRAINING ----------------------------------------------------------


def test_draining_waits_while_a_step_is_in_flight() -> None:
    arbiter = make(drain_timeout=0.0)
    running(arbiter, 1)
    assert arbiter.decide(0.0) == Step()
    arbiter.submit_job(2, 0.0)
    assert arbiter.decide(5.0) == Wait(None)  # past the deadline, but a step is running
    arbiter.step_done(5.0)
    assert arbiter.decide(5.0) == Park((1,))


def test_draining_keeps_stepping_until_the_deadline() -> None:
    arbiter = make(drain_timeout=1.0)
    running(arbiter, 1)
    arbiter.submit_job(2, 0.0)
    for now in (0.0, 0.5, 0.99):
        assert arbiter.decide(now) == Step()
        arbiter.step_done(now)
    assert arbiter.decide(1.0) == Park((1,))


def test_draining_parks_every_running_row_once_the_deadline_passes() -> None:
    arbiter = make(drain_timeout=1.0)
    running(arbiter, 1, 2, 3)
    arbiter.submit_job(4, 0.0)
    assert arbiter.decide(1.5) == Park((1, 2, 3))
    stats = arbiter.statistics()
    assert (stats.parked_rows, stats.running_rows, stats.preemptions) == (3, 0, 3)
    assert arbiter.decide(1.5) == Start(4)


def test_draining_starts_the_first_job_when_the_last_row_ends() -> None:
    arbiter = make(drain_timeout=None)
    running(arbiter, 1, 2)
    arbiter.submit_job(3, 0.0)
    arbiter.submit_job(4, 0.0)
    arbiter.row_ended(1, Outcome.FINISHED, 50.0)
    assert arbiter.decide(50.0) == Step()  # no deadline: row 2 still runs
    arbiter.step_done(100.0)
    arbiter.row_ended(2, Outcome.FINISHED, 100.0)
    assert arbiter.decide(100.0) == Start(3)
    assert arbiter.state is State.EXCLUSIVE


# --- decide rows: EXCLUSIVE and CLOSED ----------------------------------------------


def test_exclusive_waits_while_the_job_runs() -> None:
    arbiter = in_state(State.EXCLUSIVE)
    assert arbiter.decide(1.0) == Wait(None)


def test_exclusive_starts_the_next_job_of_the_cycle_and_defers_later_jobs() -> None:
    arbiter = make(min_batch_steps=1)
    running(arbiter, 1)
    arbiter.submit_job(2, 0.0)
    arbiter.submit_job(3, 0.0)  # joins the cycle: the drain has not ended yet
    arbiter.row_ended(1, Outcome.FINISHED, 0.0)
    arbiter.submit_row(4, 0.0)
    assert arbiter.decide(0.0) == Start(2)
    arbiter.submit_job(5, 0.5)  # arrives during the cycle: waits for the next one
    arbiter.job_ended(2, Outcome.FINISHED, 1.0)
    assert arbiter.decide(1.0) == Start(3)
    arbiter.job_ended(3, Outcome.FINISHED, 2.0)
    assert arbiter.state is State.ADMITTING
    assert arbiter.decide(2.0) == Admit((4,))
    assert arbiter.decide(2.0) == Step()
    arbiter.step_done(2.1)
    assert arbiter.state is State.DRAINING


def test_next_cycle_starts_at_once_when_the_batch_lane_is_empty() -> None:
    arbiter = make(min_batch_steps=100)
    arbiter.submit_job(1, 0.0)
    assert arbiter.decide(0.0) == Start(1)
    arbiter.submit_job(2, 0.5)
    arbiter.job_ended(1, Outcome.FINISHED, 1.0)
    assert arbiter.state is State.DRAINING
    assert arbiter.decide(1.0) == Start(2)


def test_closed_arbiter_waits_forever() -> None:
    assert in_state(State.CLOSED).decide(1.0) == Wait(None)


# --- close rows ---------------------------------------------------------------------


def test_close_while_admitting_returns_every_pending_item() -> None:
    arbiter = make(max_batch=1)
    running(arbiter, 1)
    arbiter.submit_row(2, 0.0)
    assert arbiter.close(1.0) == (2, 1)
    stats = arbiter.statistics()
    assert (stats.state, stats.outcomes["CLOSED"], stats.running_rows) == (State.CLOSED, 2, 0)


def test_close_while_draining_returns_queued_parked_running_and_waiting() -> None:
    arbiter = make(max_batch=2, drain_timeout=0.0)
    running(arbiter, 1, 2)
    arbiter.submit_job(3, 0.0)
    assert arbiter.decide(0.0) == Park((1, 2))
    arbiter.submit_row(4, 0.0)
    assert arbiter.close(0.0) == (4, 1, 2, 3)


def test_close_while_exclusive_returns_the_running_job_and_is_then_a_no_op() -> None:
    arbiter = make()
    arbiter.submit_job(1, 0.0)
    arbiter.submit_job(2, 0.0)
    assert arbiter.decide(0.0) == Start(1)
    assert arbiter.close(1.0) == (2, 1)
    assert arbiter.close(2.0) == ()
    assert arbiter.statistics().outcomes["CLOSED"] == 2


# --- submissions ---------------------------------------------------------------------


def test_submission_past_max_queue_is_rejected_at_once() -> None:
    arbiter = make(max_batch=1, max_queue=2)
    running(arbiter, 1)
    assert arbiter.submit_row(2, 0.0) is None
    assert arbiter.submit_job(3, 0.0) is None
    assert arbiter.submit_row(4, 0.0) is Rejection.QUEUE_FULL
    assert arbiter.submit_job(5, 0.0) is Rejection.QUEUE_FULL
    assert arbiter.statistics().outcomes["REJECTED"] == 2


def test_free_batch_slots_count_as_room_when_no_job_waits() -> None:
    arbiter = make(max_batch=2, max_queue=0)
    assert arbiter.submit_row(1, 0.0) is None
    assert arbiter.submit_row(2, 0.0) is None
    assert arbiter.submit_row(3, 0.0) is Rejection.QUEUE_FULL
    assert arbiter.submit_job(4, 0.0) is Rejection.QUEUE_FULL


def test_submission_after_close_is_rejected() -> None:
    arbiter = make()
    arbiter.close(0.0)
    assert arbiter.submit_row(1, 0.0) is Rejection.CLOSED
    assert arbiter.submit_job(2, 0.0) is Rejection.CLOSED
    assert arbiter.statistics().outcomes["REJECTED"] == 2


# --- illegal events -----------------------------------------------------------------

_CALLS = {
    Event.ROW_ENDED: lambda a: a.row_ended(1, Outcome.FINISHED, 1.0),
    Event.CANCEL_ROW: lambda a: a.cancel_row(1, 1.0),
    Event.CANCEL_JOB: lambda a: a.cancel_job(2, 1.0),
    Event.JOB_ENDED: lambda a: a.job_ended(2, Outcome.FINISHED, 1.0),
    Event.STEP_DONE: lambda a: a.step_done(1.0),
}


@pytest.mark.parametrize(
    ("state", "event"),
    [(s, e) for s in State for e in _CALLS if e not in EVENTS[s]],
    ids=str,
)
def test_event_not_in_the_table_raises_and_changes_nothing(state: State, event: Event) -> None:
    arbiter = in_state(state)
    before = snapshot(arbiter)
    with pytest.raises(
        ArbiterError, match=rf"^{event.value}\(\) is illegal in state {state.name}$"
    ):
        _CALLS[event](arbiter)
    assert snapshot(arbiter) == before


def _draining_with_everything() -> Arbiter:
    """Row 1 running, row 3 queued, job 2 waiting; row 4 rejected earlier."""
    arbiter = make(max_batch=1, max_queue=2)
    running(arbiter, 1)
    arbiter.submit_job(2, 0.0)
    arbiter.submit_row(3, 0.0)
    arbiter.submit_row(4, 0.0)
    return arbiter


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda a: a.row_ended(7, Outcome.FINISHED, 1.0), r"row_ended\(7\): no pending item"),
        (
            lambda a: a.row_ended(3, Outcome.FINISHED, 1.0),
            r"row_ended\(3\): it is a queued row, not a running row \(cancel_row withdraws",
        ),
        (
            lambda a: a.row_ended(2, Outcome.FINISHED, 1.0),
            r"row_ended\(2\): it is a waiting job, not a running row",
        ),
        (
            lambda a: a.row_ended(4, Outcome.FINISHED, 1.0),
            r"row_ended\(4\): no pending item has this id",
        ),
        (
            lambda a: a.cancel_row(1, 1.0),
            r"cancel_row\(1\): it is a running row, not a parked row or a queued row \(the actor",
        ),
        (
            lambda a: a.cancel_job(3, 1.0),
            r"cancel_job\(3\): it is a queued row, not a waiting job",
        ),
        (
            lambda a: a.row_ended(1, Outcome.REJECTED, 1.0),
            r"Outcome.REJECTED is assigned by the arbiter, not reported by the actor",
        ),
        (lambda a: a.step_done(1.0), r"step_done\(\) without a Step in flight"),
        (
            lambda a: a.decide(-1.0),
            r"decide\(now=-1.0\): the clock went backwards \(last now=0.0\)",
        ),
        (lambda a: a.submit_row(2, 1.0), r"submit_row\(2\): id already a waiting job"),
        (lambda a: a.submit_job(1, 1.0), r"submit_job\(1\): id already a running row"),
    ],
)
def test_illegal_event_raises_a_precise_error_and_changes_nothing(call: Any, message: str) -> None:
    arbiter = _draining_with_everything()
    before = snapshot(arbiter)
    with pytest.raises(ArbiterError, match=message):
        call(arbiter)
    assert snapshot(arbiter) == before


def test_job_ended_names_the_job_that_runs() -> None:
    arbiter = in_state(State.EXCLUSIVE)
    before = snapshot(arbiter)
    with pytest.raises(ArbiterError, match=r"^job_ended\(9\): job 2 is running$"):
        arbiter.job_ended(9, Outcome.FINISHED, 1.0)
    with pytest.raises(ArbiterError, match=r"^cancel_job\(2\): it is the running job, not"):
        arbiter.cancel_job(2, 1.0)
    arbiter.job_ended(2, Outcome.FINISHED, 1.0)
    arbiter.submit_job(3, 1.0)
    assert arbiter.decide(1.0) == Start(3)
    arbiter.submit_job(4, 1.0)
    arbiter.job_ended(3, Outcome.FINISHED, 1.0)
    before = snapshot(arbiter)
    assert arbiter.state is State.DRAINING
    with pytest.raises(ArbiterError, match=r"^job_ended\(\) is illegal in state DRAINING$"):
        arbiter.job_ended(3, Outcome.FINISHED, 1.0)
    assert snapshot(arbiter) == before


# --- policy and statistics ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"max_batch": 0},
        {"max_queue": -1},
        {"drain_timeout": -0.5},
        {"drain_timeout": "1"},
        {"min_batch_steps": -1},
        {"max_batch": 2.0},
    ],
)
def test_policy_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError)):
        ArbiterPolicy(**bad)


def test_time_in_state_sums_the_callers_clock() -> None:
    arbiter = Arbiter(ArbiterPolicy(drain_timeout=1.0), now=10.0)
    running(arbiter, 1, now=10.0)
    arbiter.submit_job(2, 12.0)
    assert arbiter.decide(13.0) == Park((1,))
    assert arbiter.decide(13.0) == Start(2)
    arbiter.job_ended(2, Outcome.FINISHED, 17.0)
    arbiter.close(20.0)
    arbiter.submit_row(3, 21.0)
    stats = arbiter.statistics()
    assert dict(stats.time_in_state) == {
        "ADMITTING": 5.0,
        "DRAINING": 1.0,
        "EXCLUSIVE": 4.0,
        "CLOSED": 1.0,
    }
    assert dict(stats.outcomes) == {
        "FINISHED": 1,
        "CANCELLED": 0,
        "FAILED": 0,
        "REJECTED": 1,
        "CLOSED": 1,
    }


# --- the seed's scenario --------------------------------------------------------------


def test_sustained_row_traffic_does_not_starve_waiting_serial_jobs() -> None:
    """Rows keep arriving and never finish on their own; each job still starts on time."""
    policy = ArbiterPolicy(max_batch=4, max_queue=64, drain_timeout=1.0, min_batch_steps=8)
    arbiter = Arbiter(policy)
    step_time, job_time = 0.1, 0.3
    arrivals = {1000: 2.0, 1001: 2.5, 1002: 3.5, 1003: 7.0}  # 1001 joins 1000's drain
    submitted: dict[int, float] = {}
    started: dict[int, float] = {}
    cycle_starts: list[int] = []  # arbiter steps done when each cycle began
    now, row_id = 0.0, 0
    while now < 12.0:
        arbiter.submit_row(row_id, now)
        row_id += 1
        for job_id, at in arrivals.items():
            if at <= now and job_id not in submitted:
                assert arbiter.submit_job(job_id, now) is None
                submitted[job_id] = now
        while True:
            state = arbiter.state
            decision = arbiter.decide(now)
            if isinstance(decision, Start):
                started[decision.job_id] = now
                if state is State.DRAINING:
                    cycle_starts.append(arbiter.statistics().steps)
                now = round(now + job_time, 9)
                arbiter.job_ended(decision.job_id, Outcome.FINISHED, now)
            elif isinstance(decision, Step | Wait):
                now = round(now + step_time, 9)
                if isinstance(decision, Step):
                    arbiter.step_done(now)
                break
    assert started.keys() == arrivals.keys()
    # Invariant 5: the batch lane's turn, one drain, the step in flight, one job ahead.
    bound = policy.min_batch_steps * step_time + policy.drain_timeout + step_time + job_time
    for job_id, at in submitted.items():
        assert started[job_id] - at <= bound + 1e-9
    assert len(cycle_starts) == 3
    assert min(b - a for a, b in itertools.pairwise(cycle_starts)) >= policy.min_batch_steps
    stats = arbiter.statistics()
    assert stats.outcomes["FINISHED"] == 4
    assert stats.preemptions > 0
    assert (
        stats.running_rows + stats.queued_rows + stats.parked_rows + stats.outcomes["REJECTED"]
        == row_id
    )


# --- the diagram ----------------------------------------------------------------------


def test_design_doc_diagram_matches_the_table() -> None:
    text = DESIGN_DOC.read_text()
    assert replace_block(text) == text, (
        "design/arbiter.md is out of date: run python -m trio_mlx._core.arbiter design/arbiter.md"
    )
    for row in TABLE:
        assert f"    {row.state.name} --> {row.to.name}: " in text
