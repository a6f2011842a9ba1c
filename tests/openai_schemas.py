"""JSON Schemas (2020-12) of the OpenAI response objects the server sends, and a checker.

Written for this project from the facts of OpenAI's published API reference
(the OpenAPI document at github.com/openai/openai-openapi, MIT licence):
which fields each object has, their types, which are required, and which may
be null. Nothing of that document is copied here; where it marks a field
``nullable: true`` the schema below allows ``null``. Objects stay open
(extra fields such as ``reasoning_content`` are allowed), as OpenAI's are.

Two deliberate differences, both where OpenAI's own answers differ from its
schema: it streams ``text_completion`` chunks with ``finish_reason: null``
although the schema (shared with the whole response) lists only the three
reasons, and an echoed prompt's first token has ``null`` in ``token_logprobs``
and ``top_logprobs`` (nothing precedes it) although the schema says number and
object. The schemas here allow those nulls.

:class:`SchemaChecker` wraps a live app's ASGI callable and validates every
body and every stream event of the OpenAI endpoints as it is sent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import jsonschema

__all__ = ["SCHEMAS", "SchemaChecker", "schema_for"]

_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


def _const(value: str) -> dict[str, Any]:
    return {"type": "string", "enum": [value]}


_USAGE = _object(
    ["prompt_tokens", "completion_tokens", "total_tokens"],
    prompt_tokens=_INT,
    completion_tokens=_INT,
    total_tokens=_INT,
    prompt_tokens_details=_object([], cached_tokens=_INT, audio_tokens=_INT),
    completion_tokens_details=_object(
        [],
        reasoning_tokens=_INT,
        audio_tokens=_INT,
        accepted_prediction_tokens=_INT,
        rejected_prediction_tokens=_INT,
    ),
)
_BYTES = {"type": ["array", "null"], "items": _INT}
_TOP = _object(["token", "logprob", "bytes"], token=_STR, logprob={"type": "number"}, bytes=_BYTES)
_TOKEN_LOGPROB = _object(
    ["token", "logprob", "bytes", "top_logprobs"],
    token=_STR,
    logprob={"type": "number"},
    bytes=_BYTES,
    top_logprobs={"type": "array", "items": _TOP},
)
_CHAT_LOGPROBS = {
    **_object(
        ["content", "refusal"],
        content={"type": ["array", "null"], "items": _TOKEN_LOGPROB},
        refusal={"type": ["array", "null"], "items": _TOKEN_LOGPROB},
    ),
    "type": ["object", "null"],
}
_FUNCTION = _object(["name", "arguments"], name=_STR, arguments=_STR)
_TOOL_CALL = _object(
    ["id", "type", "function"], id=_STR, type=_const("function"), function=_FUNCTION
)
_TOOL_CALL_CHUNK = _object(
    ["index"],
    index=_INT,
    id=_STR,
    type=_const("function"),
    function=_object([], name=_STR, arguments=_STR),
)
_COMMON = {"id": _STR, "created": _INT, "model": _STR, "system_fingerprint": _STR}
_REQUIRED = ["id", "object", "created", "model", "choices"]

CHAT_COMPLETION = _object(
    _REQUIRED,
    object=_const("chat.completion"),
    usage=_USAGE,
    service_tier={"type": ["string", "null"]},
    choices={
        "type": "array",
        "items": _object(
            ["finish_reason", "index", "message", "logprobs"],
            finish_reason={
                "enum": ["stop", "length", "tool_calls", "content_filter", "function_call"]
            },
            index=_INT,
            logprobs=_CHAT_LOGPROBS,
            message=_object(
                ["role", "content", "refusal"],
                role=_const("assistant"),
                content=_NULLABLE_STR,
                refusal=_NULLABLE_STR,
                tool_calls={"type": "array", "items": _TOOL_CALL},
            ),
        ),
    },
    **_COMMON,
)

CHAT_COMPLETION_CHUNK = _object(
    _REQUIRED,
    object=_const("chat.completion.chunk"),
    usage={**_USAGE, "type": ["object", "null"]},
    service_tier={"type": ["string", "null"]},
    choices={
        "type": "array",
        "items": _object(
            ["delta", "finish_reason", "index"],
            finish_reason={
                "enum": ["stop", "length", "tool_calls", "content_filter", "function_call", None]
            },
            index=_INT,
            logprobs=_CHAT_LOGPROBS,
            delta=_object(
                [],
                role={"enum": ["developer", "system", "user", "assistant", "tool"]},
                content=_NULLABLE_STR,
                refusal=_NULLABLE_STR,
                tool_calls={"type": "array", "items": _TOOL_CALL_CHUNK},
            ),
        ),
    },
    **_COMMON,
)

_TEXT_LOGPROBS = {
    **_object(
        [],
        text_offset={"type": "array", "items": _INT},
        token_logprobs={"type": "array", "items": {"type": ["number", "null"]}},
        tokens={"type": "array", "items": _STR},
        top_logprobs={
            "type": "array",
            "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        },
    ),
    "type": ["object", "null"],
}


def _text_completion(finish: list[Any]) -> dict[str, Any]:
    return _object(
        _REQUIRED,
        object=_const("text_completion"),
        usage=_USAGE,
        choices={
            "type": "array",
            "items": _object(
                ["finish_reason", "index", "logprobs", "text"],
                finish_reason={"enum": finish},
                index=_INT,
                logprobs=_TEXT_LOGPROBS,
                text=_STR,
            ),
        },
        **_COMMON,
    )


TEXT_COMPLETION = _text_completion(["stop", "length", "content_filter"])
TEXT_COMPLETION_CHUNK = _text_completion(["stop", "length", "content_filter", None])

MODEL = _object(
    ["id", "object", "created", "owned_by"],
    id=_STR,
    object=_const("model"),
    created=_INT,
    owned_by=_STR,
)
MODEL_LIST = _object(
    ["object", "data"], object=_const("list"), data={"type": "array", "items": MODEL}
)
EMBEDDING_LIST = _object(
    ["object", "data", "model", "usage"],
    object=_const("list"),
    data={
        "type": "array",
        "items": _object(
            ["object", "index", "embedding"],
            object=_const("embedding"),
            index=_INT,
            embedding={"type": ["array", "string"], "items": {"type": "number"}},
        ),
    },
    model=_STR,
    usage=_object(["prompt_tokens", "total_tokens"], prompt_tokens=_INT, total_tokens=_INT),
)
ERROR = _object(
    ["error"],
    error=_object(
        ["type", "message", "param", "code"],
        type=_STR,
        message=_STR,
        param=_NULLABLE_STR,
        code=_NULLABLE_STR,
    ),
)

SCHEMAS: dict[str, dict[str, Any]] = {
    "chat.completion": CHAT_COMPLETION,
    "chat.completion.chunk": CHAT_COMPLETION_CHUNK,
    "text_completion": TEXT_COMPLETION,
    "text_completion.chunk": TEXT_COMPLETION_CHUNK,
    "model": MODEL,
    "list": MODEL_LIST,
    "embedding.list": EMBEDDING_LIST,
    "error": ERROR,
}
for _schema in SCHEMAS.values():
    jsonschema.Draft202012Validator.check_schema(_schema)
_VALIDATORS = {name: jsonschema.Draft202012Validator(s) for name, s in SCHEMAS.items()}


def schema_for(path: str, status: int, *, stream: bool) -> str | None:
    """The schema name an OpenAI endpoint's answer must match (None: not checked)."""
    if status >= 400:
        return "error"
    if path == "/v1/chat/completions":
        return "chat.completion.chunk" if stream else "chat.completion"
    if path == "/v1/completions":
        return "text_completion.chunk" if stream else "text_completion"
    if path == "/v1/models":
        return "list"
    if path == "/v1/embeddings":
        return "embedding.list"
    if path.startswith("/v1/models/"):
        return "model"
    return None


