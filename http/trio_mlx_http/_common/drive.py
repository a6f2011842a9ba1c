"""The one SSE driver: engine streams in, an endpoint's events out, for every streamed route.

A :class:`Feed` speaks one endpoint's shapes (OpenAI's chunks, Responses' or
Anthropic's named events); :func:`drive` does the rest, the same for all:

- enters every engine request before the status line (the body is primed by
  :func:`sse_response`), so admission errors (400, 404, 429, 503) are statuses;
- reads the choices round-robin, the ready ones first (:func:`next_readers`);
- sends events ready together as one write, and what is pending before any
  read that may wait;
- **no silent stream**: each read waits at most ``Settings.sse_keepalive``
  seconds, then the feed's keep-alive goes out (an SSE comment on the OpenAI
  routes, Anthropic's ``ping``) and the read resumes. Leaving the wait loses
  nothing: a ``GenerationStream`` takes a delta out of its outbox only once one
  is there;
- ends the same way: metrics and the access record per choice, an engine error
  after the 200 as the feed's error events, the stream's status logged (499
  when the client left).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol

import trio
from quart import Response

from trio_mlx import Delta, GenerationResult, GenerationStream, TrioMLXError
from trio_mlx_http._common import sse as _sse
from trio_mlx_http._errors import status_of
from trio_mlx_http._server.state import Access, ServerState

__all__ = ["COMMENT", "Feed", "drive", "next_delta", "next_readers", "sse_response"]

logger = logging.getLogger("trio_mlx_http")

#: The keep-alive of the OpenAI routes: an SSE comment, which SSE parsers skip.
COMMENT = b": keep-alive\n\n"


class Feed(Protocol):
    """One endpoint's events for a stream of one or more choices (framed bytes)."""

    def opening(self, streams: Sequence[GenerationStream]) -> list[bytes]:
        """The first events, once every choice is admitted."""
        ...

    def delta(self, index: int, delta: Delta) -> list[bytes]:
        """Events for choice ``index``'s next output."""
        ...

    def end(self, index: int, result: GenerationResult) -> list[bytes]:
        """Events for choice ``index``'s end."""
        ...

    def closing(self, results: Sequence[GenerationResult]) -> list[bytes]:
        """The last events, after every choice ended."""
        ...

    def failed(self, error: TrioMLXError) -> list[bytes]:
        """The events that end a stream which failed after the 200."""
        ...

    def keepalive(self) -> bytes:
        """What goes out after ``Settings.sse_keepalive`` seconds of silence."""
        ...


async def next_delta(stream: GenerationStream, interval: float | None) -> Delta | None:
    """The stream's next delta, or None after ``interval`` seconds without one.

    ``interval`` None waits as long as it takes. ``StopAsyncIteration`` and the
    engine's errors pass through.
    """
    if interval is None:
        return await anext(stream)
    with trio.move_on_after(interval):
        return await anext(stream)
    return None


def next_readers(streams: Sequence[GenerationStream], active: list[int]) -> list[int]:
    """The choices to read this round: those with output ready, else one that is running.

    Waiting on a choice still queued for a batch row while the others generate
    would leave their output unread, and the engine cancels a request whose
    unread output passes its bound.
    """
    if len(active) == 1:  # one choice (most streams): whichever way, it is read
        return active[:1]
    ready = [index for index in active if streams[index].ready]
    if ready:
        return ready
    running = [index for index in active if streams[index].running]
    return running[:1] or active[:1]


async def drive(
    state: ServerState, access: Access, streams: Sequence[GenerationStream], feed: Feed
) -> AsyncIterator[bytes]:
    """The SSE body of ``streams`` (not yet entered) in ``feed``'s events."""
    status = 499  # nginx's "client closed request", logged if the client leaves
    admitted = False
    try:
        results: list[GenerationResult | None] = [None] * len(streams)
        async with contextlib.AsyncExitStack() as stack:
            for stream in streams:
                await stack.enter_async_context(stream)
            admitted = True
            yield b""  # primed: all admitted
            sent = [0] * len(streams)  # tokens per choice, for the access log
            # Events ready together leave as one write (one ASGI send, one chunk
            # frame). None waits for another: what is pending leaves before any wait.
            pending = feed.opening(streams)
            interval = state.settings.sse_keepalive
            try:
                active = list(range(len(streams)))
                while active:
                    for index in next_readers(streams, active):
                        if pending and not streams[index].ready:
                            yield b"".join(pending)
                            pending.clear()
                        try:
                            while (delta := await next_delta(streams[index], interval)) is None:
                                yield feed.keepalive()
                        except StopAsyncIteration:
                            active.remove(index)
                            result = results[index] = streams[index].result
                            sent[index] = result.completion_tokens
                            state.metrics.finished(access.endpoint, result)
                            pending += feed.end(index, result)
                        else:
                            sent[index] += len(delta.token_ids)
                            pending += feed.delta(index, delta)
                        access.tokens = sum(sent)
                    if pending and active:
                        yield b"".join(pending)
                        pending.clear()
            except TrioMLXError as error:
                logger.warning("stream failed: %s", error.message)
                state.metrics.failed(access.endpoint, "error")
                status = status_of(error)
                access.cut_by(error)
                yield b"".join([*pending, *feed.failed(error)])
                return
        pending += feed.closing([r for r in results if r is not None])
        yield b"".join(pending)
        status = 200
    finally:
        access.stream_ended(status, admitted=admitted)


async def sse_response(
    body: AsyncIterator[bytes],
    access: Access,
    headers: Callable[[], Mapping[str, str]] | None = None,
) -> Response:
    """The streamed response of ``body`` (:func:`drive`'s), its requests admitted first.

    ``headers``: more headers, asked for once every request is admitted.
    """
    await anext(body)  # enters every engine request: admission errors become statuses
    access.by_body = True
    more = headers() if headers is not None else {}
    return Response(
        body, status=200, headers={**_sse.SSE_HEADERS, **more}, content_type=_sse.CONTENT_TYPE
    )
