"""``POST /v1/responses`` request bodies in, validated :class:`ResponsesRequest` out.

The body becomes chat messages (``instructions`` first, then the stored
conversation of ``previous_response_id``, then ``input``) and a
:class:`GenerationRequest`. Every field is honoured, ignored because it cannot
change the output (:data:`IGNORED`), or refused with 400
``unsupported_parameter``: a known one unless it holds its default
(:data:`REFUSED`), an unknown one always; design/http.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trio_mlx import InvalidRequest
from trio_mlx_http._common.fields import (
    check_fields,
    get_field,
    joined_text,
    never,
    unsupported,
)
from trio_mlx_http._common.images import ImageRef, check_detail, image_url, joined_content
from trio_mlx_http._common.structured import ToolChoice, parse_response_format
from trio_mlx_http._openai.schema import EFFORTS, GenerationRequest, chat_messages, sampling_params
from trio_mlx_http._responses.store import ResponseStore
from trio_mlx_http._settings import Settings

__all__ = ["HONOURED", "IGNORED", "REFUSED", "ResponsesRequest", "parse_responses"]

#: Fields honoured (design/http.md says how).
HONOURED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        "reasoning",
        "include",
        "truncation",
    }
)

#: Fields that cannot change the output: accepted and ignored.
IGNORED = frozenset(
    {
        "user",
        "safety_identifier",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "stream_options",  # only include_obfuscation, which pads events
    }
)


#: Known fields the server does not support: each accepts only its default
#: (or null); any other value is 400 ``unsupported_parameter``.
REFUSED: dict[str, Callable[[Any], bool]] = {
    "background": lambda v: v is False,
    "conversation": never,
    "prompt": never,
    "top_logprobs": lambda v: v == 0,
    "max_tool_calls": never,
    "context_management": never,
    "moderation": never,
    "image": never,
    "access_programs": never,
    "background_options": never,
}

#: ``include`` values accepted: ``reasoning.encrypted_content`` (nothing is
#: encrypted: reasoning items come back whole, ``encrypted_content`` null) and
#: the outputs of tools this server never runs (so there is nothing to add).
_INCLUDES = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
_SUMMARIES = ("auto", "concise", "detailed", "none")
_VERBOSITIES = ("low", "medium", "high")


@attrs.frozen
class ResponsesRequest:
    """A validated Responses request: the engine request and what the response echoes."""

    generation: GenerationRequest
    #: The messages of this turn's conversation, without instructions (what gets stored).
    conversation: tuple[dict[str, Any], ...]
    instructions: str | None
    #: The tools as the client sent them (echoed in the response).
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    max_output_tokens: int | None
    temperature: float
    top_p: float
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    #: Echoed: ``truncation``, ``reasoning`` and ``text`` as the response reports them.
    truncation: str = "disabled"
    reasoning: dict[str, Any] = attrs.field(factory=lambda: {"effort": None, "summary": None})
    text: dict[str, Any] = attrs.field(factory=lambda: {"format": {"type": "text"}})


def _text_part(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
        text = part.get("text")
        if isinstance(text, str):
            return text
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequest(
        f"{where} must be text parts ({{'type': 'input_text', 'text': ...}}); "
        f"{kind!r} content is not supported",
        param=where,
    )


def _text(content: Any, where: str) -> str:
    """A string, or the joined text of a list of text parts."""
    return joined_text(content, where, _text_part, "text parts")


def _image_part(part: Any, where: str) -> ImageRef | None:
    """An ``input_image`` part's image (``image_url``: a data: or http(s) URL)."""
    if not isinstance(part, dict) or part.get("type") != "input_image":
        return None
    if part.get("file_id") is not None:
        raise InvalidRequest(
            f"{where}.file_id is not supported (no file store); send image_url",
            param=f"{where}.file_id",
        )
    check_detail(part.get("detail"), f"{where}.detail")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise InvalidRequest(f"{where} needs image_url (a data: or http(s) URL)", param=where)
    return image_url(url, where)


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _input_item(item: Any, where: str, out: list[dict[str, Any]]) -> None:
    """Append the chat message(s) for one input item to ``out``."""
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidRequest(
                f"{where}.role must be 'user', 'assistant', 'system' or 'developer'",
                param=f"{where}.role",
            )
        content = joined_content(
            item.get("content"), f"{where}.content", _text_part, _image_part, "text parts"
        )
        out.append({"role": role, "content": content})
    elif kind == "function_call":
        call = _function_call(item, where)
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":
            # Parallel calls, or text then calls: one assistant turn, as chat templates expect.
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "reasoning":
        # Earlier reasoning is not part of the prompt: chat templates drop it from
        # past turns, and this server renders every turn with the chat template.
        return
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
        output = _text(item.get("output"), f"{where}.output")
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    else:
        raise InvalidRequest(
            f"{where}.type {kind!r} is not supported; send 'message', 'function_call', "
            "'function_call_output' or 'reasoning' items",
            param=f"{where}.type",
        )


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        _input_item(item, f"input[{i}]", out)
    return out


