"""Several models behind one server: each request runs with the model it names held.

With a :class:`~trio_mlx.ModelHost` (``--model`` given twice, ``--model-dir``,
``--max-models`` or ``--idle-unload``), :class:`ModelRouter` wraps the app's ASGI
callable. For a POST to a route that takes a ``model`` field it reads the body (bounded
as the app bounds it), finds the model, holds it through the host (loading it if it is
not loaded: the request waits, at most the host's ``load_timeout``, then 503 with
``Retry-After``) for the whole exchange, the streamed body included, and hands the app
that model's :class:`ServerState` in the ASGI scope. A name the host does not know goes
to the default model, whose aliases and patterns answer as they do with one model (and
anything else is the app's 404). The API key is checked before any model is loaded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import attrs
import trio

from trio_mlx import Engine, ModelHost, TrioMLXError
from trio_mlx_http._errors import (
    ANTHROPIC_PATHS,
    Unauthorized,
    anthropic_error_body,
    error_body,
    retry_after,
)
from trio_mlx_http._openai.shapes import TokenTexts
from trio_mlx_http._server.state import ServerState, key_matches

__all__ = ["ROUTED", "SCOPE_KEY", "ModelRouter", "model_card_fields"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The routes whose body names a model.
ROUTED = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
    }
)
#: Where the router leaves the request's model state for the app.
SCOPE_KEY = "trio_mlx.state"
#: Seconds the router waits for a body before passing the request on unread (the app
#: then times it out as it would).
_BODY_TIMEOUT = 60.0
#: Bodies above this are parsed for their model in a thread.
_LARGE_BODY = 64 * 1024


def _model_of(body: bytes) -> str | None:
    """The ``model`` a JSON body names (None: none, or not a JSON object)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) else None


def model_card_fields(engine: Engine | None) -> dict[str, Any]:
    """What ``/v1/models`` says of a loaded model (nothing of one not loaded)."""
    if engine is None:
        return {}
    return {
        "context_length": engine.context_length,
        "input_modalities": ["text", "image"] if engine.takes_images else ["text"],
    }


@attrs.define(eq=False)
class ModelRouter:
    """ASGI middleware: a request runs with the model its body names held."""

    inner: ASGIApp
    host: ModelHost
    #: The default model's state: its settings, metrics and stores are every model's.
    base: ServerState
    _states: dict[str, tuple[Engine, ServerState]] = attrs.field(init=False, factory=dict)

    def state_for(self, name: str, engine: Engine) -> ServerState:
        """The app's view of ``name`` served by ``engine`` (made once per load)."""
        if name == self.host.default:  # the base state, its engine renewed by a reload
            if self.base.engine is not engine:
                self.base.engine = engine
                self.base.texts = TokenTexts(engine.tokenizer)
                self.base.adapter_paths.clear()  # the old engine's mounts went with it
            return self.base
        known = self._states.get(name)
        if known is not None and known[0] is engine:
            return known[1]
        state = attrs.evolve(
            self.base,
            engine=engine,
            texts=TokenTexts(engine.tokenizer),
            model_id=name,
            model_names=frozenset({name}),
            vocab_size=len(engine.tokenizer.get_vocab()),
            listed_names=(),
            model_patterns=(),
            adapter_paths={},
        )
        self._states[name] = (engine, state)
        return state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in ROUTED
        ):
            await self.inner(scope, receive, send)
            return
        path = str(scope["path"])
        if not self._authorized(scope):
            error = Unauthorized(
                "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )
            await self._answer(send, error, path)
            return
        if _declared_length(scope) > (self.base.settings.max_body_bytes or float("inf")):
            await self.inner(scope, receive, send)  # the app answers 413 unread
            return
        chunks, tail = await self._read(receive)
        replay = _replay(chunks, tail, receive)
        if tail is not None:  # too large, too slow or gone: the app answers, no model held
            await self.inner(scope, replay, send)
            return
        body = b"".join(chunks)
        if len(body) > _LARGE_BODY:
            name = await trio.to_thread.run_sync(_model_of, body)
        else:
            name = _model_of(body)
        target = name if name in self.host.names else self.host.default
        async with contextlib.AsyncExitStack() as held:
            try:
                engine = await held.enter_async_context(self.host.use(target))
            except TrioMLXError as error:  # not loaded in time, or its load failed
                await self._answer(send, error, path)
                return
            routed = dict(scope)
            routed[SCOPE_KEY] = self.state_for(target, engine)
            await self.inner(routed, replay, send)

    async def _answer(self, send: Send, error: TrioMLXError, path: str) -> None:
        """Answer ``error`` in the endpoint's own error shape (the app never saw it)."""
        body = error_body(error) if path not in ANTHROPIC_PATHS else anthropic_error_body(error)
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        retry = retry_after(error)
        if retry is not None:
            headers.append((b"retry-after", retry.encode()))
        origin = self.base.settings.cors_origin
        if origin is not None:  # as the app's own answers carry it
            headers.append((b"access-control-allow-origin", origin.encode("latin-1")))
        headers.append((b"connection", b"close"))  # the body may be left unread
        await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    def _authorized(self, scope: Scope) -> bool:
        key = self.base.settings.api_key
        if key is None:
            return True
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        return key_matches(headers.get("authorization", ""), headers.get("x-api-key"), key)

    async def _read(self, receive: Receive) -> tuple[list[bytes], Message | None]:
        """The body's chunks, and what stopped the reading short: None when the body
        is whole; the message that is not body (a disconnect), or an empty one when
        past the app's size bound or too slow (the app then meets the rest as it would)."""
        chunks: list[bytes] = []
        size, limit = 0, self.base.settings.max_body_bytes
        with trio.move_on_after(_BODY_TIMEOUT):
            while True:
                message = await receive()
                if message.get("type") != "http.request":
                    return chunks, message
                chunk = bytes(message.get("body", b""))
                chunks.append(chunk)
                size += len(chunk)
                if not message.get("more_body", False):
                    return chunks, None
                if limit is not None and size > limit:
                    return chunks, {}
        return chunks, {}


def _declared_length(scope: Scope) -> int:
    """The body's ``Content-Length`` (0: none, or not a number)."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _replay(chunks: list[bytes], tail: Message | None, receive: Receive) -> Receive:
    """A ``receive`` that gives the chunks already read (and the message that stopped
    the reading, if any), then whatever the original gives."""
    pending: list[Message] = [
        {"type": "http.request", "body": chunk, "more_body": True} for chunk in chunks
    ]
    if tail is None:
        if pending:
            pending[-1]["more_body"] = False
    elif tail:
        pending.append(tail)

    async def again() -> Message:
        return pending.pop(0) if pending else await receive()

    return again
