"""A hand-written OpenAPI 3 description of the server, served at ``GET /openapi.json``.

It describes what the handlers accept and every status they answer with, so
a schema fuzzer can check that no input yields a 500. A field not described
here is refused with 400 ``unsupported_parameter``, except the few that
cannot change the output (``user``, ``metadata``, ``store``, ...; see
``_schema.IGNORED_FIELDS``).
"""

from __future__ import annotations

from typing import Any

from trio_mlx import __version__

__all__ = ["openapi"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    str(status): _json(_ref("Error"), text)
    for status, text in (
        (400, "Bad request: malformed JSON or a bad field (error.param names it)."),
        (401, "Missing or wrong API key."),
        (404, "Unknown model, adapter or route."),
        (413, "Request body too large."),
        (429, "Engine overloaded; see Retry-After."),
        (503, "Engine closed."),
    )
}

_NUMBER = {"type": "number"}
_INT = {"type": "integer"}
_STOP = {
    "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16}],
    "nullable": True,
}
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "nullable": True},
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 1,
        "nullable": True,
    },
    "top_k": {"type": "integer", "minimum": 0, "nullable": True},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "stop": _STOP,
    "seed": {"type": "integer", "minimum": 0, "nullable": True},
    "n": {"type": "integer", "minimum": 1, "maximum": 16, "nullable": True},
    "repetition_penalty": {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 10,
        "nullable": True,
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "logit_bias": {
        "type": "object",
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "nullable": True,
    },
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
        "nullable": True,
    },
    "adapter": {"type": "string", "nullable": True, "description": "A mounted adapter's name."},
    "response_format": {
        "nullable": True,
        "description": "Constrain the output to JSON (json_object) or to a JSON schema.",
        "oneOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
            },
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"type": "string", "enum": ["json_schema"]},
                    "json_schema": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1, "maxLength": 64},
                            "description": {"type": "string"},
                            "schema": {"type": "object"},
                            "strict": {"type": "boolean", "nullable": True},
                        },
                    },
                },
            },
        ],
    },
    "user": {"type": "string", "nullable": True},
    "ignore_eos": {"type": "boolean", "nullable": True},
    "min_tokens": {"type": "integer", "minimum": 0, "nullable": True},
    "include_stop_str_in_output": {"type": "boolean", "nullable": True},
    "kv_bits": {"type": "integer", "enum": [2, 3, 4, 6, 8], "nullable": True},
    "kv_group_size": {"type": "integer", "enum": [32, 64, 128], "nullable": True},
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {
            "type": "string",
            "enum": ["system", "developer", "user", "assistant", "tool", "function"],
        },
        "content": {
            "nullable": True,
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {
                            # image_url: a vision model's (a data: URL, or http(s)
                            # with --allow-image-urls).
                            "type": {"type": "string", "enum": ["text", "image_url"]},
                            "text": {"type": "string"},
                            "image_url": {
                                "type": "object",
                                "required": ["url"],
                                "properties": {"url": {"type": "string"}},
                            },
                        },
                    },
                },
            ],
        },
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
}

_TOOL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}

_TEXT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {
                "type": "string",
                "enum": ["input_text", "output_text", "text", "input_image"],
            },
            "text": {"type": "string"},
            "image_url": {"type": "string"},
        },
    },
}

#: ``POST /v1/responses``: the fields the server honours (design/http.md lists the rest).
_RESPONSES_REQUEST = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": {"type": "string", "nullable": True},
        "input": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {
                                "type": "string",
                                "enum": ["message", "function_call", "function_call_output"],
                            },
                            "role": {
                                "type": "string",
                                "enum": ["user", "assistant", "system", "developer"],
                            },
                            "content": {"oneOf": [{"type": "string"}, _TEXT_PARTS]},
                            "call_id": {"type": "string"},
                            "name": {"type": "string"},
                            "arguments": {"type": "string"},
                            "output": {"type": "string"},
                        },
                    },
                },
            ]
        },
        "instructions": {"type": "string", "nullable": True},
        "max_output_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": _SAMPLING["top_p"],
        "tools": {
            "type": "array",
            "nullable": True,
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                },
            },
        },
        "tool_choice": {"type": "string", "enum": ["auto", "none"], "nullable": True},
        "parallel_tool_calls": {"type": "boolean", "nullable": True},
        "text": {"type": "object", "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "store": {"type": "boolean", "nullable": True},
        "previous_response_id": {"type": "string", "nullable": True},
        "metadata": {"type": "object", "nullable": True},
    },
}

_ANTHROPIC_BLOCKS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "image", "tool_use", "tool_result"]},
            "text": {"type": "string"},
            "source": {"type": "object"},
            "id": {"type": "string"},
            "name": {"type": "string"},
            "input": {"type": "object"},
            "tool_use_id": {"type": "string"},
            "content": {"oneOf": [{"type": "string"}, {"type": "array"}]},
        },
    },
}