def _tool_choice(body: Mapping[str, Any]) -> tuple[str | dict[str, Any], ToolChoice]:
    """``tool_choice`` as sent (echoed in the response) and parsed.

    "required" and a named function (``{"type": "function", "name": ...}``) are
    enforced with chat's tool-call grammar (see ``_generation._enforce_tool_choice``).
    """
    parallel = get_field(body, "parallel_tool_calls", bool, "a boolean") is not False
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if choice in ("auto", "none", "required"):
        return choice, ToolChoice(choice, parallel=parallel)
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return dict(choice), ToolChoice("function", choice["name"], parallel=parallel)
    raise InvalidRequest(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def _tools(
    body: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str | dict[str, Any], ToolChoice]:
    """(tools as sent, tools in chat-template form, tool_choice as sent and parsed)."""
    tools = get_field(body, "tools", list, "a list of tools") or []
    choice, parsed = _tool_choice(body)
    chat = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(
                f"{where}: only function tools are supported, not {kind!r}", param=where
            )
        if not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"{where}.name must be a string", param=f"{where}.name")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        chat.append({"type": "function", "function": function})
    return list(tools), chat if choice != "none" else [], choice, parsed


def _text_format(body: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords for ``text.format`` (empty for plain text).

    The Responses API flattens chat's ``response_format.json_schema`` into the
    format object itself (``{"type": "json_schema", "name", "schema", "strict"}``);
    it is rewritten to chat's shape so that one parser checks both.
    """
    text = get_field(body, "text", dict, "an object")
    if text is None:
        return {}
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in _VERBOSITIES:
        raise InvalidRequest(
            f"text.verbosity must be one of {', '.join(_VERBOSITIES)}", param="text.verbosity"
        )
    fmt = text.get("format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return parse_response_format({"response_format": {"type": "json_object"}})
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        try:
            return parse_response_format(
                {"response_format": {"type": "json_schema", "json_schema": spec}}
            )
        except InvalidRequest as error:
            raise type(error)(
                str(error).replace("response_format.json_schema", "text.format"),
                param="text.format",
                code=error.code,
            ) from None
    raise InvalidRequest(
        "text.format.type must be 'text', 'json_schema' or 'json_object'", param="text.format"
    )


def _reasoning(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``reasoning``: ``effort`` (on the model's reasoning switch) and ``summary``.

    A summary is accepted, and none is written: the reasoning item carries the
    whole reasoning text and an empty ``summary``.
    """
    reasoning = get_field(body, "reasoning", dict, "an object")
    if reasoning is None:
        return None, None
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary"):
            raise unsupported(f"reasoning.{key}")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary is not None and summary not in _SUMMARIES:
        raise InvalidRequest(
            f"reasoning.summary must be one of {', '.join(_SUMMARIES)}", param="reasoning.summary"
        )
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning.effort"
        )
    return effort, summary


def _verbosity(body: Mapping[str, Any]) -> str:
    text = body.get("text")
    verbosity = text.get("verbosity") if isinstance(text, dict) else None
    return verbosity if isinstance(verbosity, str) else "medium"


