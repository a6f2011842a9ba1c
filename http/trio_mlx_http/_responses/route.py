"""``POST /v1/responses``: OpenAI's Responses API over the engine.

:mod:`trio_mlx_http._responses.request` validates the body; the request runs as one turn
through :mod:`trio_mlx_http._common.turn`, and the renderer below writes the ``response`` object,
its output items (``reasoning``, ``message`` with ``output_text``,
``function_call``) and, when streaming, the typed events with their
``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio
from quart import Response

from trio_mlx import InvalidGrammar, InvalidRequest, NotFound, TrioMLXError
from trio_mlx_http._common.cache_usage import cache_usage
from trio_mlx_http._common.drive import COMMENT
from trio_mlx_http._common.structured import grammar_param
from trio_mlx_http._common.tools import ToolCall
from trio_mlx_http._common.turn import Ending, Event, Piece, Thought, run_turn
from trio_mlx_http._responses.request import ResponsesRequest, parse_responses
from trio_mlx_http._responses.store import ResponseStore, StoredResponse
from trio_mlx_http._server.state import Access, ServerState

__all__ = ["delete", "respond", "stored"]


def _usage(ending: Ending) -> dict[str, Any]:
    result = ending.result
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cache_usage(result).read},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": ending.reasoning_tokens},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _text_part_out(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part_out(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(
    item_id: str, call: ToolCall, status: str, *, arguments: bool = True
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments else "",
        "status": status,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@attrs.define(eq=False)
class _Renderer:
    """The Responses API's shapes for one turn."""

    request: ResponsesRequest
    model: str
    store: ResponseStore
    id: str = attrs.field(factory=lambda: _new_id("resp"))
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    _sequence: int = attrs.field(default=0, init=False)
    _output: list[dict[str, Any]] = attrs.field(factory=list, init=False)
    #: The message item being streamed: (output index, its text so far).
    _open: tuple[int, list[str]] | None = attrs.field(default=None, init=False)
    #: The reasoning item being streamed: (output index, its text so far).
    _thinking: tuple[int, list[str]] | None = attrs.field(default=None, init=False)
    _text: list[str] = attrs.field(factory=list, init=False)
    _calls: list[ToolCall] = attrs.field(factory=list, init=False)

    def _event(self, kind: str, **fields: Any) -> Event:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return kind, payload

    def _response(
        self, status: str, ending: Ending | None = None, error: TrioMLXError | None = None
    ) -> dict[str, Any]:
        request = self.request
        incomplete = None
        if ending is not None and ending.result.finish_reason == "length":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": incomplete,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": list(self._output),
            "parallel_tool_calls": request.generation.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning,
            "store": request.store,
            "temperature": request.temperature,
            "text": request.text,
            "tool_choice": request.tool_choice,
            "tools": request.tools,
            "top_p": request.top_p,
            "truncation": request.truncation,
            "usage": None if ending is None else _usage(ending),
            "metadata": request.metadata,
        }

    @staticmethod
    def _status(ending: Ending) -> str:
        return "incomplete" if ending.result.finish_reason == "length" else "completed"

    def _finish(self, ending: Ending) -> dict[str, Any]:
        """The final response body; stored when the client asked."""
        body = self._response(self._status(ending), ending)
        if self.request.store:
            said: dict[str, Any] = {"role": "assistant", "content": "".join(self._text)}
            if self._calls:
                said["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in self._calls
                ]
            conversation = (*self.request.conversation, said)
            self.store.put(self.id, StoredResponse(body=body, conversation=conversation))
        return body

    # -- streaming -------------------------------------------------------

    def opened(self, prompt_tokens: int) -> list[Event]:
        snapshot = self._response("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open_message(self) -> list[Event]:
        index = len(self._output)
        item_id = _new_id("msg")
        self._output.append(_message_item(item_id, None, "in_progress"))
        self._open = (index, [])
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=_message_item(item_id, None, "in_progress"),
            ),
            self._event("response.content_part.added", **where, part=_text_part_out("")),
        ]

    def _close_message(self, status: str) -> list[Event]:
        if self._open is None:
            return []
        index, pieces = self._open
        self._open = None
        text = "".join(pieces)
        item = _message_item(self._output[index]["id"], text, status)
        self._output[index] = item
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_text_part_out(text)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _think(self, text: str) -> list[Event]:
        events = self._close_message("completed")
        if self._thinking is None:
            index = len(self._output)
            item = _reasoning_item(_new_id("rs"), None, "in_progress")
            self._output.append(item)
            self._thinking = (index, [])
            events.append(self._event("response.output_item.added", output_index=index, item=item))
        index, pieces = self._thinking
        pieces.append(text)
        where = {"item_id": self._output[index]["id"], "output_index": index, "content_index": 0}
        return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]

    def _close_thinking(self) -> list[Event]:
        if self._thinking is None:
            return []
        index, pieces = self._thinking
        self._thinking = None
        text = "".join(pieces)
        item = _reasoning_item(self._output[index]["id"], text, "completed")
        self._output[index] = item
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **where, text=text),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def piece(self, piece: Piece) -> list[Event]:
        if isinstance(piece, Thought):
            return self._think(piece.text)
        closing = self._close_thinking()
        return [*closing, *self._visible(piece)]

    def _visible(self, piece: str | ToolCall) -> list[Event]:
        if isinstance(piece, str):
            events = self._open_message() if self._open is None else []
            assert self._open is not None
            index, pieces = self._open
            pieces.append(piece)
            self._text.append(piece)
            item_id = self._output[index]["id"]
            return [
                *events,
                self._event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                ),
            ]
        events = self._close_message("completed")
        self._calls.append(piece)
        index = len(self._output)
        item_id = _new_id("fc")
        item = _call_item(item_id, piece, "completed")
        self._output.append(item)
        where = {"item_id": item_id, "output_index": index}
        return [
            *events,
            self._event(
                "response.output_item.added",
                output_index=index,
                item=_call_item(item_id, piece, "in_progress", arguments=False),
            ),
            self._event("response.function_call_arguments.delta", **where, delta=piece.arguments),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=piece.name,
                arguments=piece.arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def closed(self, ending: Ending) -> list[Event]:
        status = self._status(ending)
        events = self._close_thinking()
        if not self._output:
            events += self._open_message()
        events += self._close_message(status)
        body = self._finish(ending)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=body)]

    def failed(self, error: TrioMLXError) -> list[Event]:
        return [self._event("response.failed", response=self._response("failed", error=error))]

    def keepalive(self) -> bytes:
        return COMMENT

    # -- whole -----------------------------------------------------------

    def whole(self, pieces: Sequence[Piece], ending: Ending) -> dict[str, Any]:
        status = self._status(ending)
        texts = [p for p in pieces if isinstance(p, str)]
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        thoughts = [p.text for p in pieces if isinstance(p, Thought)]
        if thoughts:
            text = "".join(thoughts)
            self._output.append(_reasoning_item(_new_id("rs"), text, "completed"))
        if texts or not (calls or thoughts):
            self._output.append(_message_item(_new_id("msg"), "".join(texts), status))
        self._output.extend(_call_item(_new_id("fc"), c, "completed") for c in calls)
        self._text, self._calls = texts, calls
        return self._finish(ending)


