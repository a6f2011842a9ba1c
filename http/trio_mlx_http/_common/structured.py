"""``response_format`` and ``tool_choice``: what a request asks the output to look like.

Both become one engine parameter: ``response_format`` a
:attr:`trio_mlx.SamplingParams.json_schema`, an enforced ``tool_choice``
("required" or a named function) a :attr:`~trio_mlx.SamplingParams.grammar`
that writes the model's own tool-call format, so the usual
:class:`~trio_mlx_http._common.tools.ToolCallExtractor` turns the text into
``tool_calls``. "auto" leaves the model free; "none" drops the tools from the
prompt and leaves no call to extract.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from trio_mlx import InvalidGrammar, InvalidRequest, SamplingParams

__all__ = [
    "COMPACT_JSON",
    "JSON_TOOL_PARSERS",
    "ToolChoice",
    "after_reasoning",
    "grammar_param",
    "parse_response_format",
    "parse_tool_choice",
    "tool_call_grammar",
]

#: mlx-lm tool parsers whose call is ``START {"name": ..., "arguments": {...}} END``.
JSON_TOOL_PARSERS = frozenset({"json_tools"})

#: Compact JSON inside a Lark ``%json`` rule, as the engine writes JSON schemas.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def parse_response_format(body: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords for the body's ``response_format`` (empty for text)."""
    value = body.get("response_format")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest("response_format must be an object", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind != "json_schema":
        raise InvalidRequest(
            "response_format.type must be 'text', 'json_object' or 'json_schema', "
            f"not {kind!r:.40}",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, Mapping):
        raise InvalidRequest(f"{where} must be an object with a name and a schema", param=where)
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise InvalidRequest(f"{where}.name must be a string of 1-64 characters", param=where)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{where}.strict must be a boolean", param=where)
    schema = spec.get("schema")
    if schema is None:
        # OpenAI's schema is optional: then any JSON object.
        return {"json_schema": {"type": "object"}}
    if not isinstance(schema, Mapping):
        raise InvalidGrammar(f"{where}.schema must be a JSON schema object", param=where)
    return {"json_schema": dict(schema)}


@attrs.frozen
class ToolChoice:
    """A parsed ``tool_choice``."""

    #: "auto", "none", "required", or "function" (a named function).
    mode: str
    #: The function's name when ``mode`` is "function".
    name: str | None = None
    #: ``parallel_tool_calls``: more than one call allowed (OpenAI's default).
    parallel: bool = True

    @property
    def enforced(self) -> bool:
        """Whether the output must be tool calls (required or a named function)."""
        return self.mode in ("required", "function")


def parse_tool_choice(body: Mapping[str, Any]) -> ToolChoice:
    """The body's ``tool_choice`` ("auto" when absent) and ``parallel_tool_calls``."""
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    value = body.get("tool_choice")
    if value is None:
        return ToolChoice("auto", parallel=parallel)
    if value in ("none", "auto", "required"):
        return ToolChoice(value, parallel=parallel)
    function = value.get("function") if isinstance(value, Mapping) else None
    if (
        isinstance(value, Mapping)
        and value.get("type", "function") == "function"
        and isinstance(function, Mapping)
        and isinstance(function.get("name"), str)
    ):
        return ToolChoice("function", function["name"], parallel=parallel)
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def _literal(tokenizer: Any, text: str) -> str:
    """A Lark item for a marker: its token id when it is one token, else the text.

    llguidance refuses to match a special token through text (and counts more
    added tokens as special than Hugging Face marks), so a one-token marker is
    named by id (``<[id]>``).
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_call_grammar(
    tools: list[dict[str, Any]],
    choice: ToolChoice,
    tokenizer: Any,
    *,
    parallel: bool = True,
    reasoning_end: str | None = None,
) -> str:
    """A Lark grammar (llguidance's dialect) for calls to ``tools`` in the model's format.

    Each call is the model's start marker, ``{"name": ..., "arguments": ...}``
    with the arguments constrained to that tool's ``parameters`` schema, and
    its end marker. With ``parallel`` one or more calls, else exactly one.
    With ``reasoning_end`` (the prompt opened a reasoning block) free text up to
    that marker comes first.
    """
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    kind = module.rsplit(".", 1)[-1]
    if kind not in JSON_TOOL_PARSERS:
        raise InvalidRequest(
            f"tool_choice {choice.mode!r} cannot be enforced for this model's tool-call "
            f"format ({kind or 'none'}); use 'auto'",
            param="tool_choice",
            code="tool_choice_unsupported",
        )
    chosen = [t["function"] for t in tools]
    if choice.mode == "function":
        chosen = [f for f in chosen if f.get("name") == choice.name]
        if not chosen:
            raise InvalidRequest(
                f"tool_choice names {choice.name!r}, which is not among the tools",
                param="tool_choice",
            )
    options = []
    for function in chosen:
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise InvalidGrammar(
                f"the parameters of tool {function['name']!r} must be a JSON schema object",
                param="tools",
            )
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    body = options[0] if len(options) == 1 else {"anyOf": options}
    # Compact JSON, as the engine writes JSON schemas (see trio_mlx._lanes.structured).
    body = {"x-guidance": COMPACT_JSON, **body}
    start = _literal(tokenizer, tokenizer.tool_call_start)
    end = _literal(tokenizer, tokenizer.tool_call_end)
    calls = 'call ("\\n" call)*' if parallel else "call"
    rules = [
        f"start: {calls}" if reasoning_end is None else f"start: think {calls}",
        f'call: {start} "\\n" body "\\n" {end}',
        f"body: %json {json.dumps(body)}",
    ]
    if reasoning_end is not None:
        rules.append(_think_rule(tokenizer, reasoning_end))
    return "\n".join(rules)


def _think_rule(tokenizer: Any, end: str) -> str:
    """A Lark rule ``think``: any text, then the reasoning end marker."""
    literal = _literal(tokenizer, end)
    if literal.startswith("<["):  # one token: any text, then that token
        return f"think: /(?s:.*)/ {literal}"
    pattern = re.escape(end).replace("/", "\\/")
    return f"think[lazy]: /(?s:.*){pattern}/"


def after_reasoning(params: SamplingParams, tokenizer: Any, end: str) -> SamplingParams:
    """``params``' JSON schema as a grammar that lets a reasoning block close first.

    For a prompt that opens a reasoning block (``<think>``): the model reasons
    freely up to ``end``, then writes the constrained value, so the value lands
    in ``content`` and the reasoning in ``reasoning_content``.
    """
    if params.json_schema is None:
        return params
    schema = {"x-guidance": COMPACT_JSON, **params.json_schema}
    grammar = "\n".join(
        ["start: think body", _think_rule(tokenizer, end), f"body: %json {json.dumps(schema)}"]
    )
    return attrs.evolve(params, json_schema=None, grammar=grammar)


def grammar_param(error: InvalidRequest, source: str) -> InvalidRequest:
    """``error`` naming the request field (``source``) a constraint came from.

    The engine names its own parameter (``json_schema``, ``grammar``); an error
    about another field that names the constraint (``stop``) has the name replaced.
    """
    if error.param not in ("json_schema", "regex", "grammar"):
        for name in ("json_schema", "regex", "grammar"):
            if f"with {name}" in error.message:
                message = error.message.replace(f"with {name}", f"with {source}")
                return type(error)(message, param=error.param, code=error.code)
        return error
    message = error.message
    if message.startswith(f"{error.param}: "):
        message = f"{source}: {message[len(error.param or '') + 2 :]}"
    return type(error)(message, param=source, code=error.code)