def _metadata(body: Mapping[str, Any]) -> dict[str, str]:
    """OpenAI's metadata rules: at most 16 pairs, keys up to 64 and values up to 512 characters."""
    metadata = get_field(body, "metadata", dict, "an object") or {}
    if len(metadata) > 16:
        raise InvalidRequest("metadata may hold at most 16 pairs", param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise InvalidRequest(
                "metadata maps keys of up to 64 characters to strings of up to 512",
                param="metadata",
            )
        try:
            (key + value).encode()
        except UnicodeEncodeError:
            raise InvalidRequest("metadata is not valid Unicode", param="metadata") from None
    return dict(metadata)


def _include(body: Mapping[str, Any]) -> None:
    include = get_field(body, "include", list, "a list of strings") or []
    for value in include:
        if value == "message.output_text.logprobs":
            raise unsupported("include", "log-probabilities are not returned here")
        if value not in _INCLUDES:
            raise InvalidRequest(f"include: unknown value {value!r:.80}", param="include")


def _truncation(body: Mapping[str, Any]) -> str:
    """``truncation``: "disabled" or "auto" (echoed; nothing is ever dropped, see design/http.md)."""
    value = get_field(body, "truncation", str, "a string")
    if value not in (None, "auto", "disabled"):
        raise InvalidRequest("truncation must be 'auto' or 'disabled'", param="truncation")
    return value or "disabled"


def _sampling_values(body: Mapping[str, Any], settings: Settings) -> tuple[Any, Any, Any]:
    temperature = get_field(body, "temperature", (int, float), "a number")
    if temperature is not None and not 0 <= temperature <= 2:
        raise InvalidRequest(
            f"temperature must be within [0, 2], not {temperature}", param="temperature"
        )
    top_p = get_field(body, "top_p", (int, float), "a number")
    max_output = body.get("max_output_tokens")
    return (
        settings.temperature if temperature is None else temperature,
        settings.top_p if top_p is None else top_p,
        max_output,
    )


def parse_responses(
    body: Mapping[str, Any], settings: Settings, store: ResponseStore
) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body (``previous_response_id`` is looked up in ``store``)."""
    check_fields(body, HONOURED, IGNORED, REFUSED)
    _include(body)
    truncation = _truncation(body)
    effort, summary = _reasoning(body)
    structured = _text_format(body)
    model = get_field(body, "model", str, "a string")
    instructions = get_field(body, "instructions", str, "a string")
    metadata = _metadata(body)
    keep = get_field(body, "store", bool, "a boolean")
    stream = bool(get_field(body, "stream", bool, "a boolean"))
    previous_id = get_field(body, "previous_response_id", str, "a string")
    earlier: tuple[dict[str, Any], ...] = ()
    if previous_id is not None:
        stored = store.get(previous_id)
        if stored is None:
            raise InvalidRequest(
                f"previous response {previous_id!r} is not stored here (it was not stored, or "
                f"the store, which keeps the last {store.capacity} responses up to "
                f"{store.max_bytes // (1 << 20)} MiB, forgot it); "
                "send the whole conversation in input instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        earlier = stored.conversation
    conversation = (*earlier, *_input(body.get("input")))
    tools, chat_tools, choice, parsed_choice = _tools(body)
    temperature, top_p, max_output = _sampling_values(body, settings)
    params = sampling_params(
        {"temperature": temperature, "top_p": top_p},
        settings,
        {"max_tokens": settings.max_tokens if max_output is None else max_output, **structured},
        {"max_tokens": "max_output_tokens"},
    )
    system = [{"role": "system", "content": instructions}] if instructions is not None else []
    messages = chat_messages([*system, *conversation])
    generation = GenerationRequest(
        model=model,
        prompts=(messages,),
        params=params,
        n=1,
        stream=stream,
        include_usage=False,
        tools=chat_tools or None,
        chat_template_kwargs=dict(settings.chat_template_args) or None,
        reasoning_effort=effort,
        parallel_tool_calls=parsed_choice.parallel,
        tool_choice=parsed_choice,
    )
    return ResponsesRequest(
        generation=generation,
        conversation=conversation,
        instructions=instructions,
        tools=tools,
        tool_choice=choice,
        max_output_tokens=max_output,
        temperature=params.temperature,
        top_p=params.top_p,
        store=True if keep is None else keep,
        previous_response_id=previous_id,
        metadata=metadata,
        truncation=truncation,
        reasoning={"effort": effort, "summary": summary},
        text={"format": {"type": "text"}, "verbosity": _verbosity(body)},
    )
