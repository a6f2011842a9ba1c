"""``POST /v1/messages``: Anthropic's Messages API over the engine.

``system`` and ``messages`` (text, ``tool_use`` and ``tool_result`` blocks)
become chat messages and run as one turn through :mod:`trio_mlx_http._common.turn`; the renderer
below writes Anthropic's ``message`` object with ``text`` and ``tool_use``
content blocks and, when streaming, its event sequence (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` with the
stop reason and usage, ``message_stop``). Errors on this route use Anthropic's
shape (``_errors.anthropic_error_body``).

Every request field is honoured (:data:`HONOURED`), ignored because it cannot
change the output (:data:`IGNORED`), or refused with 400: a known one unless it
holds its default (:data:`REFUSED`), an unknown one always; design/http.md
lists them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from quart import Response

from trio_mlx import InvalidGrammar, InvalidRequest, TrioMLXError
from trio_mlx_http._common.cache_usage import cache_usage
from trio_mlx_http._common.fields import (
    check_fields,
    get_field,
    joined_text,
    never,
    unsupported,
)
from trio_mlx_http._common.images import ImageRef, image_part, image_url
from trio_mlx_http._common.prepare import prepare
from trio_mlx_http._common.sse import named_event
from trio_mlx_http._common.structured import ToolChoice, grammar_param
from trio_mlx_http._common.tools import ToolCall
from trio_mlx_http._common.turn import Ending, Event, Piece, Thought, run_turn
from trio_mlx_http._errors import anthropic_error_body
from trio_mlx_http._openai.schema import GenerationRequest, chat_messages, sampling_params
from trio_mlx_http._server.state import Access, ServerState
from trio_mlx_http._settings import Settings

__all__ = [
    "HONOURED",
    "IGNORED",
    "REFUSED",
    "MessagesRequest",
    "count_tokens",
    "parse_messages",
    "respond",
]

#: Fields honoured (design/http.md says how).
HONOURED = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
    }
)

#: Fields that cannot change the output: accepted and ignored.
IGNORED = frozenset(
    {
        "metadata",
        "service_tier",
        "cache_control",  # a caching hint; the engine's prompt cache is automatic
        "inference_geo",
        "user_profile_id",
        "workspace_id",
    }
)


#: Known fields the server does not support: each accepts only its default
#: (or null); any other value is 400.
REFUSED: dict[str, Callable[[Any], bool]] = {
    "container": never,
    "context_management": never,
    "mcp_servers": lambda v: v == [],
    "diagnostics": never,
    "speed": never,
}

#: ``thinking.type`` -> the chat template's ``enable_thinking`` (None: the template's default).
_THINKING = {"enabled": True, "disabled": False, "adaptive": None}
#: ``output_config.effort`` values (accepted: see design/http.md).
_EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _block_text(block: Any, where: str) -> str:
    if (
        isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
    ):
        return str(block["text"])
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    raise InvalidRequest(
        f"{where} must be a text block ({{'type': 'text', 'text': ...}}), not {kind!r}",
        param=where,
    )


def _image_block(block: Mapping[str, Any], where: str) -> ImageRef:
    """An ``image`` block's image: a base64 source or a url source."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict) and isinstance(source.get("data"), str):
        return ImageRef(where, data=source["data"])
    if kind == "url" and isinstance(source, dict):
        return image_url(source.get("url"), where)
    raise InvalidRequest(
        f"{where}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} "
        "or {'type': 'url', 'url': ...}",
        param=where,
    )


def _joined(pieces: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's text, or with an image among ``pieces`` its text and image parts."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(p for p in pieces if isinstance(p, str))
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in pieces]


