"""Hypothesis stateful tests of the arbiter: a model of the world against the invariants.

The machine plays a well-behaved actor: it submits, cancels and ends items, asks
``decide`` and carries the decisions out (a rule of its own, or right after an
event, as the real actor does), advances the clock, and fires illegal events. The model tracks where every item should be; the ``@invariant``s check
the spec's invariants (design/arbiter.md) after every rule.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import attrs
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from trio_mlx._core.arbiter import (
    Admit,
    Arbiter,
    ArbiterError,
    ArbiterPolicy,
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
from trio_mlx._memory import KVBudget, KVProfile

pytestmark = pytest.mark.props

# A budget of a few small rows: rows of 1-4 cache steps, a window of two, a constant.
BUDGETS = st.builds(
    KVBudget,
    st.builds(
        KVProfile,
        per_token=st.integers(0, 2),
        windows=st.sampled_from([(), ((512, 1),)]),
        per_row=st.integers(0, 100),
    ),
    st.integers(0, 4096),
)
POLICIES = st.builds(
    ArbiterPolicy,
    max_batch=st.integers(1, 3),
    max_queue=st.integers(0, 5),
    drain_timeout=st.sampled_from([None, 0.0, 0.25, 1.0, 2.0]),
    min_batch_steps=st.integers(0, 3),
    memory=st.none() | BUDGETS,
)
TOKENS = st.integers(0, 1100)
# Multiples of 1/4: the clock sums exactly, so time_in_state can be compared with ==.
DT = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.5])
REPORTED = st.sampled_from([Outcome.FINISHED, Outcome.CANCELLED, Outcome.FAILED])


@attrs.frozen
class Made:
    """One decision, with what the model knew when it was asked for."""

    state: State
    now: float
    decision: Decision
    running: int
    queued: int
    parked: int
    stepping: bool
    job_running: bool
    deadline: float | None  # the model's own drain deadline
    admissible: int  # queued rows that fit the batch and the KV budget


def snapshot(arbiter: Arbiter) -> dict[str, Any]:
    return copy.deepcopy(attrs.asdict(arbiter, recurse=False))


class ArbiterMachine(RuleBasedStateMachine):
    """The world around one arbiter."""

    @initialize(policy=POLICIES, start=st.sampled_from([0.0, 100.0]))
    def setup(self, policy: ArbiterPolicy, start: float) -> None:
        self.policy = policy
        self.arbiter = Arbiter(policy, now=start)
        self.start = self.now = self.sent = start  # world clock; last `now` sent
        self.ids = itertools.count()
        self.queued: list[int] = []
        self.parked: list[int] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.job: int | None = None
        self.stepping = False
        self.outcomes: dict[int, Outcome] = {}
        self.submitted = 0
        self.started: list[int] = []
        self.made: list[Made] = []  # decisions of the latest decide rule
        # Invariant 5: cycles begun, the cycle each job arrived in, the current
        # cycle's jobs, steps since a job last started, the current drain.
        self.cycles = 0
        self.arrived_in: dict[int, int] = {}
        self.cycle: set[int] = set()
        self.steps_since_start = policy.min_batch_steps
        self.drain_deadline: float | None = None
        self.prev_state = State.ADMITTING
        self.cycle_leaks: list[str] = []
        # Invariant 6: rows that fit the batch when the last cycle ended.
        self.fit_at_cycle_end: set[int] = set()
        self.late_rows: list[int] = []
        self.calls = 0  # calls into the arbiter
        self.tokens: dict[int, int] = {}  # each live row's worst-case tokens

    # --- helpers ---

    def send(self) -> float:
        self.calls += 1
        self.sent = self.now
        return self.now

    def end(self, item_id: int, outcome: Outcome) -> None:
        assert item_id not in self.outcomes, f"{item_id} ended twice"
        self.outcomes[item_id] = outcome

    def lane_has_rows(self) -> bool:
        return bool(self.queued or self.parked or self.running)

    def observe(self) -> None:
        """Follow the arbiter's state changes: drains begin, cycles end."""
        state = self.arbiter.state
        if state is State.DRAINING and self.prev_state is not State.DRAINING:
            timeout = self.policy.drain_timeout
            self.drain_deadline = None if timeout is None else self.sent + timeout
        if self.prev_state is State.EXCLUSIVE and state is not State.EXCLUSIVE:
            if self.cycle:
                self.cycle_leaks.append(f"cycle ended with jobs {self.cycle} waiting")
            if state is not State.CLOSED and self.policy.min_batch_steps >= 1:
                if self.lane_has_rows() and state is not State.ADMITTING:
                    self.cycle_leaks.append(f"cycle ended into {state} with rows waiting")
                room = self.policy.max_batch - len(self.parked)
                self.fit_at_cycle_end = set(self.admissible(room, self.parked))
        self.prev_state = state

    def admissible(self, room: int, holding: list[int]) -> list[int]:
        """The queue's longest prefix that fits ``room`` slots and the KV budget beside
        the rows in ``holding`` (the arbiter's rule 2, written again)."""
        prefix = self.queued[: max(0, room)]
        memory = self.policy.memory
        if memory is None:
            return prefix
        lengths = [self.tokens[i] for i in holding]
        for count, row_id in enumerate(prefix):
            lengths.append(self.tokens[row_id])
            if not memory.fits(lengths):
                return prefix[:count]
        return prefix

    def admissible_now(self) -> list[int]:
        return self.admissible(
            self.policy.max_batch - len(self.running), self.running + self.parked
        )

    def expected_rejection(self, row: bool, tokens: int = 0) -> Rejection | None:
        if self.arbiter.state is State.CLOSED:
            return Rejection.CLOSED
        memory = self.policy.memory
        if memory is not None and memory.profile.row_bytes(tokens) > memory.limit:
            return Rejection.TOO_LARGE
        room = self.policy.max_queue + (self.free_slots() if row else 0)
        return Rejection.QUEUE_FULL if len(self.queued) + len(self.waiting) >= room else None

    def free_slots(self) -> int:
        if self.arbiter.state is not State.ADMITTING or self.waiting:
            return 0
        return max(0, self.policy.max_batch - len(self.running) - len(self.parked))

    # --- rules: submissions ---

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=3), then_decide=st.booleans())
    def submit_rows(self, tokens: list[int], then_decide: bool) -> None:
        """A burst of rows arrives."""
        for length in tokens:
            row_id, expected = next(self.ids), self.expected_rejection(True, length)
            self.submitted += 1
            assert self.arbiter.submit_row(row_id, self.send(), length) is expected
            if expected is None:
                self.queued.append(row_id)
                self.tokens[row_id] = length
            else:
                self.end(row_id, Outcome.REJECTED)
            self.observe()
        if then_decide:
            self.decide()

    @rule(tokens=TOKENS, then_decide=st.booleans())
    def submit_job(self, tokens: int, then_decide: bool) -> None:
        job_id, expected = next(self.ids), self.expected_rejection(False, tokens)
        self.submitted += 1
        assert self.arbiter.submit_job(job_id, self.send(), tokens) is expected
        if expected is None:
            self.waiting.append(job_id)
            self.arrived_in[job_id] = self.cycles
        else:
            self.end(job_id, Outcome.REJECTED)
        self.observe()
        if then_decide:
            self.decide()

    # --- rules: the actor's loop ---

    @rule()
    def decide(self) -> None:
        """Ask and carry out until the arbiter says Step, Start or Wait."""
        self.made = []
        for _ in range(8):
            state = self.arbiter.state
            decision = self.arbiter.decide(self.send())
            self.made.append(
                Made(
                    state=state,
                    now=self.now,
                    decision=decision,
                    running=len(self.running),
                    queued=len(self.queued),
                    parked=len(self.parked),
                    stepping=self.stepping,
                    job_running=self.job is not None,
                    deadline=self.drain_deadline,
                    admissible=len(self.admissible_now()),
                )
            )
            event(f"{state.name}: {type(decision).__name__}")
            if self.carry_out(state, decision):
                break
        else:
            raise AssertionError(f"decide never settled: {self.made}")
        self.observe()

    def carry_out(self, state: State, decision: Decision) -> bool:
        """Update the model as the actor would; True when the loop should stop."""
        match decision:
            case Admit(ids):
                assert list(ids) == self.admissible_now(), (ids, self.queued)
                del self.queued[: len(ids)]
                self.running += ids
            case Resume(ids):
                assert list(ids) == self.parked[: len(ids)], (ids, self.parked)
                del self.parked[: len(ids)]
                self.running += ids
            case Park(ids):
                assert list(ids) == self.running, (ids, self.running)
                self.parked += ids
                self.running = []
            case Step():
                self.stepping = True
                return True
            case Start(job_id):
                if state is State.DRAINING:
                    self.begin_cycle()
                assert job_id in self.cycle, f"job {job_id} is not in the cycle {self.cycle}"
                self.waiting.remove(job_id)
                self.cycle.discard(job_id)
                self.job = job_id
                self.started.append(job_id)
                self.steps_since_start = 0
                return True
            case Wait(deadline):
                assert deadline is None
                return True
        return False

    def begin_cycle(self) -> None:
        for job_id in self.waiting:
            if self.arrived_in[job_id] != self.cycles:
                self.cycle_leaks.append(f"job {job_id} skipped a cycle")
        self.late_rows += sorted(self.fit_at_cycle_end & set(self.queued))
        self.fit_at_cycle_end = set()
        self.cycles += 1
        self.cycle = set(self.waiting)
        self.drain_deadline = None

    @precondition(lambda self: self.stepping)
    @rule(dt=DT, then_decide=st.booleans())
    def finish_step(self, dt: float, then_decide: bool) -> None:
        """A step completes (rows that end with it: ``end_running_row``, before or after)."""
        self.now += dt
        self.arbiter.step_done(self.send())
        self.stepping = False
        self.steps_since_start += 1
        self.observe()
        if then_decide:
            self.decide()

    def end_rows(self, row_ids: list[int], data: st.DataObject) -> None:
        for row_id in row_ids:
            outcome = data.draw(REPORTED)
            self.arbiter.row_ended(row_id, outcome, self.send())
            self.running.remove(row_id)
            self.end(row_id, outcome)
            self.observe()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def end_running_row(self, data: st.DataObject) -> None:
        """A running row is cancelled (client gone) or fails, between steps or during one."""
        self.end_rows([data.draw(st.sampled_from(self.running))], data)

    @precondition(lambda self: self.queued or self.parked)
    @rule(data=st.data())
    def cancel_row(self, data: st.DataObject) -> None:
        row_id = data.draw(st.sampled_from(self.queued + self.parked))
        self.arbiter.cancel_row(row_id, self.send())
        (self.queued if row_id in self.queued else self.parked).remove(row_id)
        self.fit_at_cycle_end.discard(row_id)
        self.end(row_id, Outcome.CANCELLED)
        self.observe()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel_job(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(self.waiting))
        self.arbiter.cancel_job(job_id, self.send())
        self.waiting.remove(job_id)
        self.cycle.discard(job_id)
        self.end(job_id, Outcome.CANCELLED)
        self.observe()

    @precondition(lambda self: self.job is not None)
    @rule(dt=DT, outcome=REPORTED, then_decide=st.booleans())
    def finish_job(self, dt: float, outcome: Outcome, then_decide: bool) -> None:
        assert self.job is not None
        self.now += dt
        self.arbiter.job_ended(self.job, outcome, self.send())
        self.end(self.job, outcome)
        self.job = None
        self.observe()
        if then_decide:
            self.decide()

    @rule(rounds=st.integers(1, 6), dt=DT)
    def run_actor(self, rounds: int, dt: float) -> None:
        """The actor runs on its own for a while: steps and jobs take ``dt`` each."""
        for _ in range(rounds):
            self.decide()
            if self.stepping:
                self.finish_step(dt, then_decide=False)
            elif self.job is not None:
                self.finish_job(dt, Outcome.FINISHED, then_decide=False)
            else:
                return

    @rule(dt=DT)
    def tick(self, dt: float) -> None:
        """Time passes with no event (a long step or job, or an idle actor)."""
        self.now += dt

    @precondition(lambda self: self.calls >= 20)  # close late: explore first
    @rule()
    def close(self) -> None:
        pending = [*self.queued, *self.parked, *self.running, *self.waiting]
        pending += [] if self.job is None else [self.job]
        assert self.arbiter.close(self.send()) == tuple(pending)
        for item_id in pending:
            self.end(item_id, Outcome.CLOSED)
        self.queued, self.parked, self.running, self.waiting = [], [], [], []
        self.job, self.stepping, self.cycle = None, False, set()
        self.observe()

    # --- rule: illegal events (invariant 8) ---

    @rule(data=st.data())
    def illegal_event(self, data: st.DataObject) -> None:
        a, now = self.arbiter, self.now
        live = [*self.queued, *self.parked, *self.running, *self.waiting]
        live += [] if self.job is None else [self.job]
        gone = [*self.outcomes, 10**9]  # ended, and never submitted
        not_running = [i for i in [*live, *gone] if i not in self.running]
        not_withdrawable_row = [i for i in [*live, *gone] if i not in self.queued + self.parked]
        not_waiting_job = [i for i in [*live, *gone] if i not in self.waiting]
        ids = st.sampled_from
        calls = [
            lambda: a.row_ended(data.draw(ids(not_running)), data.draw(REPORTED), now),
            lambda: a.cancel_row(data.draw(ids(not_withdrawable_row)), now),
            lambda: a.cancel_job(data.draw(ids(not_waiting_job)), now),
            lambda: a.job_ended(
                data.draw(ids([i for i in [*live, *gone] if i != self.job])), Outcome.FINISHED, now
            ),
        ]
        if not self.stepping:
            calls.append(lambda: a.step_done(now))
        if self.running:
            bad = st.sampled_from([Outcome.REJECTED, Outcome.CLOSED])
            calls.append(lambda: a.row_ended(self.running[0], data.draw(bad), now))
        calls.append(lambda: a.submit_row(10**9 + 1, now, data.draw(st.sampled_from([-1, 1.5]))))
        if live:
            calls.append(lambda: a.submit_row(data.draw(ids(live)), now))
            calls.append(lambda: a.submit_job(data.draw(ids(live)), now))
        calls.append(lambda: a.decide(self.sent - 0.25))  # the clock goes backwards
        call = data.draw(st.sampled_from(calls))
        before, stats = snapshot(a), a.statistics()
        with pytest.raises(ArbiterError):
            call()
        assert snapshot(a) == before
        assert a.statistics() == stats

    # --- invariants ---

    @invariant()
    def mutual_exclusion(self) -> None:
        """1. An exclusive job never runs while a row runs or a step is in flight."""
        stats = self.arbiter.statistics()
        if stats.running_job is not None:
            assert stats.running_rows == 0
            assert not stats.step_in_flight
        assert all(not (m.decision == Step() and m.job_running) for m in self.made)

    @invariant()
    def no_admission_outside_admitting(self) -> None:
        """2. No row is admitted or resumed in DRAINING or EXCLUSIVE."""
        for m in self.made:
            if isinstance(m.decision, Admit | Resume):
                assert m.state is State.ADMITTING, m

    @invariant()
    def bounds(self) -> None:
        """3. Running rows <= max_batch; waiting items <= max_queue (+ free slots)."""
        stats = self.arbiter.statistics()
        assert stats.running_rows <= self.policy.max_batch
        waiting = stats.queued_rows + stats.waiting_jobs
        assert waiting <= self.policy.max_queue + self.free_slots()

    @invariant()
    def jobs_start_in_submission_order(self) -> None:
        """4. Ids come from one counter, so started jobs' ids must increase."""
        assert self.started == sorted(self.started)

    @invariant()
    def bounded_job_wait(self) -> None:
        """5. Each job runs in the first cycle after its arrival; drains are bounded."""
        assert self.cycle_leaks == []
        for job_id in self.waiting:
            assert job_id in self.cycle or self.arrived_in[job_id] == self.cycles
        state = self.arbiter.state
        if state is State.ADMITTING and self.waiting:
            # The drain begins as soon as the batch lane had its turn, or has no rows.
            assert self.lane_has_rows()
            assert self.steps_since_start < self.policy.min_batch_steps
        if state is State.DRAINING:
            assert self.arbiter.statistics().drain_deadline == self.drain_deadline
        for m in self.made:
            if m.state is not State.DRAINING or m.stepping:
                continue
            past = m.deadline is not None and m.now >= m.deadline
            if m.running == 0:
                assert isinstance(m.decision, Start), m
            elif past:
                assert isinstance(m.decision, Park), m
            else:
                assert m.decision == Step(), m

    @invariant()
    def bounded_row_wait(self) -> None:
        """6. No step while a queued or parked row fits; rows that fit at a cycle's end
        are admitted before the next cycle."""
        assert self.late_rows == []
        for m in self.made:
            admitting = m.state is State.ADMITTING and not m.stepping
            if admitting and isinstance(m.decision, Step | Wait):
                assert m.admissible == 0, m
                assert m.parked == 0 or m.running == self.policy.max_batch, m
            if isinstance(m.decision, Wait) and m.state is not State.CLOSED:
                # Nothing runnable: a step or job is in flight, or the lane is empty
                # (a queued row always fits an empty batch: no memory deadlock).
                assert m.stepping or m.job_running or (m.running + m.queued + m.parked == 0)

    @invariant()
    def kv_budget_holds(self) -> None:
        """The running and parked rows' worst-case KV bytes never pass the budget, and
        the arbiter reports what the model computes."""
        stats, memory = self.arbiter.statistics(), self.policy.memory
        if memory is None:
            assert (stats.kv_bytes_reserved, stats.kv_bytes_budget) == (0, None)
            return
        lengths = [self.tokens[i] for i in self.running + self.parked]
        assert stats.kv_bytes_reserved == memory.profile.batch_bytes(lengths)
        assert stats.kv_bytes_reserved <= memory.limit == stats.kv_bytes_budget

    @invariant()
    def every_item_ends_exactly_once(self) -> None:
        """7. Model and arbiter agree on where every item is and how each ended."""
        stats = self.arbiter.statistics()
        assert (stats.queued_rows, stats.parked_rows, stats.running_rows) == (
            len(self.queued),
            len(self.parked),
            len(self.running),
        )
        assert (stats.waiting_jobs, stats.running_job) == (len(self.waiting), self.job)
        live = len(self.queued) + len(self.parked) + len(self.running) + len(self.waiting)
        assert live + (self.job is not None) + len(self.outcomes) == self.submitted
        counts = {o.name: 0 for o in Outcome}
        for outcome in self.outcomes.values():
            counts[outcome.name] += 1
        assert dict(stats.outcomes) == counts
        assert stats.step_in_flight == self.stepping
        assert sum(stats.time_in_state.values()) == self.sent - self.start
        if stats.state is State.CLOSED:
            assert live == 0


TestArbiterMachine = ArbiterMachine.TestCase
