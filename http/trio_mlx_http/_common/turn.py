"""One assistant turn, rendered as typed events: the engine side of ``/v1/responses`` and ``/v1/messages``.

Both APIs ask for one choice and describe it as a sequence of typed pieces
(text, then tool calls), whole or streamed as named server-sent events. This
module runs that one engine request -- through the same helpers as chat
completions (model resolution, the context clamp, the tool check, the tool-call
extractor), on the same lanes, with the same disconnect and metrics handling --
and hands each piece to a :class:`Renderer` that speaks the endpoint's shapes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import attrs
from quart import Response

from trio_mlx import GenerationResult, TrioMLXError
from trio_mlx_http._common import sse as _sse
from trio_mlx_http._common.images import resolve_prompts
from trio_mlx_http._common.keepalive import next_delta
from trio_mlx_http._common.reasoning import ReasoningSplitter
from trio_mlx_http._common.tools import ToolCall, ToolCallExtractor
from trio_mlx_http._errors import status_of
from trio_mlx_http._openai.chat import (
    _check_tools,
    _clamp_max_tokens,
    _enforce_tool_choice,
    _extractor,
    _opens_reasoning,
    _reasoning_effort,
    _resolve_model,
    reasoning_markers,
)
from trio_mlx_http._openai.schema import GenerationRequest
from trio_mlx_http._server.state import Access, ServerState

__all__ = ["Ending", "Event", "Piece", "Renderer", "Thought", "run_turn"]

logger = logging.getLogger("trio_mlx_http")

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


async def _prepare(
    state: ServerState, request: GenerationRequest
) -> tuple[str, GenerationRequest, _Splitter]:
    model, request = _resolve_model(state, _clamp_max_tokens(state, request))
    _check_tools(state, request.tools)
    prompts = await resolve_prompts(state.engine, state.settings, request.prompts)
    request = _reasoning_effort(state, attrs.evolve(request, prompts=prompts))
    splitter = _Splitter(_extractor(state, request))
    markers = reasoning_markers(state)
    opened = False
    if markers is not None:
        opened = await _opens_reasoning(state, request, markers)
        splitter.reasoning = (ReasoningSplitter.opened if opened else ReasoningSplitter)(*markers)
    # As on chat: a forced tool call becomes a grammar of the model's tool-call format,
    # and any constraint starts after a reasoning block the prompt opens.
    reasoning_end = markers[1] if markers is not None and opened else None
    request = _enforce_tool_choice(state, request, reasoning_end)
    if request.reasoning_budget is not None and markers is not None:
        request = _bound_reasoning(state, request, markers, opened)
    return model, request, splitter


def _bound_reasoning(
    state: ServerState, request: GenerationRequest, markers: tuple[str, str], opened: bool
) -> GenerationRequest:
    """The request's reasoning budget as the engine's: the markers as token ids."""
    tokenizer = state.engine.tokenizer
    ids = tuple(tuple(tokenizer.encode(m, add_special_tokens=False)) for m in markers)
    if not all(ids):
        return request  # a marker the tokenizer cannot spell: max_tokens bounds it
    params = attrs.evolve(
        request.params,
        reasoning_budget=request.reasoning_budget,
        reasoning_markers=(ids[0], ids[1]),
        reasoning_opened=opened,
    )
    return attrs.evolve(request, params=params)


async def run_turn(
    state: ServerState,
    request: GenerationRequest,
    renderer_for: Callable[[str], Renderer],
    access: Access,
) -> Response | dict[str, Any]:
    """Run the one-choice ``request``; a stream of named events or the whole body.

    ``renderer_for`` gets the model id to answer with.
    """
    model, request, splitter = await _prepare(state, request)
    renderer = renderer_for(model)
    if request.stream:
        body = _stream(state, request, renderer, splitter, access)
        await anext(body)  # enters the engine request: admission errors become statuses
        access.by_body = True
        return Response(body, status=200, headers=_sse.SSE_HEADERS, content_type=_sse.CONTENT_TYPE)
    completion = await state.engine.complete(
        request.prompts[0],
        request.params,
        tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
        client=access.client,
    )
    result = completion.result
    access.tokens = result.completion_tokens
    state.metrics.finished(access.endpoint, result)
    pieces = splitter.feed(completion.text, final=True)
    stop = _stop_sequence(result, completion.token_ids, request.params.stop, state.engine.tokenizer)
    return renderer.whole(pieces, splitter.ending(result, stop, state.engine.tokenizer))


def _frame(events: list[Event]) -> bytes:
    """Events ready together, framed as one write (one ASGI send, one chunk on the wire)."""
    return b"".join([_sse.named_event(name, payload) for name, payload in events])


async def _stream(
    state: ServerState,
    request: GenerationRequest,
    renderer: Renderer,
    splitter: _Splitter,
    access: Access,
) -> AsyncIterator[bytes]:
    """The SSE body: the renderer's events, framed with their names."""
    status = 499  # nginx's "client closed request", logged if the client leaves
    admitted = False
    try:
        async with state.engine.generate(
            request.prompts[0],
            request.params,
            tools=request.tools,
            chat_template_kwargs=request.chat_template_kwargs,
            client=access.client,
        ) as stream:
            admitted = True
            yield b""  # primed: admitted
            try:
                # The opening events go out at once, before the first token.
                if opening := renderer.opened(stream.prompt_tokens):
                    yield _frame(opening)
                events: list[Event] = []
                token_ids: list[int] = []
                interval = state.settings.sse_keepalive
                while True:
                    try:
                        delta = await next_delta(stream, interval)
                    except StopAsyncIteration:
                        break
                    if delta is None:
                        yield renderer.keepalive()
                        continue
                    token_ids.extend(delta.token_ids)
                    access.tokens = len(token_ids)
                    for piece in splitter.feed(delta.text):
                        events += renderer.piece(piece)
                    if events:
                        yield _frame(events)
                    events = []
                for piece in splitter.feed("", final=True):
                    events += renderer.piece(piece)
                result = stream.result
                access.tokens = result.completion_tokens
                state.metrics.finished(access.endpoint, result)
                stop = _stop_sequence(
                    result, token_ids, request.params.stop, state.engine.tokenizer
                )
                events += renderer.closed(splitter.ending(result, stop, state.engine.tokenizer))
            except TrioMLXError as error:
                logger.warning("stream failed: %s", error.message)
                state.metrics.failed(access.endpoint, "error")
                status = status_of(error)
                access.cut_by(error)
                events = renderer.failed(error)
            if events:
                yield _frame(events)
        if status == 499:  # every event written: a whole stream
            status = 200
    finally:
        access.stream_ended(status, admitted=admitted)
