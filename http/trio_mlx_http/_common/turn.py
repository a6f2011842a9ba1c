"""One assistant turn, rendered as typed events: the engine side of ``/v1/responses`` and ``/v1/messages``.

Both APIs ask for one choice and describe it as a sequence of typed pieces
(text, then tool calls), whole or streamed as named server-sent events. This
module runs that one engine request -- prepared as chat completions' are
(:mod:`~trio_mlx_http._common.prepare`), streamed by the same driver
(:mod:`~trio_mlx_http._common.drive`) -- and hands each piece to a
:class:`Renderer` that speaks the endpoint's shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
from quart import Response

from trio_mlx import Delta, GenerationResult, GenerationStream, TrioMLXError
from trio_mlx_http._common import sse as _sse
from trio_mlx_http._common.drive import drive, sse_response
from trio_mlx_http._common.prepare import prepare
from trio_mlx_http._common.reasoning import ReasoningSplitter
from trio_mlx_http._common.tools import ToolCall, ToolCallExtractor
from trio_mlx_http._openai.schema import GenerationRequest
from trio_mlx_http._server.state import Access, ServerState

__all__ = ["Ending", "Event", "Piece", "Renderer", "Thought", "run_turn"]

#: A named server-sent event: (event name, JSON payload).
Event = tuple[str, dict[str, Any]]


@attrs.frozen
class Thought:
    """Reasoning text: a thinking model's block (``<think>...</think>``), split out."""

    text: str


#: What a turn is made of, in order: reasoning, visible text and completed tool calls.
Piece = str | ToolCall | Thought


@attrs.frozen
class Ending:
    """How the turn ended, in the terms both APIs need."""

    result: GenerationResult
    #: Whether the turn made at least one tool call.
    called: bool
    #: The client's stop sequence that ended the turn (None: EOS, length, or no match).
    stop_sequence: str | None
    #: Tokens of the reasoning text (re-tokenized: the markers and the block's edges are
    #: not counted), part of ``result.completion_tokens``.
    reasoning_tokens: int = 0


class Renderer(Protocol):
    """One endpoint's shapes for a turn (a fresh renderer per request)."""

    def opened(self, prompt_tokens: int) -> list[Event]:
        """The stream's first events, once the engine admitted the request."""
        ...

    def piece(self, piece: Piece) -> list[Event]:
        """Events for the next text or tool call."""
        ...

    def closed(self, ending: Ending) -> list[Event]:
        """The stream's last events."""
        ...

    def failed(self, error: TrioMLXError) -> list[Event]:
        """The events that end a stream which failed after admission."""
        ...

    def keepalive(self) -> bytes:
        """What the stream sends after ``Settings.sse_keepalive`` seconds of silence."""
        ...

    def whole(self, pieces: Sequence[Piece], ending: Ending) -> dict[str, Any]:
        """The non-streaming response body."""
        ...