def problems(name: str, payload: Any) -> list[str]:
    """Every way ``payload`` breaks the schema ``name``."""
    return [
        f"{name} at {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in _VALIDATORS[name].iter_errors(payload)
    ]


_OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings")

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class SchemaChecker:
    """Validates what an app sends on the OpenAI endpoints; collects what does not conform."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        #: Bodies and stream events validated so far.
        self.checked = 0

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """An ASGI app that sends what ``app`` sends, checking it on the way."""

        async def checked(scope: Any, receive: Any, send: Any) -> None:
            path = scope.get("path", "") if scope["type"] == "http" else ""
            if not path.startswith(_OPENAI_PATHS) or scope.get("method") not in ("GET", "POST"):
                await app(scope, receive, send)
                return
            seen: MutableMapping[str, Any] = {"chunks": []}

            async def watch(message: Any) -> None:
                if message["type"] == "http.response.start":
                    seen["status"] = message["status"]
                    headers = dict(message.get("headers") or [])
                    seen["type"] = headers.get(b"content-type", b"").decode()
                elif message["type"] == "http.response.body":
                    seen["chunks"].append(message.get("body", b""))
                    if not message.get("more_body", False):
                        self._check(path, seen["status"], seen["type"], b"".join(seen["chunks"]))
                await send(message)

            await app(scope, receive, watch)

        return checked

    def _check(self, path: str, status: int, content_type: str, body: bytes) -> None:
        stream = content_type.startswith("text/event-stream")
        name = schema_for(path, status, stream=stream)
        if name is None or not body:
            return
        if not stream:
            self._one(path, name, json.loads(body))
            return
        for block in body.split(b"\n\n"):
            if not block.startswith(b"data: ") or block == b"data: [DONE]":
                continue
            payload = json.loads(block[len(b"data: ") :])
            # A failure after the status line is an error event in the stream.
            self._one(path, "error" if "error" in payload else name, payload)

    def _one(self, path: str, name: str, payload: Any) -> None:
        self.checked += 1
        self.problems.extend(f"{path}: {p}" for p in problems(name, payload))