#: ``POST /v1/messages``: the fields the server honours (design/http.md lists the rest).
_MESSAGES_REQUEST = {
    "type": "object",
    "required": ["max_tokens", "messages"],
    "properties": {
        "model": {"type": "string", "nullable": True},
        "max_tokens": {"type": "integer", "minimum": 1},
        "system": {"nullable": True, "oneOf": [{"type": "string"}, _ANTHROPIC_BLOCKS]},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant"]},
                    "content": {"oneOf": [{"type": "string"}, _ANTHROPIC_BLOCKS]},
                },
            },
        },
        "stop_sequences": {"type": "array", "items": {"type": "string"}, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
        "top_p": _SAMPLING["top_p"],
        "top_k": _SAMPLING["top_k"],
        "stream": {"type": "boolean", "nullable": True},
        "tools": {
            "type": "array",
            "nullable": True,
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                },
            },
        },
        "tool_choice": {"type": "object", "nullable": True},
        "metadata": {"type": "object", "nullable": True},
    },
}

_SCHEMAS: dict[str, Any] = {
    "ResponsesRequest": _RESPONSES_REQUEST,
    "MessagesRequest": _MESSAGES_REQUEST,
    "CountTokensRequest": {
        **_MESSAGES_REQUEST,
        "required": ["messages"],
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"type": "string", "enum": ["error"]},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": "string", "nullable": True},
                    "code": {"type": "string", "nullable": True},
                },
            }
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
            "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
            "logprobs": {"type": "boolean", "nullable": True},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True},
            "tools": {"type": "array", "items": _TOOL, "nullable": True},
            "parallel_tool_calls": {"type": "boolean", "nullable": True},
            "chat_template_kwargs": {"type": "object", "nullable": True},
            "modalities": {
                "type": "array",
                "items": {"type": "string", "enum": ["text"]},
                "nullable": True,
            },
            "tool_choice": {
                "nullable": True,
                "oneOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    {"type": "object"},
                ],
            },
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **_SAMPLING,
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "array",
                            "minItems": 1,
                            "items": {"type": "integer", "minimum": 0},
                        },
                    },
                ]
            },
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True},
            "echo": {"type": "boolean", "nullable": True},
            "suffix": {
                "type": "string",
                "nullable": True,
                "description": "Fill-in-the-middle; only for models with FIM tokens.",
            },
            "best_of": {
                "type": "integer",
                "minimum": 1,
                "nullable": True,
                "description": "Candidates per prompt; the n most likely are returned.",
            },
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "created": _INT,
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object"}},
            "usage": {
                "type": "object",
                "properties": {
                    "prompt_tokens": _INT,
                    "completion_tokens": _INT,
                    "total_tokens": _INT,
                },
            },
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["model"]},
            "created": _INT,
            "owned_by": {"type": "string"},
            "parent": {"type": "string", "description": "Set on adapters: the base model."},
            "context_length": {"type": "integer", "nullable": True},
        },
    },
    "List": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"type": "object"}},
        },
    },
    "AdapterMount": {
        "type": "object",
        "required": ["name", "path"],
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$"},
            "path": {"type": "string", "description": "Relative to --adapter-dir."},
        },
    },
    "Adapter": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["adapter"]},
            "path": {"type": "string", "nullable": True},
            "deleted": {"type": "boolean"},
        },
    },
    "TokenizeRequest": {
        "type": "object",
        "properties": {
            "prompt": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        },
    },
    "Tokens": {
        "type": "object",
        "required": ["tokens", "count"],
        "properties": {
            "tokens": {"type": "array", "items": _INT},
            "count": _INT,
            "max_model_len": {"type": "integer", "nullable": True},
        },
    },
    "EmbeddingRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                    {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "array", "minItems": 1, "items": _INT},
                    },
                ]
            },
            "model": {"type": "string"},
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1},
            "user": {"type": "string"},
        },
    },
    "Embeddings": {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"type": "string"},
            "data": {"type": "array", "items": {"type": "object"}},
            "model": {"type": "string"},
            "usage": {"type": "object"},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "properties": {"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
    },
    "Text": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}},
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"type": "string"},
            "model": {"type": "string"},
            "state": {"type": "string"},
            "running_rows": {"type": "integer"},
            "queued_rows": {"type": "integer"},
            "ranks": {"type": "integer"},
        },
    },
}


def _op(
    summary: str,
    ok: dict[str, Any],
    *,
    body: str | None = None,
    errors: tuple[int, ...] = (400, 401, 413),
    ok_status: str = "200",
    public: bool = False,
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {ok_status: ok, **{str(s): _ERRORS[str(s)] for s in errors}},
    }
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    if public:
        operation["security"] = []
    return operation


_GENERATION_OK = {
    "description": "The completion, or with stream=true a text/event-stream of chunks.",
    "content": {
        "application/json": {"schema": _ref("Completion")},
        "text/event-stream": {"schema": {"type": "string"}},
    },
}
_GENERATION_ERRORS = (400, 401, 404, 413, 429, 503)


def _generation_op(summary: str, body: str, ok: str) -> dict[str, Any]:
    return _op(
        summary,
        {
            "description": f"{ok}, or with stream=true a text/event-stream of named events.",
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}},
            },
        },
        body=body,
        errors=_GENERATION_ERRORS,
    )


