"""The actor's books: every live request by id, what reached each, how each ended.

The actor decides and carries decisions out; the :class:`Ledger` keeps the records
those decisions read and change: the live requests, the tokens delivered to each
outbox, the lane's rows, the counters :meth:`~trio_mlx._core.actor.Actor.statistics` reports, and
whether the engine is idle. Trio thread only, like the actor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import attrs
import outcome
import trio

from trio_mlx._core.gate import LaneName
from trio_mlx._core.request import Ending, Phase, Request
from trio_mlx._errors import ReaderStalled
from trio_mlx._lanes.output import RowEvent

__all__ = ["Ledger"]


@attrs.define(eq=False)
class Ledger:
    """The live requests and the counts of the ended ones."""

    #: A request whose unread output passes this is cancelled (None: no limit).
    max_unread: int | None = None
    #: The rows the batch lane holds after its last step or discard.
    batch_rows: int = attrs.field(init=False, default=0)
    _requests: dict[int, Request] = attrs.field(init=False, factory=dict)
    _counts: Counter[str] = attrs.field(init=False, factory=Counter)
    _adapter_counts: Counter[str] = attrs.field(init=False, factory=Counter)
    _tokens: Counter[str] = attrs.field(init=False, factory=Counter)
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self._idle.set()

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests.values()))

    def __bool__(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: int) -> Request | None:
        """The live request of ``request_id`` (None: ended, or never seen)."""
        return self._requests.get(request_id)

    def __getitem__(self, request_id: int) -> Request:
        return self._requests[request_id]

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def open(self, request: Request) -> None:
        """A submission entered the inbox: it is live until :meth:`end`."""
        self._requests[request.id] = request
        if self._idle.is_set():
            self._idle = trio.Event()

    def refused(self, lane: LaneName) -> None:
        """Count a submission refused before it reached the inbox."""
        self._counts[f"{lane}:{Ending.REJECTED}"] += 1

    def queued(self, request: Request) -> None:
        """The arbiter took the request: its prompt tokens count."""
        if request.spec is not None:
            self._tokens["prompt"] += len(request.spec.prompt)

    def cached(self, request: Request, tokens: int) -> None:
        """``tokens`` of the request's prompt came from the prompt cache."""
        request.cached_tokens = tokens
        self._tokens["cached"] += tokens

    def deliver(self, request: Request, event: RowEvent, now: float) -> None:
        """Put ``event`` in the request's outbox, counting its tokens and timings."""
        if event.generated > request.generated:
            self._tokens["generated"] += event.generated - request.generated
            request.generated = event.generated
        if request.first_token is None and event.token_ids:
            request.first_token = now
        if event.finish_reason is not None or event.error is not None:
            request.finished_at = now
        request.outbox.put(event)

    def embedded(self, request: Request) -> None:
        """An embedding request's vectors all came back: its inputs and tokens count."""
        if request.embed is not None:
            self._tokens["embedding_inputs"] += len(request.embed.inputs)
            self._tokens["embedding"] += sum(len(tokens) for tokens in request.embed.inputs)

    def stalled(self, request: Request) -> bool:
        """Whether the request's reader stopped taking its output; if so, the request
        gets :class:`~trio_mlx.ReaderStalled` as its last event (the caller cancels it)."""
        limit = self.max_unread
        if limit is None or request.outbox.unread <= limit or request.cancel_flag.is_set():
            return False
        error = ReaderStalled(
            f"the reader stopped taking the output ({request.outbox.unread} tokens "
            f"unread, the limit is {limit}); the request was cancelled",
        )
        request.result = outcome.Error(error)
        request.outbox.put(RowEvent(request.id, error=error))
        return True

    def end(self, request: Request, how: Ending) -> None:
        """The request is done (once): counted, closed, and its waiters woken."""
        if request.phase is Phase.DONE:
            return
        request.phase = Phase.DONE
        if request.finished_at is None:
            request.finished_at = trio.current_time()
        self._counts[f"{request.lane}:{how}"] += 1
        if request.spec is not None and request.spec.params.adapter is not None:
            self._adapter_counts[f"{request.lane}:{request.spec.params.adapter}"] += 1
        self._requests.pop(request.id, None)
        request.outbox.close()
        request.done.set()
        request.accepted.set()
        if not self._requests:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Wait until no request is live."""
        await self._idle.wait()

    def requests(self) -> Mapping[str, int]:
        """Ended requests by ``"lane:ending"`` (every pair, zeros included)."""
        counts = {f"{lane}:{o}": self._counts[f"{lane}:{o}"] for lane in LaneName for o in Ending}
        return MappingProxyType(counts)

    def tokens(self, kind: str) -> int:
        """Tokens counted so far: ``"prompt"``, ``"cached"``, ``"generated"``, ``"embedding"``
        (and ``"embedding_inputs"``, the inputs embedded)."""
        return self._tokens[kind]

    def adapter_requests(self) -> Mapping[str, int]:
        """Ended requests that named an adapter, by ``"lane:adapter"``."""
        return MappingProxyType(dict(self._adapter_counts))

    def adapter_rows(self) -> Mapping[str, int]:
        """Live requests that named an adapter, by ``"lane:adapter"``."""
        live: Counter[str] = Counter()
        for request in self._requests.values():
            if request.spec is not None and request.spec.params.adapter is not None:
                live[f"{request.lane}:{request.spec.params.adapter}"] += 1
        return MappingProxyType(dict(live))
