"""The step planner's pure decisions: grouped admission, burst length, what a step carries.

No engine and no model: the planner takes the time and the arbiter's state as
arguments (the engine-level behaviour is in test_engine_planner.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_mlx import SamplingParams
from trio_mlx._core.arbiter import State
from trio_mlx._core.planner import StepPlanner
from trio_mlx.testing import RowSpec, StepPlan

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


def _timed(stall: float | None, cap: int | None = 512, **knobs: Any) -> StepPlanner:
    """A planner with 8 rows decoding whose lane took 10 ms a decode-only step and
    0.2 ms more per prompt token (a 100-token step: 30 ms)."""
    planner = StepPlanner(lambda: 16, lambda: cap, prefill_stall=stall, timing_weight=1.0, **knobs)
    planner.stepped(8, 1)
    planner.timed([(0, 0.010)] * 3 + [(100, 0.030)])
    return planner


def test_a_stall_bound_sizes_the_chunk_from_the_measured_step_times() -> None:
    # (3 - 1) x 10 ms / 0.2 ms = 100 tokens, in multiples of 8: 96.
    planner = _timed(3.0)
    assert planner.prefill_chunk() == 96
    assert planner.next_step(0.0, ADMITTING, jobs_waiting=False).prefill_chunk == 96
    assert planner.last_chunk == 96
    assert planner.decode_seconds == pytest.approx(0.010)
    assert planner.token_seconds == pytest.approx(0.0002)
    assert _timed(2.0).prefill_chunk() == 48
    # Slower prompt tokens, a smaller chunk; never below the floor.
    planner.timed([(10, 0.050)])
    assert planner.prefill_chunk() == 32
    assert _timed(3.0, prefill_floor=8).prefill_chunk() == 96


def test_without_a_stall_bound_or_measurements_the_lane_keeps_its_own_chunk() -> None:
    assert _timed(None).prefill_chunk() is None
    assert _timed(None).next_step(0.0, ADMITTING, jobs_waiting=False).prefill_chunk is None
    fresh = StepPlanner(lambda: 16, lambda: 512, prefill_stall=3.0)
    fresh.stepped(8, 1)
    assert fresh.prefill_chunk() is None, "nothing measured yet"
    fresh.timed([(0, 0.010)] * 3)
    assert fresh.prefill_chunk() is None, "no prompt token measured yet"
    fresh.timed([(100, 0.030)])
    assert fresh.prefill_chunk() is not None


def test_the_stall_bound_never_raises_the_lane_budget_nor_holds_back_an_idle_lane() -> None:
    assert _timed(3.0, cap=64).prefill_chunk() is None, "past the lane's own budget"
    assert _timed(3.0, cap=None).prefill_chunk() == 96
    idle = _timed(3.0)
    idle.stepped(0, 1)
    assert idle.prefill_chunk() is None, "nobody decodes: nothing to stall"


def _steps(lag: int, chunks: int) -> list[tuple[int, float]]:
    """A lane's timings: 10 ms decode-only steps, then ``chunks`` steps of 100 prompt
    tokens at 0.2 ms each, every chunk's cost paid ``lag`` steps after it ran."""
    tokens = [0] * 12 + [100] * chunks + [0] * 12
    paid = [0] * lag + tokens[: len(tokens) - lag]
    return [(n, 0.010 + 0.0002 * cost) for n, cost in zip(tokens, paid, strict=True)]


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_prefill_paid_a_step_or_two_late_is_still_measured_right(lag: int) -> None:
    planner = StepPlanner(lambda: 16, lambda: 4096, prefill_stall=3.0)
    planner.stepped(8, 1)
    planner.timed(_steps(lag, chunks=16))
    # A decode step that paid for an earlier prefill does not count as one.
    assert planner.decode_seconds == pytest.approx(0.010)
    assert planner.token_seconds == pytest.approx(0.0002, rel=0.15)
    assert planner.prefill_chunk() in range(88, 112, 8)  # 2 x 10 ms / 0.2 ms = 100


def test_a_prefill_paid_later_than_the_stated_lag_slows_the_decode_estimate() -> None:
    # Paid 3 steps late with timing_lag=2: the decode-only steps after it read slower.
    planner = StepPlanner(lambda: 16, lambda: 4096, prefill_stall=3.0, timing_lag=0)
    planner.stepped(8, 1)
    planner.timed(_steps(2, chunks=16))
    assert planner.decode_seconds is not None
    assert planner.decode_seconds > 0.0105


