"""No silent stream: keep-alives while a streamed request waits for its next output.

A stream can wait long for its first token (queued behind other requests or
an exclusive job, or in a long prefill); proxies and clients with idle
timeouts drop a connection that says nothing. Every read of the engine's
stream waits at most ``Settings.sse_keepalive`` seconds; when it times out,
the body sends a keep-alive (an SSE comment on the OpenAI routes, Anthropic's
``ping`` event on ``/v1/messages``) and waits again. Leaving the wait loses
nothing: a ``GenerationStream`` takes a delta out of its outbox only once one
is there, so a read cancelled while waiting leaves the stream as it was.
"""

from __future__ import annotations

import trio

from trio_mlx import Delta, GenerationStream

__all__ = ["COMMENT", "next_delta"]

#: The keep-alive of the OpenAI routes: an SSE comment, which SSE parsers skip.
COMMENT = b": keep-alive\n\n"


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
