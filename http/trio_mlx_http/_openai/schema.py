"""Request bodies in, validated values out; a bad field raises InvalidRequest naming it.

Hand-written rather than generated: OpenAI's request shapes are loose (a
``prompt`` may be a string, a list of strings or token ids; message content a
string or a list of parts), clients send fields we do not know (ignored), and
every rejection must name the field. Sampling values are checked by
:class:`trio_mlx.SamplingParams` itself, so each range lives in one place.

Every field is honoured or refused (``design/http.md``, "Request fields"):
the tables below name what each endpoint honours, what cannot change the
output and is ignored, and what is refused with 400 ``unsupported_parameter``;
a field in none of them is refused too (it might change the output).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import attrs

from trio_mlx import InvalidRequest, SamplingParams
from trio_mlx_http._common.fields import get_field
from trio_mlx_http._common.images import ImageRef, check_detail, image_part, image_url
from trio_mlx_http._common.structured import ToolChoice, parse_response_format, parse_tool_choice
from trio_mlx_http._settings import Settings

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "EFFORTS",
    "IGNORED_FIELDS",
    "UNSUPPORTED_FIELDS",
    "AdapterMount",
    "GenerationRequest",
    "Prompt",
    "TokenizeRequest",
    "chat_messages",
    "parse_adapter_mount",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_json",
    "parse_tokenize",
    "sampling_params",
]

#: What the engine accepts as a prompt: text, token ids, or chat messages.
Prompt = str | list[int] | list[dict[str, Any]]

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
#: Sampling fields copied as they are from the body to SamplingParams.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "xtc_probability",
    "xtc_threshold",
    "kv_bits",
    "kv_group_size",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
)
#: OpenAI's limit on temperature (the engine itself accepts more).
MAX_TEMPERATURE = 2.0

_COMMON_FIELDS = frozenset(
    {
        "model",
        "n",
        "stream",
        "stream_options",
        "max_tokens",
        "adapter",
        "response_format",
        *_SAMPLING_FIELDS,
    }
)
#: What ``/v1/chat/completions`` honours.
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "modalities",
    "reasoning_effort",
    "verbosity",
}
#: What ``/v1/completions`` honours.
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
#: Fields that cannot change the output (bookkeeping, caching and latency hints): ignored.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "prediction",
    }
)
#: Fields known from OpenAI's (or vLLM's) API that this server does not support, and why.
UNSUPPORTED_FIELDS = {
    "audio": "audio output is not supported",
    "functions": "the deprecated functions API is not supported; send tools",
    "function_call": "the deprecated functions API is not supported; send tool_choice",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "prompt_logprobs": "prompt log-probabilities are not computed",
    "guided_json": "send response_format",
    "guided_regex": "regex-guided decoding is not supported",
    "guided_choice": "choice-guided decoding is not supported",
    "guided_grammar": "grammar-guided decoding is not supported",
}


@attrs.frozen
class GenerationRequest:
    """A validated chat or text completion request."""

    #: The ``model`` the client named, if any (checked against the served ids later).
    model: str | None
    #: One prompt for chat; one per prompt for ``/v1/completions`` (OpenAI's batch form).
    prompts: tuple[Prompt, ...]
    params: SamplingParams
    #: Choices per prompt.
    n: int
    stream: bool
    include_usage: bool
    #: Tool definitions for the chat template; None when there are none or tool_choice is "none".
    tools: list[dict[str, Any]] | None
    #: Chat: extra arguments for the chat template (server default, then the request's).
    chat_template_kwargs: dict[str, Any] | None = None
    #: Chat: passed to a chat template that takes it (gpt-oss's); else refused.
    reasoning_effort: str | None = None
    #: Messages: ``thinking.budget_tokens``, enforced where the model has reasoning markers.
    reasoning_budget: int | None = None
    #: Chat: False keeps only the first tool call of a reply.
    parallel_tool_calls: bool = True
    #: Completions: the prompt text (and with logprobs, its log-probabilities) precedes
    #: each choice's text.
    echo: bool = False
    #: Completions: ``echo`` with ``max_tokens: 0``: the prompt alone, nothing generated.
    prompt_only: bool = False
    #: Completions: candidates generated per prompt, of which the ``n`` most likely are returned.
    best_of: int | None = None
    #: Completions: the text after the insertion point (fill-in-the-middle).
    suffix: str | None = None
    #: The request's ``tool_choice``; "required" or a named function is enforced.
    tool_choice: ToolChoice = attrs.field(factory=lambda: ToolChoice("auto"))


@attrs.frozen
class TokenizeRequest:
    """``POST /tokenize``: text or chat messages."""

    prompt: Prompt
    tools: list[dict[str, Any]] | None
    #: Chat template arguments, as a chat completion would render with them.
    chat_template_kwargs: dict[str, Any] | None = None


@attrs.frozen
class AdapterMount:
    """``POST /v1/adapters``: a name and a path inside ``--adapter-dir``."""

    name: str
    path: str


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def parse_json(data: bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object.

    Each object goes through a Python-level hook: ``json.loads`` alone holds the
    GIL for the whole parse (63-118 ms for 40,000 tool calls, measured), and the
    hook's bytecode lets other threads, the event loop's among them, take it
    between objects (longest hold then 14-23 ms), at no measurable cost.
    """
    try:
        body = json.loads(data, object_pairs_hook=_object)
    except (ValueError, RecursionError) as error:
        raise InvalidRequest(
            f"the request body is not valid JSON: {error}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    return body


def _int_in(body: Mapping[str, Any], name: str, low: int, high: int, default: int) -> int:
    value = get_field(body, name, int, "an integer")
    if value is None:
        return default
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be within [{low}, {high}], not {value}", param=name)
    return int(value)


def _check_fields(body: Mapping[str, Any], honoured: frozenset[str]) -> None:
    """Refuse every field that is neither honoured nor harmless (``null`` is absent)."""
    for name, value in body.items():
        if value is None or name in honoured or name in IGNORED_FIELDS:
            continue
        reason = UNSUPPORTED_FIELDS.get(name)
        if reason is None:
            message = (
                f"unknown field {name!r:.80}: the server does not support it "
                "(it is not ignored, since it might change the output)"
            )
        else:
            message = f"{name} is not supported: {reason}"
        raise InvalidRequest(message, param=str(name)[:80], code="unsupported_parameter")


def sampling_params(
    body: Mapping[str, Any], settings: Settings, extra: dict[str, Any], renames: dict[str, str]
) -> SamplingParams:
    """Build SamplingParams from the body, the server defaults and ``extra``.

    ``renames`` maps a SamplingParams field to the request field a client sent,
    so the error names what the client wrote.
    """
    kw: dict[str, Any] = {
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "min_p": settings.min_p,
        "kv_bits": settings.kv_bits,
        "kv_group_size": settings.kv_group_size,
    }
    kw.update({name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None})
    temperature = kw["temperature"]
    if isinstance(temperature, int | float) and temperature > MAX_TEMPERATURE:
        raise InvalidRequest(
            f"temperature must be <= {MAX_TEMPERATURE}, not {temperature!r}", param="temperature"
        )
    kw.update(extra)
    try:
        return SamplingParams(**kw)
    except InvalidRequest as error:
        if error.param in renames:
            param = renames[error.param]
            message = error.message.replace(error.param, param, 1)
            raise InvalidRequest(message, param=param, code=error.code) from None
        raise


def _max_tokens(body: Mapping[str, Any], settings: Settings) -> tuple[Any, str]:
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return body[name], name
    return settings.max_tokens, "max_tokens"


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(get_field(body, "stream", bool, "a boolean"))
    options = get_field(body, "stream_options", dict, "an object")
    include_usage = False
    if options is not None:
        for key, value in options.items():
            # include_obfuscation pads OpenAI's chunks; this server sends no padding.
            if value is not None and key not in ("include_usage", "include_obfuscation"):
                raise InvalidRequest(
                    f"stream_options.{key:.80} is not supported",
                    param="stream_options",
                    code="unsupported_parameter",
                )
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise InvalidRequest(
                "stream_options.include_usage must be a boolean", param="stream_options"
            )
        include_usage = bool(usage)
    return stream, include_usage


def _common(body: Mapping[str, Any], settings: Settings) -> tuple[str | None, int, str | None]:
    model = get_field(body, "model", str, "a string")
    get_field(body, "user", str, "a string")
    get_field(body, "metadata", dict, "an object")
    n = _int_in(body, "n", 1, settings.max_choices, 1)
    adapter = get_field(body, "adapter", str, "a string")
    return model, n, adapter


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Text, or (with an image among the parts) a list of text and image parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(part, str) or (kind == "text" and isinstance(part.get("text"), str)):
                text = part if isinstance(part, str) else part["text"]
                if parts and parts[-1]["type"] == "text":
                    parts[-1] = {"type": "text", "text": parts[-1]["text"] + text}
                else:
                    parts.append({"type": "text", "text": text})
            elif kind == "image_url":
                url = part.get("image_url")
                if isinstance(url, dict):
                    check_detail(url.get("detail"), f"{where}[{i}].image_url.detail")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise InvalidRequest(
                        f"{where}[{i}] needs image_url.url (a data: or http(s) URL)",
                        param=where,
                    )
                parts.append(image_part(image_url(url, f"{where}[{i}]")))
            elif kind == "image" and isinstance(part.get("image"), ImageRef):
                parts.append(part)  # an image another API's parser read
            else:
                raise InvalidRequest(
                    f"{where} parts must be {{'type': 'text', 'text': ...}} or "
                    "{'type': 'image_url', 'image_url': {'url': ...}}",
                    param=where,
                )
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise InvalidRequest(f"{where} must be a string or a list of content parts", param=where)


def _tool_calls_for_template(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list", param=where)
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{where} entries need a function with a name", param=where)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            # Chat templates expect the arguments as a mapping, as mlx_lm.server does.
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def chat_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise InvalidRequest("messages must be a list of messages", param="messages")
    if not value:
        raise InvalidRequest("messages must not be empty", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"{where}.role must be one of {sorted(_ROLES)}, not {role!r:.40}",
                param=f"{where}.role",
            )
        clean: dict[str, Any] = {"role": role}
        clean["content"] = _content(message.get("content"), f"{where}.content")
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                clean[key] = message[key]
        if message.get("tool_calls"):
            clean["tool_calls"] = _tool_calls_for_template(
                message["tool_calls"], f"{where}.tool_calls"
            )
        out.append(clean)
    return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = get_field(body, "tools", list, "a list of tools")
    choice = parse_tool_choice(body)
    if not tools or choice.mode == "none":
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise InvalidRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools[{i}]",
            )
    return list(tools)


def _template_kwargs(body: Mapping[str, Any], settings: Settings) -> dict[str, Any] | None:
    kwargs = get_field(body, "chat_template_kwargs", dict, "an object")
    merged = {**settings.chat_template_args, **(kwargs or {})}
    return merged or None


#: ``reasoning_effort`` values (chat's; the Responses API's ``reasoning.effort``).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _reasoning_effort(body: Mapping[str, Any]) -> str | None:
    effort: str | None = get_field(body, "reasoning_effort", str, "a string")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}", param="reasoning_effort"
        )
    return effort