@attrs.define
class _Splitter:
    """Generated text in, pieces out: reasoning first, then text before the calls it precedes."""

    extractor: ToolCallExtractor | None
    reasoning: ReasoningSplitter | None = None
    #: All reasoning text split out so far.
    thoughts: list[str] = attrs.field(factory=list)

    def feed(self, text: str, *, final: bool = False) -> list[Piece]:
        pieces: list[Piece] = []
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, final=final)
            if thought:
                self.thoughts.append(thought)
                pieces.append(Thought(thought))
        if self.extractor is None:
            return pieces + ([text] if text else [])
        shown, calls = self.extractor.feed(text)
        if final:
            rest, more = self.extractor.finish()
            shown, calls = shown + rest, calls + more
        if shown:
            pieces.append(shown)
        return pieces + list(calls)

    @property
    def called(self) -> bool:
        return self.extractor is not None and self.extractor.called

    def ending(self, result: GenerationResult, stop: str | None, tokenizer: Any) -> Ending:
        """How the turn ended, with its reasoning tokens counted."""
        thought = "".join(self.thoughts)
        counted = len(tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        return Ending(result, self.called, stop, counted)


def _stop_sequence(
    result: GenerationResult, token_ids: Sequence[int], stops: Sequence[str], tokenizer: Any
) -> str | None:
    """Which stop sequence ended the turn.

    The engine reports EOS and stop sequences alike as "stop"; an EOS token is
    counted in ``completion_tokens`` but is not among the returned token ids,
    while the token that completed a stop sequence is. The matched sequence is
    the earliest one in the decoded tokens (the engine's own rule).
    """
    if result.finish_reason != "stop" or not stops or result.completion_tokens > len(token_ids):
        return None
    text = str(tokenizer.decode(list(token_ids)))
    found = [(text.find(stop), order, stop) for order, stop in enumerate(stops)]
    hits = sorted(hit for hit in found if hit[0] >= 0)
    return hits[0][2] if hits else None


async def run_turn(
    state: ServerState,
    request: GenerationRequest,
    renderer_for: Callable[[str], Renderer],
    access: Access,
    *,
    continue_final: bool = False,
) -> Response | dict[str, Any]:
    """Run the one-choice ``request``; a stream of named events or the whole body.

    ``renderer_for`` gets the model id to answer with; ``continue_final``: the
    last assistant message is continued (see ``Engine.prepare``).
    """
    prepared = await prepare(state, request, continue_final=continue_final)
    request = prepared.request
    splitter = _Splitter(prepared.extractor(), prepared.reasoning())
    renderer = renderer_for(prepared.model)
    tokenizer = state.engine.tokenizer
    if request.stream:
        stream = state.engine.generate(prepared.prompts[0], request.params, client=access.client)
        feed = _TurnFeed(renderer, splitter, request.params.stop, tokenizer)
        return await sse_response(drive(state, access, [stream], feed), access)
    completion = await state.engine.complete(
        prepared.prompts[0], request.params, client=access.client
    )
    result = completion.result
    access.tokens = result.completion_tokens
    state.metrics.finished(access.endpoint, result)
    pieces = splitter.feed(completion.text, final=True)
    stop = _stop_sequence(result, completion.token_ids, request.params.stop, tokenizer)
    return renderer.whole(pieces, splitter.ending(result, stop, tokenizer))


def _frame(events: list[Event]) -> list[bytes]:
    """Events ready together, framed as one write (one ASGI send, one chunk on the wire)."""
    return (
        [b"".join([_sse.named_event(name, payload) for name, payload in events])] if events else []
    )


@attrs.define(eq=False)
class _TurnFeed:
    """The driver's feed of one turn: the renderer's named events for the splitter's pieces."""

    renderer: Renderer
    splitter: _Splitter
    stops: Sequence[str]
    tokenizer: Any
    token_ids: list[int] = attrs.field(factory=list)

    def opening(self, streams: Sequence[GenerationStream]) -> list[bytes]:
        return _frame(self.renderer.opened(streams[0].prompt_tokens))

    def delta(self, index: int, delta: Delta) -> list[bytes]:
        self.token_ids.extend(delta.token_ids)
        return _frame([e for p in self.splitter.feed(delta.text) for e in self.renderer.piece(p)])

    def end(self, index: int, result: GenerationResult) -> list[bytes]:
        events = [e for p in self.splitter.feed("", final=True) for e in self.renderer.piece(p)]
        stop = _stop_sequence(result, self.token_ids, self.stops, self.tokenizer)
        return _frame(
            events + self.renderer.closed(self.splitter.ending(result, stop, self.tokenizer))
        )

    def closing(self, results: Sequence[GenerationResult]) -> list[bytes]:
        return []

    def failed(self, error: TrioMLXError) -> list[bytes]:
        return _frame(self.renderer.failed(error))

    def keepalive(self) -> bytes:
        return self.renderer.keepalive()
