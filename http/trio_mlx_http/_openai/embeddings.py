"""``POST /v1/embeddings``: OpenAI's embeddings endpoint over ``Engine.embed``.

The body: ``input`` (a string, a list of strings, a list of token ids, or a
list of such lists), ``model``, ``encoding_format`` (``float``, the default, or
``base64``: each vector's little-endian float32 bytes), ``dimensions`` and
``user`` (accepted; it changes nothing). Any other field is refused, as on the
other endpoints. Errors are OpenAI's error JSON, through :mod:`trio_mlx_http._errors`.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from trio_mlx import Embeddings, InvalidRequest, NotFound
from trio_mlx_http._server.state import ServerState

__all__ = ["EmbeddingRequest", "parse_embeddings", "respond"]

_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user"})
_FORMATS = ("float", "base64")


@attrs.frozen
class EmbeddingRequest:
    """A checked ``/v1/embeddings`` body."""

    inputs: tuple[str | tuple[int, ...], ...]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None


def _token_list(value: Sequence[Any], where: str) -> tuple[int, ...]:
    if not value:
        raise InvalidRequest(f"{where} is an empty token list", param="input")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequest(
                f"{where} must hold token ids (integers), not {token!r:.40}", param="input"
            )
    return tuple(value)


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            "input must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists, and not empty",
            param="input",
        )
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return (_token_list(value, "input"),)
    items: list[str | tuple[int, ...]] = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, list):
            items.append(_token_list(item, f"input[{index}]"))
        else:
            raise InvalidRequest(
                f"input[{index}] must be a string or a list of token ids, not {item!r:.40}",
                param="input",
            )
    return tuple(items)


def parse_embeddings(body: Mapping[str, Any]) -> EmbeddingRequest:
    """Check a ``/v1/embeddings`` body; every bad field is an InvalidRequest (400)."""
    for name, value in body.items():
        if name not in _FIELDS and value is not None:
            raise InvalidRequest(
                f"unknown field {name!r:.80}: /v1/embeddings does not support it",
                param=str(name)[:80],
                code="unsupported_parameter",
            )
    if "input" not in body or body["input"] is None:
        raise InvalidRequest("input is required", param="input")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("user must be a string", param="user")
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in _FORMATS:
        raise InvalidRequest(
            f"encoding_format must be 'float' or 'base64', not {fmt!r:.40}",
            param="encoding_format",
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise InvalidRequest("dimensions must be a positive integer", param="dimensions")
    return EmbeddingRequest(_inputs(body["input"]), model, fmt, dimensions)


def _check_model(state: ServerState, name: str | None) -> None:
    if name is None or state.serves(name):
        return
    if name in state.engine.adapters:
        raise InvalidRequest(
            f"model {name!r} is an adapter; embeddings come from the base model",
            param="model",
            code="adapter_not_supported",
        )
    raise NotFound(
        f"the model {name!r} does not exist; GET /v1/models lists the served models",
        param="model",
        code="model_not_found",
    )


def _encoded(vector: Sequence[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def body_of(state: ServerState, request: EmbeddingRequest, result: Embeddings) -> dict[str, Any]:
    """OpenAI's response object for ``result``."""
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": _encoded(vector, request.encoding_format),
        }
        for index, vector in enumerate(result.vectors)
    ]
    tokens = result.prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": state.model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def respond(state: ServerState, request: EmbeddingRequest) -> dict[str, Any]:
    """Embed the request's inputs and build the response (encoded off the event loop)."""
    _check_model(state, request.model)
    result = await state.engine.embed(list(request.inputs), dimensions=request.dimensions)
    return await trio.to_thread.run_sync(body_of, state, request, result)