def _text(content: Any, where: str) -> str:
    """A string, or the joined text of a list of text blocks."""
    return joined_text(content, where, _block_text, "text blocks")


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise InvalidRequest(f"{where}.tool_use_id must be a string", param=f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    if block.get("is_error") is True:
        # Chat templates have no error flag on tool results: say it in the text.
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tool_use(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidRequest(f"{where} needs a string id and name", param=where)
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.input must be an object", param=f"{where}.input")
    function = {"name": block["name"], "arguments": arguments}
    return {"id": block["id"], "type": "function", "function": function}


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """The chat message(s) for one Anthropic message."""
    if not isinstance(message, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(
            f"{where}.content must be a string or a list of content blocks",
            param=f"{where}.content",
        )
    results: list[dict[str, Any]] = []
    texts: list[str | dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            # Anthropic leaves earlier turns' thinking out of the context; so do we.
            continue
        elif kind == "image" and role == "user":
            texts.append(image_part(_image_block(block, at)))
        else:
            texts.append(_block_text(block, at))
    out = results
    if texts or calls or not results:
        said: dict[str, Any] = {"role": role, "content": _joined(texts)}
        if calls:
            said["tool_calls"] = calls
        out.append(said)
    return out


def _conversation(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        out.extend(_message(message, f"messages[{i}]"))
    return chat_messages(out)


def _tool_choice(body: Mapping[str, Any]) -> ToolChoice:
    """Anthropic's ``tool_choice`` in chat's terms: "any" is required, "tool" a named one.

    Both are enforced with chat's tool-call grammar (``_generation._enforce_tool_choice``).
    """
    choice = get_field(body, "tool_choice", dict, "an object")
    kind = "auto" if choice is None else choice.get("type")
    parallel = not _one_call(body)
    if kind in ("auto", "none"):
        return ToolChoice(kind, parallel=parallel)
    if kind == "any":
        return ToolChoice("required", parallel=parallel)
    if kind == "tool" and choice is not None and isinstance(choice.get("name"), str):
        return ToolChoice("function", choice["name"], parallel=parallel)
    raise InvalidRequest(
        "tool_choice.type must be 'auto', 'any', 'tool' (with a name) or 'none'",
        param="tool_choice",
    )


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = get_field(body, "tools", list, "a list of tools") or []
    kind = _tool_choice(body).mode
    chat = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type", "custom") != "custom"
            or not isinstance(tool.get("name"), str)
        ):
            raise InvalidRequest(
                f"{where} must be a custom tool {{'name', 'description', 'input_schema'}}; "
                "server tools are not supported",
                param=where,
            )
        function: dict[str, Any] = {"name": tool["name"]}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema", {"type": "object"})
        chat.append({"type": "function", "function": function})
    return chat if chat and kind != "none" else None


def _one_call(body: Mapping[str, Any]) -> bool:
    """``tool_choice.disable_parallel_tool_use``: at most one tool call."""
    choice = body.get("tool_choice")
    flag = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise InvalidRequest(
            "tool_choice.disable_parallel_tool_use must be a boolean",
            param="tool_choice.disable_parallel_tool_use",
        )
    return flag is True


@attrs.frozen
class Thinking:
    """The request's ``thinking``: the template switch, and whether to show the reasoning."""

    #: ``enable_thinking`` for the chat template; None leaves the template's default.
    enable: bool | None = None
    #: ``display: "omitted"``: thinking blocks are sent with empty text.
    omitted: bool = False
    #: ``budget_tokens``: the reasoning ends once it has spent this many tokens.
    budget: int | None = None


def _thinking(body: Mapping[str, Any]) -> Thinking:
    """``thinking``: ``enabled`` (a token budget), ``adaptive`` or ``disabled``.

    The budget must lie below ``max_tokens``, as Anthropic requires; where the
    model has reasoning markers, the reasoning block is ended once it is spent.
    """
    value = get_field(body, "thinking", dict, "an object")
    if value is None:
        return Thinking()
    kind = value.get("type")
    if kind not in _THINKING:
        raise InvalidRequest(
            "thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type"
        )
    for key in value:
        if key not in ("type", "budget_tokens", "display"):
            raise unsupported(f"thinking.{key}")
    budget = value.get("budget_tokens")
    if kind == "enabled":
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise InvalidRequest(
                "thinking.budget_tokens must be a positive integer",
                param="thinking.budget_tokens",
            )
        limit = body.get("max_tokens")
        if isinstance(limit, int) and budget >= limit:
            raise InvalidRequest(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens ({limit})",
                param="thinking.budget_tokens",
            )
    elif budget is not None:
        raise InvalidRequest(
            f"thinking.budget_tokens goes with type 'enabled', not {kind!r}",
            param="thinking.budget_tokens",
        )
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise InvalidRequest(
            "thinking.display must be 'summarized' or 'omitted'", param="thinking.display"
        )
    return Thinking(_THINKING[kind], omitted=display == "omitted", budget=budget)


def _output_config(body: Mapping[str, Any]) -> None:
    """``output_config``: ``effort`` accepted (design/http.md); ``format`` and the rest refused."""
    config = get_field(body, "output_config", dict, "an object") or {}
    for key, value in config.items():
        if value is None:
            continue
        if key != "effort":
            raise unsupported(f"output_config.{key}")
        if value not in _EFFORTS:
            raise InvalidRequest(
                f"output_config.effort must be one of {', '.join(_EFFORTS)}",
                param="output_config.effort",
            )


def _metadata(body: Mapping[str, Any]) -> None:
    metadata = get_field(body, "metadata", dict, "an object") or {}
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("metadata.user_id must be a string", param="metadata.user_id")


@attrs.frozen
class MessagesRequest:
    """A validated Messages request."""

    generation: GenerationRequest
    #: The last message is the assistant's own text: the answer continues it
    #: (Anthropic's "prefill") instead of starting a new turn.
    prefill: bool
    thinking: Thinking = Thinking()


def _is_prefill(body: Mapping[str, Any], conversation: list[dict[str, Any]]) -> bool:
    last = conversation[-1]
    return (
        body["messages"][-1].get("role") == "assistant"
        and last["role"] == "assistant"
        and bool(last["content"])
        and "tool_calls" not in last
    )


def parse_messages(
    body: Mapping[str, Any], settings: Settings, *, counting: bool = False
) -> MessagesRequest:
    """Validate a ``/v1/messages`` body (``counting``: a ``count_tokens`` body, no max_tokens)."""
    check_fields(body, HONOURED, IGNORED, REFUSED)
    _output_config(body)
    _metadata(body)
    thinking = _thinking(body)
    model = get_field(body, "model", str, "a string")
    if counting:
        body = {**body, "max_tokens": 1}
    if body.get("max_tokens") is None:
        raise InvalidRequest("max_tokens is required", param="max_tokens")
    temperature = get_field(body, "temperature", (int, float), "a number")
    if temperature is not None and not 0 <= temperature <= 1:
        raise InvalidRequest(
            f"temperature must be within [0, 1], not {temperature}", param="temperature"
        )
    stops = get_field(body, "stop_sequences", list, "a list of strings")
    sampling = {
        name: body[name] for name in ("temperature", "top_p", "top_k") if body.get(name) is not None
    }
    extra: dict[str, Any] = {"max_tokens": body["max_tokens"]}
    if stops:
        extra["stop"] = stops
    params = sampling_params(sampling, settings, extra, {"stop": "stop_sequences"})
    conversation = _conversation(body)
    generation = GenerationRequest(
        model=model,
        prompts=(conversation,),
        params=params,
        n=1,
        stream=bool(get_field(body, "stream", bool, "a boolean")),
        include_usage=False,
        tools=_tools(body),
        chat_template_kwargs=_template_kwargs(thinking, settings),
        parallel_tool_calls=not _one_call(body),
        tool_choice=_tool_choice(body),
        reasoning_budget=thinking.budget,
    )
    return MessagesRequest(generation, _is_prefill(body, conversation), thinking)


def _template_kwargs(thinking: Thinking, settings: Settings) -> dict[str, Any] | None:
    """The server's chat template arguments, ``enable_thinking`` set by ``thinking``."""
    kwargs = dict(settings.chat_template_args)
    if thinking.enable is not None:
        kwargs["enable_thinking"] = thinking.enable
    return kwargs or None


#: What a stream sends while it has nothing else to say: Anthropic's own ``ping``.
_PING = named_event("ping", {"type": "ping"})


def _usage(prompt_tokens: int, ending: Ending | None) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens the cache neither read nor wrote."""
    if ending is None:  # message_start: the cache's part is known at the end
        return {
            "input_tokens": prompt_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        }
    cache = cache_usage(ending.result)
    return {
        "input_tokens": cache.uncached(prompt_tokens),
        "output_tokens": ending.result.completion_tokens,
        "cache_read_input_tokens": cache.read,
        "cache_creation_input_tokens": cache.written,
    }


def _stop_reason(ending: Ending) -> str:
    if ending.called and ending.result.finish_reason == "stop":
        return "tool_use"
    if ending.result.finish_reason == "length":
        return "max_tokens"
    if ending.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _tool_input(call: ToolCall) -> dict[str, Any]:
    """The call's arguments as the object Anthropic's ``input`` must be."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        value = call.arguments
    return value if isinstance(value, dict) else {"value": value}


def _tool_block(call: ToolCall, *, empty: bool = False) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": {} if empty else _tool_input(call),
    }


@attrs.define(eq=False)
class _Renderer:
    """Anthropic's shapes for one turn."""

    model: str
    #: ``thinking.display: "omitted"``: thinking blocks carry no text.
    omitted: bool = False
    id: str = attrs.field(factory=lambda: f"msg_{uuid.uuid4().hex}")
    #: Index of the next content block, and the kind of the open one ("text", "thinking").
    _blocks: int = attrs.field(default=0, init=False)
    _open: str | None = attrs.field(default=None, init=False)

    def _message(
        self, content: list[dict[str, Any]], ending: Ending | None, input_tokens: int
    ) -> dict[str, Any]:
        usage = _usage(input_tokens, ending)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None if ending is None else _stop_reason(ending),
            "stop_sequence": None if ending is None else ending.stop_sequence,
            "usage": usage,
        }

    def opened(self, prompt_tokens: int) -> list[Event]:
        message = self._message([], None, prompt_tokens)
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        self._blocks += 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]

    def _streamed(self, kind: str, text: str) -> list[Event]:
        """A text or thinking delta, opening its block first if another kind is open."""
        events: list[Event] = []
        if self._open != kind:
            events = self._close()
            self._open = kind
            block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            start = {"type": "content_block_start", "index": self._blocks, "content_block": block}
            events.append(("content_block_start", start))
        delta = {
            "type": "content_block_delta",
            "index": self._blocks,
            "delta": {"type": f"{kind}_delta", kind: text},
        }
        return [*events, ("content_block_delta", delta)]

    def piece(self, piece: Piece) -> list[Event]:
        if isinstance(piece, str):
            return self._streamed("text", piece)
        if isinstance(piece, Thought):
            return self._streamed("thinking", "" if self.omitted else piece.text)
        events = self._close()
        index = self._blocks
        self._blocks += 1
        arguments = json.dumps(_tool_input(piece), ensure_ascii=False)
        return [
            *events,
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": _tool_block(piece, empty=True),
                },
            ),
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": arguments},
                },
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": index}),
        ]

    def closed(self, ending: Ending) -> list[Event]:
        events = self._close()
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(ending), "stop_sequence": ending.stop_sequence},
            "usage": _usage(ending.result.prompt_tokens, ending),
        }
        return [*events, ("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def failed(self, error: TrioMLXError) -> list[Event]:
        return [("error", anthropic_error_body(error))]

    def keepalive(self) -> bytes:
        return _PING

    def whole(self, pieces: Sequence[Piece], ending: Ending) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                content.append(_tool_block(piece))
                continue
            if isinstance(piece, Thought):
                kind, text = "thinking", "" if self.omitted else piece.text
            else:
                kind, text = "text", piece
            if content and content[-1]["type"] == kind:
                content[-1][kind] += text
            else:
                block = {"type": kind, kind: text}
                content.append({**block, "signature": ""} if kind == "thinking" else block)
        return self._message(content, ending, ending.result.prompt_tokens)


async def respond(
    state: ServerState, body: Mapping[str, Any], access: Access
) -> Response | dict[str, Any]:
    """Answer one ``POST /v1/messages``."""
    parsed = parse_messages(body, state.settings)
    omitted = parsed.thinking.omitted
    try:
        return await run_turn(
            state,
            parsed.generation,
            lambda model: _Renderer(model, omitted=omitted),
            access,
            continue_final=parsed.prefill,
        )
    except InvalidGrammar as error:  # the tool-call grammar of a forced tool_choice
        raise grammar_param(error, "tool_choice") from None


async def count_tokens(state: ServerState, body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST /v1/messages/count_tokens``: the prompt's length, tools included."""
    parsed = parse_messages(body, state.settings, counting=True)
    prepared = await prepare(state, parsed.generation, continue_final=parsed.prefill, counting=True)
    return {"input_tokens": len(prepared.prompts[0].tokens)}
