"""THE translation point: every failure becomes OpenAI's error JSON here
(or Anthropic's, on the Anthropic Messages routes).

Inside, the server raises only the engine's error family (``trio_mlx``'s
:class:`~trio_mlx.TrioMLXError`, plus the two HTTP-only members below);
Quart's own HTTP exceptions (404 route, 405, 413 body too large) and any
unexpected exception are mapped here too, so no other module builds an error
body and bad input never turns into a 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from quart import Quart, Response, has_request_context, request
from werkzeug.exceptions import HTTPException

from trio_mlx import EngineOverloaded, ModelUnavailable, TrioMLXError

__all__ = [
    "ANTHROPIC_PATHS",
    "Forbidden",
    "Unauthorized",
    "anthropic_error_body",
    "error_body",
    "error_response",
    "install_error_handlers",
    "retry_after",
]

logger = logging.getLogger("trio_mlx_http")

#: OpenAI's ``error.type`` for the HTTP statuses Quart raises by itself.
_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}

#: Routes that speak Anthropic's Messages API: their errors use Anthropic's shape.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

#: Anthropic's ``error.type`` by HTTP status (anything else is ``api_error``).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class Unauthorized(TrioMLXError):
    """The request lacks the right ``Authorization: Bearer`` key (401)."""

    status_code = 401
    error_type = "authentication_error"


class Forbidden(TrioMLXError):
    """The request names something it may not touch, e.g. a path outside ``--adapter-dir`` (403)."""

    status_code = 403
    error_type = "permission_error"


def error_body(error: BaseException) -> dict[str, Any]:
    """Return OpenAI's ``{"error": {...}}`` for any exception."""
    if isinstance(error, TrioMLXError):
        detail = {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    elif isinstance(error, HTTPException):
        status = error.code or 500
        detail = {
            "message": error.description or error.name,
            "type": _HTTP_TYPES.get(status, "server_error"),
            "param": None,
            "code": error.name.lower().replace(" ", "_"),
        }
    else:
        detail = {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    return {"error": detail}


def anthropic_error_body(error: BaseException) -> dict[str, Any]:
    """Return Anthropic's ``{"type": "error", "error": {"type", "message"}}`` for any exception."""
    detail = error_body(error)["error"]
    kind = _ANTHROPIC_TYPES.get(status_of(error), "api_error")
    return {"type": "error", "error": {"type": kind, "message": detail["message"]}}


def status_of(error: BaseException) -> int:
    """The HTTP status an exception answers with."""
    if isinstance(error, TrioMLXError):
        return error.status_code
    if isinstance(error, HTTPException):
        return error.code or 500
    return 500


def retry_after(error: BaseException) -> str | None:
    """The ``Retry-After`` header ``error`` asks for (a full queue, a model not ready)."""
    if isinstance(error, EngineOverloaded | ModelUnavailable):
        return str(max(1, round(error.retry_after)))
    return None


def error_response(error: BaseException, *, anthropic: bool = False) -> Response:
    """The JSON response for ``error``, with ``Retry-After`` on 429 and a model's 503."""
    body = anthropic_error_body(error) if anthropic else error_body(error)
    response = Response(json.dumps(body), status=status_of(error), mimetype="application/json")
    retry = retry_after(error)
    if retry is not None:
        response.headers["Retry-After"] = retry
    if response.status_code == 413:
        # The unread rest of the body is still on the wire: the connection
        # cannot carry another request, so tell the client not to reuse it.
        response.headers["Connection"] = "close"
    if isinstance(error, HTTPException) and error.code == 405:
        allowed = getattr(error, "valid_methods", None)
        if allowed:
            response.headers["Allow"] = ", ".join(allowed)
    return response


def install_error_handlers(app: Quart) -> None:
    """Route every exception a handler raises through :func:`error_response`."""

    async def on_error(error: Exception) -> Response:
        if not isinstance(error, TrioMLXError | HTTPException):
            logger.exception("unexpected error", exc_info=error)
        anthropic = has_request_context() and (
            request.path in ANTHROPIC_PATHS or request.path.startswith("/v1/v1/messages")
        )
        return error_response(error, anthropic=anthropic)

    app.register_error_handler(TrioMLXError, on_error)
    app.register_error_handler(HTTPException, on_error)
    app.register_error_handler(Exception, on_error)
