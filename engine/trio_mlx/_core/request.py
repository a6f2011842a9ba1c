r"""What the actor keeps per request, and the engine's statistics snapshot.

A :class:`Request` is one submitted item (a batch row, a serial generation or an
exclusive job) with its :class:`Phase` as the actor sees it and its
:class:`Outbox`, the per-request buffer the actor ``put``\ s events into on the
Trio thread (never blocking) and the consumer ``take``\ s from.
:class:`EngineStatistics` is the frozen snapshot ``Engine.statistics()``
returns. Plain records: the actor (``_actor.py``) changes them, the engine's
public API (``_engine.py``) reads them.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import outcome
import trio

from trio_mlx._core.arbiter import ArbiterStatistics
from trio_mlx._core.embedder import EmbedWork
from trio_mlx._core.gate import LaneName
from trio_mlx._errors import GenerationFailed, TrioMLXError
from trio_mlx._lanes.output import RowEvent
from trio_mlx._lanes.prompt_cache import PromptCacheStatistics
from trio_mlx._lanes.records import RowSpec

__all__ = ["Ending", "EngineStatistics", "Outbox", "Phase", "Request", "failure"]


class Ending(enum.StrEnum):
    """How a request ended; the value is the second part of a ``"lane:ending"`` key."""

    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"
    REJECTED = "rejected"
    CLOSED = "closed"


class Phase(enum.Enum):
    """Where a request is, as the actor sees it."""

    INBOX = "inbox"
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


@attrs.define(eq=False)
class Outbox:
    """A request's buffer of events; ``put`` never blocks.

    ``unread`` counts what waits for the reader: a token, plus one per top
    log-probability alternative it carries. The actor cancels a request whose
    ``unread`` passes its limit (max_tokens bounds it otherwise).
    """

    _items: list[RowEvent] = attrs.field(init=False, factory=list)
    _lot: trio.lowlevel.ParkingLot = attrs.field(init=False, factory=trio.lowlevel.ParkingLot)
    closed: bool = attrs.field(init=False, default=False)
    unread: int = attrs.field(init=False, default=0)

    def put(self, event: RowEvent) -> None:
        """Append an event and wake the reader."""
        self._items.append(event)
        self.unread += len(event.token_ids)
        for logprob in event.logprobs or ():
            self.unread += len(logprob.top)
        if self._lot:  # a reader is parked (unpark_all is not free when none is)
            self._lot.unpark_all()

    @property
    def ready(self) -> bool:
        """Whether ``take`` has events, or the outbox is closed."""
        return bool(self._items) or self.closed

    def close(self) -> None:
        """No more events will come; wake the reader."""
        self.closed = True
        self._lot.unpark_all()

    def take(self) -> list[RowEvent]:
        """Every event buffered so far."""
        items, self._items = self._items, []
        self.unread = 0
        return items

    async def wait(self) -> None:
        """Wait until there is an event, or the outbox is closed."""
        while not self._items and not self.closed:
            await self._lot.park()


@attrs.define(eq=False)
class Request:
    """One submitted item: a batch row, a serial generation or an exclusive job."""

    id: int
    lane: LaneName
    spec: RowSpec | None = None
    work: Callable[[], Any] | None = None
    #: An embedding request's inputs and the vectors that came back.
    embed: EmbedWork | None = None
    outbox: Outbox = attrs.field(factory=Outbox)
    cancel_flag: threading.Event = attrs.field(factory=threading.Event)
    phase: Phase = Phase.INBOX
    submitted: float = 0.0
    first_token: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    generated: int = 0
    #: For jobs: the job's result, set when it ended.
    result: outcome.Outcome[Any] | None = None
    #: A serial generation's last event, delivered when its job has ended.
    final: RowEvent | None = None
    #: The lane has seen this row (it was part of a step).
    inserted: bool = False
    done: trio.Event = attrs.field(factory=trio.Event)
    #: Set once the actor has taken the request from the inbox (``rejection`` says how).
    accepted: trio.Event = attrs.field(factory=trio.Event)
    rejection: BaseException | None = None


@attrs.frozen
class EngineStatistics:
    """A frozen snapshot of the engine (tests and ``/metrics`` read this)."""

    state: str
    running_rows: int
    queued_rows: int
    parked_rows: int
    waiting_jobs: int
    #: 1 while an exclusive job (a serial generation, a mount, a user function) runs.
    running_jobs: int
    worker_alive: bool
    #: Seconds the MLX thread spent running calls since the engine started.
    worker_busy_seconds: float
    #: Rows the batch lane held after the last step (running or parked, on the MLX thread).
    batch_rows: int
    adapters: tuple[str, ...]
    #: Requests by ``"lane:outcome"`` (lanes batch, serial, job).
    requests: Mapping[str, int]
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    drains: int
    preemptions: int
    steps: int
    arbiter: ArbiterStatistics
    #: Processes the model is sharded over (1: one process; see distributed mode).
    ranks: int = 1
    #: Step calls that inserted new rows (grouped admission: fewer than rows admitted).
    admissions: int = 0
    #: With a prefill stall bound (``open_engine(prefill_stall=)``): the chunk the last
    #: step was planned with (None: the lane's budget), and the planner's moving
    #: averages of a decode-only step and of what a prompt token adds to a step, in
    #: seconds (None until measured, or without a bound).
    prefill_chunk: int | None = None
    decode_step_seconds: float | None = None
    prompt_token_seconds: float | None = None
    #: MLX's allocator, in bytes: memory held by live arrays (weights, KV caches,
    #: the prompt cache), freed buffers kept for reuse, and the high-water mark
    #: of active memory (this process, rank 0 under distributed mode). 0 where unread.
    mlx_active_memory: int = 0
    mlx_cache_memory: int = 0
    mlx_peak_memory: int = 0
    #: Bytes the prompt cache counts for its entries (0 when it is off).
    prompt_cache_bytes: int = 0
    #: The prompt cache's entries, hits, tokens reused and disk tier (None when it is off).
    prompt_cache: PromptCacheStatistics | None = None
    #: Ended requests that named an adapter, by ``"lane:adapter"`` (lanes batch, serial).
    adapter_requests: Mapping[str, int] = attrs.field(factory=dict)
    #: Live requests that named an adapter, by ``"lane:adapter"``: every one not yet
    #: ended, whether queued, decoding or parked (a gauge; absent keys are 0).
    adapter_rows: Mapping[str, int] = attrs.field(factory=dict)
    #: The rows' KV memory budget in bytes (``open_engine(kv_memory_bytes=)``; 0: none),
    #: and the worst case the running and parked rows hold of it.
    kv_memory_budget: int = 0
    kv_memory_reserved: int = 0
    #: Embedding inputs served, and their tokens (requests: ``"embed:<ending>"``).
    embedding_inputs: int = 0
    embedding_tokens: int = 0
    #: Speculative decoding's draft tokens verified and accepted, by method
    #: (``"prompt_lookup"``); empty while it is off.
    draft_tokens: Mapping[str, int] = attrs.field(factory=dict)
    draft_accepted_tokens: Mapping[str, int] = attrs.field(factory=dict)


def failure(error: BaseException) -> BaseException:
    """The error a consumer sees for a failed request."""
    if isinstance(error, TrioMLXError):
        return error
    failed = GenerationFailed(f"generation failed: {type(error).__name__}: {error}")
    failed.__cause__ = error
    return failed
