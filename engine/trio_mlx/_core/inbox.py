"""The actor's inbox: the bounded channel submissions wait in, and its actor side.

``put_nowait`` is the submitting side (on the Trio thread, never blocking: a
full inbox raises :class:`~trio_mlx.EngineOverloaded` at once, a closed one
:class:`~trio_mlx.EngineClosed`); :meth:`Inbox.take`
is the actor's, which hands every waiting request to the arbiter and records
its answer: queued, or refused with the reason (closed, too large for the KV
memory budget, queue full). The inbox holds a full queue plus a full batch, so
the arbiter, not the inbox, is what normally says no.
"""

from __future__ import annotations

import attrs
import trio

from trio_mlx._core.arbiter import Arbiter, ArbiterPolicy, Rejection
from trio_mlx._core.gate import LaneName
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.request import Ending, Phase, Request
from trio_mlx._errors import EngineClosed, EngineOverloaded, InvalidRequest
from trio_mlx._lanes.records import RowSpec
from trio_mlx._memory import KVBudget

__all__ = ["Inbox", "too_large"]


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
class Inbox:
    """Submissions on their way to the arbiter (Trio thread only)."""

    policy: ArbiterPolicy
    arbiter: Arbiter
    books: Ledger
    #: Whether submissions are refused (the engine is closing or closed).
    closed: bool = attrs.field(init=False, default=False)
    _send: trio.MemorySendChannel[Request] = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel[Request] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        size = self.policy.max_queue + self.policy.max_batch
        self._send, self._receive = trio.open_memory_channel[Request](size)

    @property
    def waiting(self) -> int:
        """Requests in the inbox that the actor has not taken yet."""
        return self._send.statistics().current_buffer_used

    def put_nowait(self, request: Request) -> None:
        """Queue a submission (live from now on), or raise EngineClosed or
        EngineOverloaded (counted as refused) at once."""
        if self.closed:
            self.books.refused(request.lane)
            raise EngineClosed("the engine is closed")
        try:
            self._send.send_nowait(request)
        except trio.WouldBlock:
            self.books.refused(request.lane)
            raise EngineOverloaded("the engine's inbox is full", retry_after=1.0) from None
        request.submitted = trio.current_time()
        self.books.open(request)

    def refuse(self) -> None:
        """Refuse new submissions from now on (the engine is closing)."""
        self.closed = True

    def close(self) -> None:
        """Refuse new submissions and close the channel (the engine has stopped)."""
        self.closed = True
        self._send.close()

    def take(self) -> None:
        """Move everything in the inbox to the arbiter (the actor's side of ``submit``)."""
        while True:
            try:
                request = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if request.phase is Phase.INBOX:  # else cancelled while it waited
                self._accept(request)

    def _accept(self, request: Request) -> None:
        now = trio.current_time()
        spec = request.spec
        # A generation's worst case: its prompt and every token it may generate.
        tokens = 0 if spec is None else len(spec.prompt) + spec.params.max_tokens
        if request.embed is not None:  # its pass's cache: the longest input, nothing generated
            tokens = max(len(tokens) for tokens in request.embed.inputs)
        if request.lane in (LaneName.BATCH, LaneName.EMBED):
            rejection = self.arbiter.submit_row(request.id, now, tokens)
        else:
            rejection = self.arbiter.submit_job(request.id, now, tokens)
        if rejection is None:
            request.phase = Phase.PENDING
            self.books.queued(request)
        else:
            request.rejection = self._refusal(rejection, spec)
            self.books.end(request, Ending.REJECTED)
        request.accepted.set()

    def _refusal(self, rejection: Rejection, spec: RowSpec | None) -> Exception:
        if rejection is Rejection.CLOSED:
            return EngineClosed("the engine is closed")
        if rejection is Rejection.TOO_LARGE:
            if spec is None:  # an embedding request: its longest input
                return InvalidRequest(
                    "an input is too long for the engine's KV memory budget",
                    param="input",
                    code="kv_memory_exceeded",
                )
            assert self.policy.memory is not None
            return too_large(spec, self.policy.memory)
        return EngineOverloaded(
            f"the engine's queue is full ({self.policy.max_queue} waiting)", retry_after=1.0
        )