async def respond(
    state: ServerState, body: Mapping[str, Any], access: Access
) -> Response | dict[str, Any]:
    """Answer one ``POST /v1/responses``."""
    if body.get("previous_response_id") is not None:
        # The stored conversation is parsed from its JSON: off the loop, it may be large.
        request = await trio.to_thread.run_sync(
            parse_responses, body, state.settings, state.responses
        )
    else:
        request = parse_responses(body, state.settings, state.responses)
    try:
        return await run_turn(
            state,
            request.generation,
            lambda model: _Renderer(request, model, state.responses),
            access,
        )
    except InvalidGrammar as error:
        source = "text.format" if request.generation.params.constrained else "tool_choice"
        raise grammar_param(error, source) from None
    except InvalidRequest as error:
        if error.param != "reasoning_effort":
            raise
        # Chat's check of the effort names chat's field; this API calls it reasoning.effort.
        message = error.message.replace("reasoning_effort", "reasoning.effort", 1)
        raise InvalidRequest(message, param="reasoning.effort", code=error.code) from None


def stored(state: ServerState, response_id: str) -> dict[str, Any]:
    """``GET /v1/responses/{id}``: a stored response's body."""
    found = state.responses.body(response_id)
    if found is None:
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return found


def delete(state: ServerState, response_id: str) -> dict[str, Any]:
    """``DELETE /v1/responses/{id}``."""
    if not state.responses.delete(response_id):
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}
