"""The step planner: what the batch lane's next step carries (the actor owns one).

Theory of operation
===================

The arbiter decides *that* a step runs (``Step``) and which rows join the
batch (``Admit``, ``Resume``); the :class:`StepPlanner` decides what each
step call carries, as one :class:`~trio_mlx._lanes.batch.StepPlan`: which of the
admitted rows are inserted now, the parked rows resumed and the cancelled
rows removed, and how many decode steps the call may run (a *burst*). It is
the one place that builds a step; the actor feeds it the rows and sends its
plans to the worker.

Two decisions live here:

- *Grouped admission* (:meth:`StepPlanner.admit_now`). Prefill is a
  synchronous pass on the MLX thread: admitting arrivals one or two at a time
  while 64 rows decode cost the bare loop 76% of its throughput on the H200,
  grouping 16 cost 22% (shared/measured). So while rows decode, admitted rows
  wait until there are ``admit_group`` of them (no more than mlx-lm prefills
  in one pass, nor ``1/admit_fraction`` of the decoding rows), or the first
  has waited ``admit_wait_steps`` decode steps or ``admit_wait_seconds``
  (plus the burst in flight, <= 20 ms): the most grouping adds to a row's
  time to first token. An idle lane, a resume, and a drain (a job waits for
  these rows) admit at once.
- *The prefill chunk* (:meth:`StepPlanner.prefill_chunk`), with
  ``prefill_stall`` set (off by default). A decode step that also prefills
  stalls every running stream for as long as the prefill takes; the lane's
  fixed token budget bounds that in tokens, which a device turns into very
  different times (a 512-token chunk is a few decode steps on the H200 and
  ten on a 2-core CPU). So the planner sizes each step's chunk from what the
  lane measured: the seconds of a decode-only step ``d`` and the seconds a
  prompt token adds ``c`` (both moving averages of the lane's per-step
  timings; on a GPU a queued prefill is paid by a later step, so a step
  counts as decode-only after ``timing_lag`` quiet steps, and ``c`` is read
  over the last ``timing_window`` steps), so that a step that prefills one
  prompt's chunk takes about ``prefill_stall`` x ``d``: ``(prefill_stall -
  1) x d / c`` tokens, in multiples of 8, no fewer than ``prefill_floor`` (a
  long prompt always moves on), no more than the lane's budget. Only the chunk shrinks: arrivals
  still share a pass within the budget (bounding the whole pass instead split
  them into passes of one row, at 0.53-0.71x the bare loop's tok/s against
  0.79-0.92x on the CPU). An idle lane (nobody to stall) prefills at the
  lane's full budget. Measured on the CPU: the
  streams' gap p99 while a long prompt arrives falls by half or more (X = 3:
  2.4-2.7x their ITL p50 in one run, 3.4-8.7x in another, against 8.3-9.8x),
  for 10-20% of the closed-loop tok/s.
- *Embeddings* (:meth:`StepPlanner.embed_batch`). An embedding request's
  inputs ride on steps as one padded prefill-only pass of at most
  ``embed_tokens`` (rows x longest; one longer input goes alone) before the
  decode step. While rows decode, passes take at most ``embed_share`` of the
  MLX thread's time: a credit in seconds, which each step call adds its
  seconds x ``share / (1 - share)`` to while embeddings wait and each pass
  takes its own seconds from, is spent when a pass goes (a pass is carried
  while it is not negative; it banks nothing while no embedding waits, so
  the first pass goes at once, and owes at most the last pass, so the
  passes of an idle lane leave no debt). Counting steps instead let a 512-token pass
  per nine decode steps of a tiny model take most of the time (chat at
  0.38x). An idle lane, a drain or a waiting job carry a pass every step.
- *Burst length* (:meth:`StepPlanner.next_step`). In plain decoding (the
  arbiter ADMITTING, no job waiting) a step call may run up to
  ``burst_steps`` decode steps within ``burst_seconds``; the lane stops it
  early on news (see :meth:`~trio_mlx._lanes.batch.BatchLane.step`), and
  :meth:`StepPlanner.ends_burst` says which submissions are news.

Pure: the actor passes in the time, the arbiter's state and the lane's
timings; nothing here reads a clock, touches MLX or knows about requests, so
the decisions are unit-tested without an engine. In distributed mode the
chunk travels in the plan, so every rank prefills the same tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import attrs

from trio_mlx._core.arbiter import State
from trio_mlx._core.embedder import EmbedWork
from trio_mlx._lanes.records import EmbedInput, RowSpec, StepPlan

__all__ = ["StepPlanner"]


@attrs.define(eq=False)
class StepPlanner:
    """Collects the rows that join or leave the batch; builds each step's :class:`StepPlan`."""

    #: The most prompts one prefill pass takes (the lane's ``prefill_batch_size``, read live).
    group_cap: Callable[[], int]
    #: The lane's own prefill budget in tokens (``BatchLane.prefill_budget``, read live):
    #: the most a step's chunk may be.
    budget_cap: Callable[[], int | None] = lambda: None
    #: Most decode steps in one step call's burst, and its time budget in seconds.
    burst_steps: int = 16
    burst_seconds: float = 0.02
    #: Grouped admission: the most rows held for one group ...
    admit_group: int = 16
    #: ... at most 1/admit_fraction of the decoding rows ...
    admit_fraction: int = 8
    #: ... held no longer than this many decode steps or seconds after the first arrived.
    admit_wait_steps: int = 32
    admit_wait_seconds: float = 0.25
    #: The most a decode step that prefills a prompt's chunk may take, as a multiple of
    #: one that does not (> 1); None: chunks of the lane's fixed budget.
    prefill_stall: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(1.0))
    )
    #: The smallest chunk ``prefill_stall`` may set, in tokens.
    prefill_floor: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    #: The moving averages' weight of a new timing.
    timing_weight: float = 0.2
    #: Steps after one that prefilled that may still pay for it: on a GPU the prefill
    #: is queued, and the step that waits for it comes later. A step counts as
    #: decode-only when it and these before it prefilled nothing ...
    timing_lag: int = 2
    #: ... and a prompt token's cost is measured over this many recent steps, so
    #: that a prefill paid a step or two late still falls inside the window.
    timing_window: int = 8
    #: The share of the time embedding passes may take while rows decode (0, 1] ...
    embed_share: float = attrs.field(
        default=0.1, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)]
    )
    #: ... and the padded tokens (rows x longest input) of one pass.
    #: None: a quarter of the lane's prefill budget (on the CPU, 512-token passes held
    #: four closed-loop streams to 0.63x, 128-token ones to 0.98x).
    embed_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    #: Embedding requests with inputs no step carried yet, in arrival order.
    _embeds: list[EmbedWork] = attrs.field(init=False, factory=list)
    #: Seconds of passes the embeddings may still take (see the module's notes).
    _embed_credit: float = attrs.field(init=False, default=0.0)
    #: Seconds of a decode step that prefills nothing, and seconds a prompt token adds
    #: to a step (moving averages of the lane's timings; None until measured).
    _decode_s: float | None = attrs.field(init=False, default=None)
    _token_s: float | None = attrs.field(init=False, default=None)
    #: The last ``timing_window`` steps' (prompt tokens, seconds).
    _recent: deque[tuple[int, float]] = attrs.field(init=False, factory=deque)
    #: Steps since the last one that prefilled.
    _quiet: int = attrs.field(init=False, default=0)
    _last_chunk: int | None = attrs.field(init=False, default=None)
    _inserts: list[RowSpec] = attrs.field(init=False, factory=list)
    _resumes: list[int] = attrs.field(init=False, factory=list)
    _removes: list[int] = attrs.field(init=False, factory=list)
    #: Rows decoding in the lane after the last step (0: unknown, or idle).
    _lane_live: int = attrs.field(init=False, default=0)
    #: When the oldest held insert was queued, and decode steps run since.
    _held_since: float | None = attrs.field(init=False, default=None)
    _held_steps: int = attrs.field(init=False, default=0)
    #: Step calls that inserted new rows (admitted rows / this = the mean group).
    _admissions: int = attrs.field(init=False, default=0)

    @property
    def admissions(self) -> int:
        """Step calls that inserted new rows so far."""
        return self._admissions

    @property
    def last_chunk(self) -> int | None:
        """The chunk the last planned step carried (None: the lane's budget)."""
        return self._last_chunk

    @property
    def decode_seconds(self) -> float | None:
        """The moving average of a decode-only step's seconds (None until measured)."""
        return self._decode_s

    @property
    def token_seconds(self) -> float | None:
        """The moving average of the seconds a prompt token adds to a step (None until measured)."""
        return self._token_s

    # --- rows in and out ---

    def insert(self, spec: RowSpec, now: float) -> None:
        """An admitted row joins a coming step (maybe held for its group)."""
        if not self._inserts:
            self._held_since, self._held_steps = now, 0
        self._inserts.append(spec)

    def resume(self, row_id: int) -> None:
        """A parked row goes back into the batch with the next step."""
        self._resumes.append(row_id)

    def remove(self, *row_ids: int) -> None:
        """Rows in the lane (decoding or parked) leave it with the next step or discard."""
        self._removes.extend(row_ids)

    def _drop_insert(self, row_id: int) -> bool:
        """Take a row out of the queued inserts; False when it is not there."""
        self._inserts, dropped = _without(self._inserts, row_id)
        return dropped

    def _drop_resume(self, row_id: int) -> bool:
        """Take a row out of the queued resumes; False when it is not there."""
        if row_id in self._resumes:
            self._resumes.remove(row_id)
            return True
        return False

    def unqueue(self, row_id: int) -> bool:
        """Take back a row queued to be inserted or resumed; False: it is in the lane."""
        return self._drop_insert(row_id) or self._drop_resume(row_id)

    def withdraw(self, row_id: int) -> None:
        """A running row ended early (cancelled): drop it if queued, else take it out."""
        if not self._drop_insert(row_id):
            self._drop_resume(row_id)  # a parked row still holds its slot: removed too
            self._removes.append(row_id)

    def embed(self, work: EmbedWork) -> None:
        """An admitted (or resumed) embedding request's inputs join coming steps."""
        if work.unplanned and work not in self._embeds:
            self._embeds.append(work)

    def drop_embed(self, row_id: int) -> bool:
        """Take an embedding request out (parked, cancelled); False when it was not queued."""
        self._embeds, dropped = _without(self._embeds, row_id)
        return dropped

    def embed_due(self, state: State, jobs_waiting: bool) -> bool:
        """Whether an embedding request arriving now could have a pass at the next step
        (else its submission need not end the burst in flight)."""
        busy = state is State.ADMITTING and not jobs_waiting and self._lane_live > 0
        return not busy or self._embed_credit >= 0.0 or self.embed_share >= 1.0

    def embed_batch(
        self, state: State, jobs_waiting: bool, *, joining: bool = False
    ) -> list[EmbedInput]:
        """The embedding inputs the next step carries (none while the share is spent);
        ``joining``: the step inserts or resumes rows."""
        if not self._embeds:
            return []
        idle = not (self._lane_live or self._inserts or self._resumes or joining)
        busy = state is State.ADMITTING and not jobs_waiting and not idle
        if busy and self._embed_credit < 0.0 and self.embed_share < 1.0:
            return []
        batch: list[EmbedInput] = []
        width, room = 0, self.embed_tokens or max(1, (self.budget_cap() or 2048) // 4)
        for work in self._embeds:
            while work.unplanned:
                tokens = work.inputs[work.planned]
                wider = max(width, len(tokens))
                if batch and (len(batch) + 1) * wider > room:
                    break
                batch.append(EmbedInput(work.id, work.planned, tokens))
                width = wider
                work.planned += 1
            if work.unplanned:
                break
        self._embeds = [work for work in self._embeds if work.unplanned]
        return batch

    def take_removes(self) -> list[int]:
        """The rows to remove, for a discard outside a step."""
        removes, self._removes = self._removes, []
        return removes

    # --- what the lane did ---

    def stepped(
        self, decoding: int, steps: int, *, seconds: float = 0.0, embed_seconds: float = 0.0
    ) -> None:
        """A step call ran ``steps`` decode steps in ``seconds`` (and an embedding pass in
        ``embed_seconds``); ``decoding`` rows are live in the lane."""
        self._lane_live = decoding
        self._held_steps += steps
        share = self.embed_share
        if share < 1.0:
            credit = self._embed_credit + seconds * share / (1.0 - share) - embed_seconds
            if embed_seconds:  # the rows owe at most the last pass (not an idle lane's many)
                credit = max(credit, -embed_seconds)
            self._embed_credit = credit if self._embeds else min(credit, 0.0)

    def timed(self, timings: Iterable[tuple[int, float]]) -> None:
        """The lane's (prompt tokens, seconds) for each decode step it ran (``StepResult.timings``)."""
        if self.prefill_stall is None:
            return  # nothing reads them: no bookkeeping per step
        weight, recent = self.timing_weight, self._recent
        for tokens, seconds in timings:
            recent.append((tokens, seconds))
            while len(recent) > self.timing_window:
                recent.popleft()
            self._quiet = 0 if tokens else self._quiet + 1
            if self._quiet > self.timing_lag:
                d = self._decode_s
                self._decode_s = seconds if d is None else d + weight * (seconds - d)
            if tokens and self._decode_s is not None:
                # What the window's steps took beyond decoding, per token they prefilled
                # (only on steps that prefill: the steps after a prompt's last chunk
                # would count costs of chunks that have left the window).
                window = sum(n for n, _ in recent)
                spent = sum(s for _, s in recent) - len(recent) * self._decode_s
                per_token = max(0.0, spent) / window
                c = self._token_s
                self._token_s = per_token if c is None else c + weight * (per_token - c)

    def lane_unknown(self) -> None:
        """The lane changed outside a step (a park, a discard, a failure): admit at once until the
        next step says how many rows decode."""
        self._lane_live = 0

    # --- decisions ---

    def group_target(self) -> int:
        """Rows that make an admission group now (see :meth:`admit_now`)."""
        group = min(self.admit_group, self.group_cap())
        return min(group, max(1, self._lane_live // self.admit_fraction))

    def admit_now(self, now: float, state: State, jobs_waiting: bool) -> bool:
        """Whether the queued inserts go into the next step, or wait to be prefilled as a group."""
        pending = len(self._inserts)
        if not pending or self._resumes or not self._lane_live:
            return True
        if state is not State.ADMITTING or jobs_waiting:
            return True  # a drain waits for these rows: never hold them then
        if pending >= self.group_target():
            return True
        if self._held_steps >= self.admit_wait_steps:
            return True
        since = self._held_since
        return since is None or now - since >= self.admit_wait_seconds

    def ends_burst(self, now: float, state: State, jobs_waiting: bool, arriving: int) -> bool:
        """Whether a batch row's submission ends the burst in flight (the inbox is read between).

        A row that grouped admission would hold anyway waits for the burst to
        end on its own (``burst_steps`` / ``burst_seconds``, or the next finish
        or first token): ending it early would only cost a trip through the
        Trio thread per arrival. The arrival that completes a group (with the
        ``arriving`` rows still in the inbox), and any arrival once the oldest
        held one is due, end it. (A job's submission always ends it.)
        """
        if not self._lane_live or self.admit_group <= 1:
            return True
        if state is not State.ADMITTING or jobs_waiting:
            return True
        if len(self._inserts) + arriving >= self.group_target():
            return True
        since = self._held_since
        return since is not None and now - since >= self.admit_wait_seconds

    def prefill_chunk(self) -> int | None:
        """The next step's prefill chunk in tokens; None: the lane's budget (see the module's notes)."""
        stall, cap = self.prefill_stall, self.budget_cap()
        d, c = self._decode_s, self._token_s
        if stall is None or not self._lane_live or d is None or not c:
            return None
        tokens = int((stall - 1.0) * d / c) // 8 * 8
        chunk = max(self.prefill_floor, tokens)
        if cap is not None and chunk >= cap:
            return None
        return chunk

    def discard_due(self, state: State) -> bool:
        """Whether cancelled rows should leave the lane now, though no step is coming.

        While the arbiter admits and no step runs (the actor would wait), the
        rows cancelled since the last step would hold their KV slots until the
        next arrival: they are discarded at once instead. In any other state a
        step, a park or a drain takes them soon.
        """
        return bool(self._removes) and state is State.ADMITTING

    def next_step(self, now: float, state: State, jobs_waiting: bool) -> StepPlan:
        """The next step call: the rows it removes, inserts and resumes, and its burst length."""
        inserts: list[RowSpec] = []
        if self.admit_now(now, state, jobs_waiting):
            inserts, self._inserts, self._held_since = self._inserts, [], None
            self._admissions += bool(inserts)
        resumes, removes = self._resumes, self._removes
        self._resumes, self._removes = [], []
        steps = 1
        if self.burst_steps > 1 and state is State.ADMITTING and not jobs_waiting:
            steps = self.burst_steps
        self._last_chunk = self.prefill_chunk()
        embeds = self.embed_batch(state, jobs_waiting, joining=bool(inserts or resumes))
        return StepPlan(inserts, resumes, removes, steps, self._last_chunk, embeds)


class _HasId(Protocol):
    @property
    def id(self) -> int: ...


_Item = TypeVar("_Item", bound=_HasId)


def _without(items: list[_Item], row_id: int) -> tuple[list[_Item], bool]:
    """``items`` less those of ``row_id``, and whether there were any."""
    kept = [item for item in items if item.id != row_id]
    return kept, len(kept) < len(items)