def _anthropic_errors(operation: dict[str, Any]) -> dict[str, Any]:
    """``operation`` with its error responses in Anthropic's shape."""
    responses = {
        status: (
            answer
            if status.startswith("2")
            else _json(_ref("AnthropicError"), answer["description"])
        )
        for status, answer in operation["responses"].items()
    }
    return {**operation, "responses": responses}


def openapi(model_id: str) -> dict[str, Any]:
    """The OpenAPI 3.0 document for this server."""
    name_param = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    model_param = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    response_param = {
        "name": "response_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "trio-mlx",
            "version": __version__,
            "description": f"OpenAI-compatible API serving {model_id}.",
        },
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {
                "post": _op(
                    "Chat completion",
                    _GENERATION_OK,
                    body="ChatCompletionRequest",
                    errors=_GENERATION_ERRORS,
                )
            },
            "/v1/completions": {
                "post": _op(
                    "Text completion",
                    _GENERATION_OK,
                    body="CompletionRequest",
                    errors=_GENERATION_ERRORS,
                )
            },
            "/v1/embeddings": {
                "post": _op(
                    "Embeddings of texts or token arrays",
                    _json(_ref("Embeddings"), "The vectors (float lists, or base64 float32)"),
                    body="EmbeddingRequest",
                    errors=(400, 401, 404, 413, 503),
                )
            },
            "/v1/responses": {
                "post": _generation_op(
                    "OpenAI Responses API: one response", "ResponsesRequest", "The response"
                )
            },
            "/v1/responses/{response_id}": {
                "get": {
                    **_op(
                        "A stored response",
                        _json({"type": "object"}, "The response"),
                        errors=(401, 404),
                    ),
                    "parameters": [response_param],
                },
                "delete": {
                    **_op(
                        "Forget a stored response",
                        _json({"type": "object"}, "Deleted"),
                        errors=(401, 404),
                    ),
                    "parameters": [response_param],
                },
            },
            "/v1/messages": {
                "post": _anthropic_errors(
                    _generation_op(
                        "Anthropic Messages API: one message", "MessagesRequest", "The message"
                    )
                )
            },
            "/v1/messages/count_tokens": {
                "post": _anthropic_errors(
                    _op(
                        "Anthropic Messages API: count a prompt's tokens",
                        _json({"type": "object"}, "{input_tokens}"),
                        body="CountTokensRequest",
                        errors=(400, 401, 404, 413),
                    )
                )
            },
            "/v1/models": {
                "get": _op(
                    "Served models and mounted adapters",
                    _json(_ref("List"), "Models"),
                    errors=(401,),
                )
            },
            "/v1/models/{model_id}": {
                "get": {
                    **_op("One model", _json(_ref("Model"), "The model"), errors=(401, 404)),
                    "parameters": [model_param],
                }
            },
            "/v1/models/{model_id}/load": {
                "post": {
                    **_op(
                        "Load a model (a server of several models)",
                        _json(_ref("Model"), "The model, with its state"),
                        errors=(400, 401, 404, 503),
                    ),
                    "parameters": [model_param],
                }
            },
            "/v1/models/{model_id}/unload": {
                "post": {
                    **_op(
                        "Unload a model once its requests have ended",
                        _json(_ref("Model"), "The model, with its state"),
                        errors=(400, 401, 404),
                    ),
                    "parameters": [model_param],
                }
            },
            "/v1/adapters": {
                "get": _op("Mounted adapters", _json(_ref("List"), "Adapters"), errors=(401,)),
                "post": {
                    **_op(
                        "Mount an adapter from --adapter-dir",
                        _json(_ref("Adapter"), "Mounted"),
                        body="AdapterMount",
                        errors=(400, 401, 404, 413, 503),
                        ok_status="201",
                    ),
                    "responses": {
                        "201": _json(_ref("Adapter"), "Mounted"),
                        "403": _json(
                            _ref("Error"), "Path outside --adapter-dir, or no --adapter-dir."
                        ),
                        **{str(s): _ERRORS[str(s)] for s in (400, 401, 404, 413, 503)},
                    },
                },
            },
            "/v1/adapters/{name}": {
                "delete": {
                    **_op(
                        "Unmount an adapter",
                        _json(_ref("Adapter"), "Unmounted"),
                        errors=(401, 404, 503),
                    ),
                    "parameters": [name_param],
                }
            },
            "/tokenize": {
                "post": _op(
                    "Text or messages to token ids",
                    _json(_ref("Tokens"), "Tokens"),
                    body="TokenizeRequest",
                )
            },
            "/detokenize": {
                "post": _op(
                    "Token ids to text", _json(_ref("Text"), "Text"), body="DetokenizeRequest"
                )
            },
            "/health": {
                "get": _op(
                    "Liveness",
                    _json(_ref("Health"), "Serving"),
                    errors=(503,),
                    public=True,
                )
            },
            "/metrics": {
                "get": _op(
                    "Prometheus metrics",
                    {
                        "description": "Prometheus text",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    errors=(401,),
                )
            },
            "/openapi.json": {
                "get": _op(
                    "This document",
                    {
                        "description": "OpenAPI 3.0",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    errors=(401,),
                )
            },
        },
    }
