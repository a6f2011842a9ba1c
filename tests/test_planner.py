"""The step planner's pure decisions: grouped admission, burst length, what a step carries.

No engine and no model: the planner takes the time and the arbiter's state as
arguments (the engine-level behaviour is in test_engine_planner.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_mlx import SamplingParams
from trio_mlx._arbiter import State
from trio_mlx._batch import RowSpec, StepPlan
from trio_mlx._planner import StepPlanner

ADMITTING = State.ADMITTING


def _spec(row_id: int) -> RowSpec:
    return RowSpec(row_id, (1, 2, 3), SamplingParams(max_tokens=4))


def _decoding(rows: int, **knobs: Any) -> StepPlanner:
    """A planner whose lane has ``rows`` rows decoding."""
    planner = StepPlanner(lambda: 16, **knobs)
    planner.stepped(rows, 1)
    return planner


def test_the_group_is_capped_by_the_knob_the_prefill_pass_and_a_fraction_of_the_batch() -> None:
    assert _decoding(64).group_target() == 8  # 64 // admit_fraction 8
    assert _decoding(256).group_target() == 16  # admit_group
    assert _decoding(256, admit_group=32).group_target() == 16  # one prefill pass
    assert _decoding(3).group_target() == 1  # never below one row


def test_arrivals_are_held_while_rows_decode_until_their_group_is_complete() -> None:
    planner = _decoding(64)
    for row_id in range(1, 8):
        planner.insert(_spec(row_id), now=0.0)
        assert not planner.admit_now(0.0, ADMITTING, jobs_waiting=False)
        assert planner.next_step(0.0, ADMITTING, jobs_waiting=False).inserts == ()
    planner.insert(_spec(8), now=0.0)
    plan = planner.next_step(0.0, ADMITTING, jobs_waiting=False)
    assert [spec.id for spec in plan.inserts] == list(range(1, 9))
    assert planner.admissions == 1


def test_a_held_group_goes_after_its_wait_in_steps_or_seconds() -> None:
    by_steps = _decoding(64, admit_wait_steps=3)
    by_steps.insert(_spec(1), now=0.0)
    by_steps.stepped(64, 2)
    assert not by_steps.admit_now(0.0, ADMITTING, jobs_waiting=False)
    by_steps.stepped(64, 1)
    assert by_steps.admit_now(0.0, ADMITTING, jobs_waiting=False)

    by_time = _decoding(64, admit_wait_seconds=0.25)
    by_time.insert(_spec(1), now=10.0)
    assert not by_time.admit_now(10.2, ADMITTING, jobs_waiting=False)
    assert by_time.admit_now(10.25, ADMITTING, jobs_waiting=False)


@pytest.mark.parametrize(
    ("rows", "state", "jobs_waiting", "resume"),
    [
        (0, ADMITTING, False, False),  # an idle (or unknown) lane
        (64, State.DRAINING, False, False),  # a drain waits for these rows
        (64, ADMITTING, True, False),  # a job waits
        (64, ADMITTING, False, True),  # a resume rebuilds the batch anyway
    ],
)
def test_an_arrival_is_admitted_at_once_when_holding_it_gains_nothing(
    rows: int, state: State, jobs_waiting: bool, resume: bool
) -> None:
    planner = _decoding(rows)
    planner.insert(_spec(1), now=0.0)
    if resume:
        planner.resume(7)
    assert planner.admit_now(0.0, state, jobs_waiting)


def test_only_the_arrival_that_completes_a_group_ends_the_burst() -> None:
    planner = _decoding(16)  # a group of two
    assert not planner.ends_burst(0.0, ADMITTING, jobs_waiting=False, arriving=1)
    assert planner.ends_burst(0.0, ADMITTING, jobs_waiting=False, arriving=2)
    planner.insert(_spec(1), now=0.0)
    assert planner.ends_burst(0.0, ADMITTING, jobs_waiting=False, arriving=1)
    assert planner.ends_burst(0.0, ADMITTING, jobs_waiting=True, arriving=0)
    assert _decoding(0).ends_burst(0.0, ADMITTING, jobs_waiting=False, arriving=1)


def test_a_step_bursts_only_in_plain_decoding_and_carries_every_resume_and_remove() -> None:
    planner = _decoding(4)
    planner.resume(2)
    planner.remove(3, 4)
    assert planner.next_step(0.0, ADMITTING, jobs_waiting=False) == StepPlan(
        (), (2,), (3, 4), steps=16
    )
    assert planner.next_step(0.0, ADMITTING, jobs_waiting=True) == StepPlan(steps=1)
    assert planner.next_step(0.0, State.DRAINING, jobs_waiting=False) == StepPlan(steps=1)


def test_a_row_taken_back_before_its_step_never_reaches_the_lane() -> None:
    planner = _decoding(0)
    planner.insert(_spec(1), now=0.0)
    planner.insert(_spec(2), now=0.0)
    planner.resume(3)
    assert planner.unqueue(1)
    assert planner.unqueue(3)
    assert not planner.unqueue(4)  # in the lane: the caller parks it
    planner.withdraw(2)  # cancelled while queued: nothing to remove
    planner.withdraw(5)  # cancelled in the lane: removed with the next step
    assert planner.next_step(0.0, ADMITTING, jobs_waiting=False) == StepPlan(removes=(5,), steps=16)


def test_a_step_plan_refuses_an_empty_burst() -> None:
    with pytest.raises(ValueError, match="'steps' must be >= 1: 0"):
        StepPlan(steps=0)


def test_cancelled_rows_are_discarded_between_steps_only_while_admitting() -> None:
    """With nothing to step, cancelled rows leave at once while admitting, not in a drain."""
    planner = _decoding(8)
    assert not planner.discard_due(ADMITTING)
    planner.remove(3, 4)
    assert planner.discard_due(ADMITTING)
    assert not planner.discard_due(State.DRAINING)
    assert planner.take_removes() == [3, 4]
    assert not planner.discard_due(ADMITTING)
