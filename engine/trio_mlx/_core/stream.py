"""One streaming completion: :class:`GenerationStream`, what ``Engine.generate`` returns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType

import attrs
import trio

from trio_mlx._core.request import Phase, Request, failure
from trio_mlx._errors import EngineClosed
from trio_mlx._lanes.output import RowEvent
from trio_mlx._params import Delta, GenerationResult, TokenLogprob

__all__ = ["GenerationStream"]


@attrs.define(eq=False)
class GenerationStream:
    """One streaming completion; an async context manager and an async iterator of deltas."""

    #: Submits the request (tokenizing and checking it first); called once, on entry.
    _submit: Callable[[], Awaitable[Request]]
    #: Cancels the request (the actor's ``cancel_nowait``).
    _cancel: Callable[[Request], None]
    _request: Request | None = attrs.field(init=False, default=None)
    _result: GenerationResult | None = attrs.field(init=False, default=None)
    _error: BaseException | None = attrs.field(init=False, default=None)
    _ended: bool = attrs.field(init=False, default=False)

    @property
    def prompt_tokens(self) -> int:
        """How many tokens the prompt has."""
        if self._request is None or self._request.spec is None:
            raise RuntimeError("enter the stream with 'async with' first")
        return len(self._request.spec.prompt)

    @property
    def lane(self) -> str:
        """``"batch"`` or ``"serial"``: where the request runs."""
        if self._request is None:
            raise RuntimeError("enter the stream with 'async with' first")
        return self._request.lane.value

    @property
    def max_tokens(self) -> int:
        """The max_tokens the request runs with (cut to the room left in the context)."""
        if self._request is None or self._request.spec is None:
            raise RuntimeError("enter the stream with 'async with' first")
        return self._request.spec.params.max_tokens

    @property
    def ready(self) -> bool:
        """Whether the next delta (or the end) can be taken without waiting."""
        return self._request is not None and (
            self._request.outbox.ready or self._error is not None or self._ended
        )

    @property
    def running(self) -> bool:
        """Whether the request is generating now (not waiting for a row, nor done)."""
        return self._request is not None and self._request.phase is Phase.RUNNING

    @property
    def result(self) -> GenerationResult:
        """How the completion ended, with usage and timings (after the iteration ended)."""
        if self._result is None:
            raise RuntimeError("the stream has not finished")
        return self._result

    async def __aenter__(self) -> GenerationStream:
        if self._request is not None:
            raise RuntimeError("a GenerationStream can be entered only once")
        await trio.lowlevel.checkpoint_if_cancelled()
        self._request = await self._submit()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        request = self._request
        if request is not None and request.phase is not Phase.DONE:
            self._cancel(request)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Delta:
        request = self._request
        if request is None:
            raise RuntimeError("enter the stream with 'async with' first")
        # A full checkpoint either way, but only one task switch per delta in
        # the steady state: a reader that parks for its next tokens already
        # yielded, so only the no-wait path adds a schedule point.
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            if self._error is not None:
                error, self._error = self._error, None
                self._ended = True
                raise error
            if self._ended:
                raise StopAsyncIteration
            events = request.outbox.take()
            if not events:
                if request.outbox.closed:
                    self._ended = True
                    self._error = EngineClosed("the request ended without a result")
                    continue
                await request.outbox.wait()
                waited = True
                continue
            delta = self._merge(request, events)
            if delta is not None:
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return delta

    def _merge(self, request: Request, events: list[RowEvent]) -> Delta | None:
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        for event in events:
            if event.error is not None:
                self._error = failure(event.error)
                break
            texts.append(event.text)
            ids.extend(event.token_ids)
            if event.logprobs:
                logprobs.extend(event.logprobs)
            if event.finish_reason is not None:
                self._result = self._make_result(request, event.finish_reason)
                self._ended = True
                break
        text = "".join(texts)
        if not text and not ids:
            return None
        wanted = request.spec is not None and request.spec.params.logprobs
        return Delta(text, tuple(ids), tuple(logprobs) if wanted else None)

    def _make_result(self, request: Request, finish_reason: str) -> GenerationResult:
        end = request.finished_at if request.finished_at is not None else trio.current_time()
        first = request.first_token
        assert request.spec is not None
        return GenerationResult(
            finish_reason=finish_reason,
            prompt_tokens=len(request.spec.prompt),
            completion_tokens=request.generated,
            cached_tokens=request.cached_tokens,
            lane=request.lane.value,
            time_to_first_token=None if first is None else first - request.submitted,
            duration=end - request.submitted,
            max_tokens=request.spec.params.max_tokens,
        )