_VERBOSITIES = ("low", "medium", "high")


def _verbosity(body: Mapping[str, Any]) -> None:
    """``verbosity``: accepted (a hint no template reads; design/http.md), its value checked."""
    verbosity = get_field(body, "verbosity", str, "a string")
    if verbosity is not None and verbosity not in _VERBOSITIES:
        raise InvalidRequest(
            f"verbosity must be one of {', '.join(_VERBOSITIES)}", param="verbosity"
        )


def _modalities(body: Mapping[str, Any]) -> None:
    modalities = get_field(body, "modalities", list, "a list")
    if modalities is not None and any(m != "text" for m in modalities):
        raise InvalidRequest(
            "only the 'text' modality is supported",
            param="modalities",
            code="unsupported_parameter",
        )


def parse_chat(body: Mapping[str, Any], settings: Settings) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body."""
    _check_fields(body, CHAT_FIELDS)
    _modalities(body)
    _verbosity(body)
    model, n, adapter = _common(body, settings)
    messages = chat_messages(body.get("messages"))
    stream, include_usage = _stream(body)
    logprobs = get_field(body, "logprobs", bool, "a boolean")
    top = get_field(body, "top_logprobs", int, "an integer")
    if top and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    max_tokens, max_name = _max_tokens(body, settings)
    extra: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": bool(logprobs)}
    if top is not None:
        extra["top_logprobs"] = top
    if adapter is not None:
        extra["adapter"] = adapter
    extra.update(parse_response_format(body))
    renames = {"max_tokens": max_name, "json_schema": "response_format"}
    params = sampling_params(body, settings, extra, renames)
    return GenerationRequest(
        model=model,
        prompts=(messages,),
        params=params,
        n=n,
        stream=stream,
        include_usage=include_usage,
        tools=_tools(body),
        chat_template_kwargs=_template_kwargs(body, settings),
        reasoning_effort=_reasoning_effort(body),
        parallel_tool_calls=get_field(body, "parallel_tool_calls", bool, "a boolean") is not False,
        tool_choice=parse_tool_choice(body),
    )


def _token_ids(value: list[Any], param: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise InvalidRequest(f"{param} token ids must be non-negative integers", param=param)
    return list(value)


def _prompts(value: Any, limit: int) -> tuple[Prompt, ...]:
    if isinstance(value, str):
        prompts: list[Prompt] = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        prompts = [_token_ids(p, "prompt") for p in value]
    elif isinstance(value, list) and value:
        prompts = [_token_ids(value, "prompt")]
    elif value is None:
        raise InvalidRequest("prompt is required", param="prompt")
    elif isinstance(value, list):
        raise InvalidRequest("prompt must not be empty", param="prompt")
    else:
        raise InvalidRequest(
            "prompt must be a string, a list of strings, or token ids", param="prompt"
        )
    if len(prompts) > limit:
        raise InvalidRequest(f"at most {limit} prompts per request", param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise InvalidRequest("prompt must not be empty", param="prompt")
    return tuple(prompts)


def parse_completion(body: Mapping[str, Any], settings: Settings) -> GenerationRequest:
    """Validate a ``/v1/completions`` body."""
    _check_fields(body, COMPLETION_FIELDS)
    model, n, adapter = _common(body, settings)
    best_of = get_field(body, "best_of", int, "an integer")
    if best_of is not None and best_of < n:
        raise InvalidRequest(f"best_of must be >= n ({n}), not {best_of}", param="best_of")
    echo = bool(get_field(body, "echo", bool, "a boolean"))
    suffix = get_field(body, "suffix", str, "a string")
    prompts = _prompts(body.get("prompt"), settings.max_choices)
    if len(prompts) * n > settings.max_choices:
        raise InvalidRequest(f"prompts times n may be at most {settings.max_choices}", param="n")
    stream, include_usage = _stream(body)
    best_of = n if best_of is None else best_of
    if best_of > n and stream:
        raise InvalidRequest(
            "best_of > n cannot stream (choices are ranked at the end)", param="best_of"
        )
    if len(prompts) * best_of > settings.max_choices:
        raise InvalidRequest(
            f"prompts times best_of may be at most {settings.max_choices}", param="best_of"
        )
    # The legacy API's logprobs is the number of alternatives per token.
    top = get_field(body, "logprobs", int, "an integer")
    max_tokens, max_name = _max_tokens(body, settings)
    # OpenAI's way to score a text: echo it with max_tokens 0 (nothing is generated).
    prompt_only = echo and max_tokens == 0 and not isinstance(max_tokens, bool)
    if prompt_only:
        if stream:
            raise InvalidRequest(
                "max_tokens 0 (echo the prompt only) cannot stream", param="max_tokens"
            )
        max_tokens = 1
    extra: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": top is not None}
    if top is not None:
        extra["top_logprobs"] = top
    if adapter is not None:
        extra["adapter"] = adapter
    extra.update(parse_response_format(body))
    renames = {"max_tokens": max_name, "top_logprobs": "logprobs", "json_schema": "response_format"}
    params = sampling_params(body, settings, extra, renames)
    return GenerationRequest(
        model=model,
        prompts=prompts,
        params=params,
        n=n,
        stream=stream,
        include_usage=include_usage,
        tools=None,
        echo=echo,
        prompt_only=prompt_only,
        best_of=best_of,
        suffix=suffix,
    )


def parse_tokenize(body: Mapping[str, Any], settings: Settings | None = None) -> TokenizeRequest:
    """Validate a ``/tokenize`` body: ``prompt`` (text) or ``messages``."""
    if body.get("messages") is not None:
        return TokenizeRequest(
            prompt=chat_messages(body["messages"]),
            tools=_tools(body),
            chat_template_kwargs=_template_kwargs(body, settings or Settings()),
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string (or send messages)", param="prompt")
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    return TokenizeRequest(prompt=prompt, tools=None)


def parse_detokenize(body: Mapping[str, Any], vocab_size: int) -> list[int]:
    """Validate a ``/detokenize`` body: ``tokens``, ids below ``vocab_size``."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidRequest("tokens must be a list of token ids", param="tokens")
    ids = _token_ids(tokens, "tokens")
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidRequest(
            f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", param="tokens"
        )
    return ids


def parse_adapter_mount(body: Mapping[str, Any]) -> AdapterMount:
    """Validate a ``POST /v1/adapters`` body (the path is checked against the folder later)."""
    name = body.get("name")
    path = body.get("path")
    if not isinstance(name, str) or not name or len(name) > 128:
        raise InvalidRequest("name must be a non-empty string", param="name")
    if not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise InvalidRequest("name may hold only letters, digits, '-', '_' and '.'", param="name")
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InvalidRequest("path must be a non-empty string", param="path")
    return AdapterMount(name=name, path=path)
