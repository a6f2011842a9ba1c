"""One error family for the engine, each carrying an HTTP status hint.

The HTTP layer translates these to OpenAI's error JSON at exactly one place;
embedding programs catch them by type.
"""

from __future__ import annotations

__all__ = [
    "AdapterConflict",
    "EngineClosed",
    "EngineOverloaded",
    "GenerationFailed",
    "InvalidGrammar",
    "InvalidRequest",
    "ModelUnavailable",
    "NotFound",
    "ReaderStalled",
    "TrioMLXError",
]


class TrioMLXError(Exception):
    """Base of every error the engine raises on purpose."""

    #: The HTTP status a server should answer with.
    status_code: int = 500
    #: OpenAI's ``error.type`` for this error.
    error_type: str = "server_error"
    #: The ``code`` when none is given (None: the type and ``param`` say enough).
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: The request field at fault, when there is one (OpenAI's ``error.param``).
        self.param = param
        #: A short machine-readable code (OpenAI's ``error.code``).
        self.code = code if code is not None else self.default_code


class InvalidRequest(TrioMLXError):
    """The request is malformed or a value is out of range (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class InvalidGrammar(InvalidRequest):
    """A JSON schema, regex or grammar that cannot constrain decoding (400).

    The message carries the grammar library's own reason, or says that
    compiling it took longer than the engine allows.
    """

    default_code = "invalid_grammar"


class InvalidAdapter(InvalidRequest):
    """An adapter that cannot be mounted as it is (400).

    A layer it adapts lacks one of its two matrices (mlx-lm would draw the
    missing one at random at every use), a matrix has the wrong shape or a
    NaN or infinite value, or its scale is not a finite number of sane size.
    The message names the tensor or setting at fault.
    """

    default_code = "invalid_adapter"


class NotFound(TrioMLXError):
    """An unknown model or adapter was named (404)."""

    status_code = 404
    error_type = "not_found_error"
    default_code = "not_found"


class AdapterConflict(TrioMLXError):
    """An adapter mount or unmount that conflicts with the engine's state (409).

    Too many adapters mounted (``max_loras``), or an unmount of an adapter
    that rows in the batch (running or parked) still use.
    """

    status_code = 409
    default_code = "adapter_conflict"


class EngineOverloaded(TrioMLXError):
    """The inbox or the queue is full; retry later (429)."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code or "engine_overloaded")
        #: Seconds a client should wait before retrying (the ``Retry-After`` header).
        self.retry_after = retry_after


class EngineClosed(TrioMLXError):
    """The engine is shutting down or has failed; nothing new is accepted (503)."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "engine_closed"


class ModelUnavailable(TrioMLXError):
    """The model asked for is not loaded in time (it is loading, or waits for room); retry
    later (503, with ``retry_after``)."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "model_unavailable"

    def __init__(self, message: str, *, retry_after: float = 5.0, param: str | None = None) -> None:
        super().__init__(message, param=param)
        #: Seconds a client should wait before retrying (the ``Retry-After`` header).
        self.retry_after = retry_after


class GenerationFailed(TrioMLXError):
    """The model failed while generating this request; the engine keeps serving (500)."""

    status_code = 500
    error_type = "server_error"
    default_code = "generation_failed"


class ReaderStalled(TrioMLXError):
    """The consumer stopped taking this request's output; it was cancelled (408).

    Raised by a stream whose unread output grew past the engine's
    ``max_unread_tokens``: the engine does not decode (and buffer) for a
    reader that does not read.
    """

    status_code = 408
    error_type = "timeout_error"
    default_code = "reader_stalled"
