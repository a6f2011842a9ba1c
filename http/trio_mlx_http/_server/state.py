"""What every handler shares: the engine, the settings, metrics, and a request's access record."""

from __future__ import annotations

import fnmatch
import hmac
import logging
import time

import attrs

from trio_mlx import Engine, EngineClosed, TrioMLXError
from trio_mlx_http._openai.shapes import TokenTexts
from trio_mlx_http._responses.store import ResponseStore
from trio_mlx_http._server.metrics import Metrics
from trio_mlx_http._settings import Settings

__all__ = ["Access", "ServerState", "key_matches"]

access_logger = logging.getLogger("trio_mlx_http.access")

#: The routes whose duration ``trio_mlx_request_duration_seconds`` observes.
GENERATION_ENDPOINTS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
)


def key_matches(authorization: str, x_api_key: str | None, key: str) -> bool:
    """Whether a request carries ``key``: as a bearer token (OpenAI) or ``x-api-key``
    (Anthropic), compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return True
    return x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), key.encode())


@attrs.define(eq=False)
class ServerState:
    """The app's view of the engine (an identity object: one per app)."""

    engine: Engine
    settings: Settings
    metrics: Metrics
    texts: TokenTexts
    #: The id clients see in ``/v1/models`` and send as ``model``.
    model_id: str
    #: Every name the model answers to as ``model`` (``model_id`` and its aliases).
    model_names: frozenset[str]
    #: Token ids at or above this are not in the vocabulary.
    vocab_size: int
    #: Names listed in ``/v1/models`` after ``model_id`` (``--served-model-name``).
    listed_names: tuple[str, ...] = ()
    #: Shell-style patterns (``claude-*``): a name matching one answers to the model.
    model_patterns: tuple[str, ...] = ()
    started: int = attrs.field(factory=lambda: int(time.time()))
    #: Adapters mounted over HTTP: name -> path relative to ``--adapter-dir``.
    adapter_paths: dict[str, str] = attrs.field(factory=dict)
    #: Set at shutdown: responses then close their connection, so that no idle
    #: keep-alive connection holds the server open until the graceful deadline.
    draining: bool = False
    #: Stored Responses API responses, for ``previous_response_id`` (bounded, LRU).
    responses: ResponseStore = attrs.field(factory=ResponseStore)

    def serves(self, name: str) -> bool:
        """Whether ``name`` names the served model (exactly, or by a pattern)."""
        return name in self.model_names or any(
            fnmatch.fnmatchcase(name, pattern) for pattern in self.model_patterns
        )


@attrs.define(eq=False)
class Access:
    """One request's access-log line and HTTP metrics, written once when it is over."""

    state: ServerState
    endpoint: str
    method: str
    path: str
    started: float = attrs.field(factory=time.perf_counter)
    #: Tokens generated for this request (for a stream: those sent so far).
    tokens: int = 0
    #: Set when a streaming body will write the line itself, at its end.
    by_body: bool = False
    #: Why a stream that had answered 200 ended early: ``shutdown`` (the engine
    #: closed, e.g. at the graceful deadline) or the error's code.
    cut: str | None = None
    #: Who sent it (the peer's address): the engine shares grammar compiles fairly by it.
    client: str | None = None

    def cut_by(self, error: TrioMLXError) -> None:
        """Record that ``error`` ended this request's stream after its 200 went out."""
        self.cut = "shutdown" if isinstance(error, EngineClosed) else error.code or "error"

    def stream_ended(self, status: int, *, admitted: bool) -> None:
        """A streamed body's last word: ``status`` 499 (not every event written) counts
        as a disconnect. A stream refused at admission is not logged here: the
        handler answers with the error and logs it."""
        if not admitted:
            return
        if status == 499:
            self.state.metrics.failed(self.endpoint, "disconnected")
        self.done(status)

    def done(self, status: int) -> None:
        """Log the request and count it.

        A cut stream is counted under ``status`` (the error's) but logged as the
        200 the client got, with the tokens it was sent and ``cut=`` why it ended.
        """
        elapsed = time.perf_counter() - self.started
        self.state.metrics.requests.labels(self.endpoint, str(status)).inc()
        if self.endpoint in GENERATION_ENDPOINTS:
            self.state.metrics.duration.labels(self.endpoint).observe(elapsed)
        logged, cut = (200, f" cut={self.cut}") if self.cut else (status, "")
        access_logger.info(
            "%s %s %d tokens=%d %.3fs%s", self.method, self.path, logged, self.tokens, elapsed, cut
        )