def test_a_window_faster_than_decoding_counts_its_prompt_tokens_as_free() -> None:
    planner = StepPlanner(lambda: 16, lambda: 4096, prefill_stall=3.0, timing_weight=1.0)
    planner.stepped(8, 1)
    planner.timed([(0, 0.010)] * 3 + [(100, 0.001)])
    assert planner.token_seconds == 0.0
    assert planner.prefill_chunk() is None, "nothing to size a chunk from"


def test_a_stall_bound_at_or_below_one_is_refused() -> None:
    for bad in (1.0, 0.5, 0):
        with pytest.raises(ValueError, match="prefill_stall"):
            StepPlanner(lambda: 16, prefill_stall=bad)


def _work(row_id: int, *lengths: int) -> Any:
    from trio_mlx._core.embedder import EmbedWork

    return EmbedWork(row_id, tuple(tuple(range(n)) for n in lengths))


def test_an_embedding_pass_packs_the_oldest_inputs_within_its_padded_tokens() -> None:
    planner = StepPlanner(lambda: 16, embed_tokens=40)
    planner.embed(first := _work(1, 10, 10, 10))
    planner.embed(_work(2, 30, 5))
    # 3 x 10 fit; a fourth input 30 wide would make 4 x 30 padded tokens.
    assert [(i.id, i.index) for i in planner.embed_batch(ADMITTING, False)] == [
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert not first.unplanned
    # One input wider than the pass still goes, alone.
    planner.embed(_work(3, 50))
    assert [(i.id, i.index) for i in planner.embed_batch(ADMITTING, False)] == [(2, 0)]
    assert [(i.id, i.index) for i in planner.embed_batch(ADMITTING, False)] == [(2, 1)]
    assert [(i.id, i.index) for i in planner.embed_batch(ADMITTING, False)] == [(3, 0)]
    assert planner.embed_batch(ADMITTING, False) == []


def test_embedding_passes_take_at_most_their_share_of_the_time_while_rows_decode() -> None:
    planner = _decoding(8, embed_share=0.2, embed_tokens=1000)
    planner.embed(_work(1, *[4] * 10))
    # The first pass goes at once; it costs 0.1 s.
    assert len(planner.embed_batch(ADMITTING, False)) == 10
    planner.embed(_work(2, 4))
    planner.stepped(8, 1, seconds=0.02, embed_seconds=0.1)
    passes, decode_seconds = 0, 0.02
    for _ in range(100):
        if planner.embed_batch(ADMITTING, False):
            passes += 1
            break
        planner.stepped(8, 1, seconds=0.02)
        decode_seconds += 0.02
    # 0.1 s of pass at a 0.2 share is owed 0.4 s of decoding first.
    assert passes == 1
    assert decode_seconds == pytest.approx(0.4, abs=0.021)  # one step of float rounding


def test_an_idle_lane_a_drain_or_a_waiting_job_carry_a_pass_every_step() -> None:
    for state, jobs_waiting, rows in [
        (ADMITTING, False, 0),
        (State.DRAINING, False, 8),
        (ADMITTING, True, 8),
    ]:
        planner = _decoding(rows, embed_tokens=4)
        planner.embed(_work(1, 4, 4, 4))
        for index in range(3):
            assert [i.index for i in planner.embed_batch(state, jobs_waiting)] == [index]
            planner.stepped(rows, 1, seconds=0.001, embed_seconds=1.0)


def test_passes_while_the_lane_was_idle_leave_at_most_one_pass_owed() -> None:
    planner = StepPlanner(lambda: 16, embed_share=0.5, embed_tokens=4)
    planner.embed(_work(1, *[4] * 50))
    for _ in range(40):  # an idle lane: a pass every step, each 0.1 s
        assert planner.embed_batch(ADMITTING, False)
        planner.stepped(0, 0, seconds=0.0, embed_seconds=0.1)
    planner.stepped(8, 1, seconds=0.05)  # rows decode now: half the last pass repaid
    assert planner.embed_batch(ADMITTING, False) == []
    planner.stepped(8, 1, seconds=0.06)
    assert planner.embed_batch(ADMITTING, False)  # not 4 s of passes
