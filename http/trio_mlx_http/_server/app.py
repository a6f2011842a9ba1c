"""The Quart-Trio app: ``create_app(engine, settings)`` and every route.

Handlers parse with :mod:`trio_mlx_http._openai.schema`, call the engine's public API, and
return plain dicts or responses; every error goes through :mod:`._errors`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import trio
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Response, g, request
from quart_trio import QuartTrio

from trio_mlx import Engine, EngineClosed, InvalidRequest, ModelHost, NotFound
from trio_mlx_http._anthropic import messages as _anthropic
from trio_mlx_http._common.images import resolve_prompts
from trio_mlx_http._errors import Forbidden, Unauthorized, install_error_handlers
from trio_mlx_http._openai import chat as _generation
from trio_mlx_http._openai import embeddings as _embeddings
from trio_mlx_http._openai import schema as _schema
from trio_mlx_http._openai.shapes import TokenTexts
from trio_mlx_http._responses import route as _responses
from trio_mlx_http._server.metrics import Metrics
from trio_mlx_http._server.models import SCOPE_KEY, ModelRouter, model_card_fields
from trio_mlx_http._server.openapi import openapi
from trio_mlx_http._server.state import Access, ServerState, key_matches
from trio_mlx_http._settings import Settings

__all__ = ["create_app", "shutdown_trigger"]

T = TypeVar("T")

#: Paths served without the API key.
_PUBLIC = frozenset({"/health"})


def _json(payload: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(payload, ensure_ascii=False), status=status, mimetype="application/json"
    )


#: Bodies above this many bytes are parsed in a thread, not on the event loop.
_LARGE_BODY = 64 * 1024
#: Bytes one token id may take in a JSON list, spaces included, generously.
_ID_BYTES = 16


async def _body() -> dict[str, Any]:
    return await _parsed(lambda body: body)


async def _parsed(parse: Callable[[dict[str, Any]], T], *, refuse_above: int | None = None) -> T:
    """The request body, as JSON, through ``parse`` (in a thread when the body is large).

    Parsing and checking a few megabytes (a long message list, a million token
    ids) takes a fair fraction of a second: never on the event loop. A body
    larger than ``refuse_above`` bytes is refused unparsed (``json.loads`` holds
    the GIL, and so the event loop, for the whole of a large id list).
    """
    # Quart raises 413 here, from Content-Length or while the body streams in,
    # before holding more than max_body_bytes.
    data = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    if refuse_above is not None and len(data) > refuse_above:
        raise InvalidRequest(
            f"the body's {len(data)} bytes hold more token ids than the model's context",
            param="tokens",
            code="context_length_exceeded",
        )
    if len(data) > _LARGE_BODY:
        _refuse_many_messages(data)
        return await trio.to_thread.run_sync(lambda: parse(_schema.parse_json(data)))
    return parse(_schema.parse_json(data))


def _refuse_many_messages(data: bytes) -> None:
    """Refuse, unparsed, a body with more chat messages than the context has tokens.

    A chat has at least a token per message (see the engine's size check), and
    parsing a hundred thousand message objects costs the event loop hundreds of
    milliseconds of garbage collection, even in a thread. ``"role"`` with both
    quotes bare occurs in JSON only as a key (or the odd value): a safe count.
    """
    context = _state().engine.context_length
    if context is None:
        return
    roles = data.count(b'"role"')
    if roles > context:
        raise InvalidRequest(
            f"the body holds {roles} messages, more than the model's context of {context}",
            param="messages",
            code="context_length_exceeded",
        )


async def _off_loop_json(payload: Any) -> Response:
    """A JSON response serialized in a thread (a token list can be megabytes)."""
    text = await trio.to_thread.run_sync(partial(json.dumps, payload, ensure_ascii=False))
    return Response(text, mimetype="application/json")


def _state() -> ServerState:
    state: ServerState = g.trio_mlx
    return state


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def create_app(served: Engine | ModelHost, settings: Settings | None = None) -> QuartTrio:
    """Build the OpenAI-compatible app around a running engine, or a model host whose
    default model is loaded (requests then run with the model they name held:
    :class:`~trio_mlx_http._server.models.ModelRouter`)."""
    settings = settings or Settings()
    host = served if isinstance(served, ModelHost) else None
    engine = served if host is None else host.loaded(host.default)
    if not isinstance(engine, Engine):
        raise ValueError("create_app needs the host's default model loaded")
    app = QuartTrio("trio_mlx_http")
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # streams last as long as generation does
        BODY_TIMEOUT=60,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    metrics = Metrics()
    state = ServerState(
        engine=engine,
        settings=settings,
        metrics=metrics,
        texts=TokenTexts(engine.tokenizer),
        model_id=settings.model_name or engine.model_id,
        model_names=frozenset(
            {
                settings.model_name or engine.model_id,
                engine.model_id,
                *settings.model_aliases,
                *(n for n in settings.served_model_names if not _is_pattern(n)),
            }
        ),
        vocab_size=len(engine.tokenizer.get_vocab()),
        listed_names=tuple(
            name
            for name in dict.fromkeys(settings.served_model_names)
            if not _is_pattern(name) and name != (settings.model_name or engine.model_id)
        ),
        model_patterns=tuple(n for n in settings.served_model_names if _is_pattern(n)),
    )
    # The default model's engine is read at each scrape: with a host it changes on a reload.
    metrics.watch_engine(lambda: state.engine.statistics())
    app.extensions["trio_mlx"] = state
    if host is not None:
        metrics.watch_host(host)
        router = ModelRouter(cast(Any, app.asgi_app), host, state)
        app.extensions["trio_mlx_host"] = router
        app.asgi_app = cast(Any, router)  # type: ignore[method-assign]
    install_error_handlers(app)
    _install_hooks(app, state)
    _install_generation(app)
    _install_models(app)
    _install_adapters(app)
    _install_tokens(app)
    _install_service(app)
    return app


def shutdown_trigger(app: QuartTrio, event: trio.Event) -> Callable[[], Awaitable[None]]:
    """Hypercorn's ``shutdown_trigger`` for ``app``: fires with ``event``.

    From then on every response carries ``Connection: close``: Hypercorn
    otherwise waits for idle keep-alive connections until its graceful deadline.
    """
    state: ServerState = app.extensions["trio_mlx"]

    async def trigger() -> None:
        await event.wait()
        state.draining = True

    return trigger


def _has_body(req: Any) -> bool:
    """Whether the request announced a body (a length above 0, or chunked)."""
    length = req.headers.get("Content-Length", "0")
    chunked = "chunked" in req.headers.get("Transfer-Encoding", "").lower()
    return chunked or length.strip() not in ("", "0")


def _key_matches(key: str) -> bool:
    """Whether the request carries ``key``: as a bearer token (OpenAI) or ``x-api-key`` (Anthropic)."""
    return key_matches(
        request.headers.get("Authorization", ""), request.headers.get("x-api-key"), key
    )


def _install_hooks(app: QuartTrio, state: ServerState) -> None:
    @app.before_request
    async def start() -> None:
        # The model router's choice for a request naming a model; else the default's.
        here = cast(ServerState, request.scope.get(SCOPE_KEY, state))
        g.trio_mlx = here
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        g.access = Access(
            here, rule, request.method, request.path, client=request.remote_addr or None
        )
        if request.method == "OPTIONS" or request.path in _PUBLIC:
            return
        key = state.settings.api_key
        if key is not None and not _key_matches(key):
            raise Unauthorized(
                "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )

    @app.after_request
    async def finish(response: Response) -> Response:
        origin = state.settings.cors_origin
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Headers"] = (
                "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta"
            )
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        if state.draining or (response.status_code >= 400 and _has_body(request)):
            # An early answer (401, 404, ...) may leave the body unread on the
            # socket; reusing that connection can hang the next request on it.
            response.headers["Connection"] = "close"
        access: Access | None = g.get("access")
        if access is not None and not access.by_body:
            access.done(response.status_code)
        return response


def _install_generation(app: QuartTrio) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response | dict[str, Any]:
        state = _state()
        parsed = await _parsed(partial(_schema.parse_chat, settings=state.settings))
        return await _generation.respond(state, parsed, chat=True, access=g.access)

    @app.post("/v1/completions")
    async def completions() -> Response | dict[str, Any]:
        state = _state()
        parsed = await _parsed(partial(_schema.parse_completion, settings=state.settings))
        return await _generation.respond(state, parsed, chat=False, access=g.access)

    @app.post("/v1/embeddings")
    async def embeddings() -> dict[str, Any]:
        parsed = await _parsed(_embeddings.parse_embeddings)
        return await _embeddings.respond(_state(), parsed)

    @app.post("/v1/responses")
    async def responses() -> Response | dict[str, Any]:
        return await _responses.respond(_state(), await _body(), g.access)

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> dict[str, Any]:
        return _responses.stored(_state(), response_id)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return _responses.delete(_state(), response_id)

    @app.post("/v1/messages")
    async def messages() -> Response | dict[str, Any]:
        return await _anthropic.respond(_state(), await _body(), g.access)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens() -> dict[str, Any]:
        return await _anthropic.count_tokens(_state(), await _body())


def _model_card(
    state: ServerState,
    model_id: str,
    parent: str | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``/v1/models`` card; ``details``: what is known of the model (None: the state's
    engine's context length and input modalities)."""
    card: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "trio-mlx",
    }
    if parent is None:
        # What the model takes in: a vision model also images.
        card.update(model_card_fields(state.engine) if details is None else details)
    else:
        card["parent"] = parent
    return card


def _model_cards(state: ServerState) -> list[dict[str, Any]]:
    # Mounted adapters are models of their own: send their name as "model".
    names = [state.model_id, *state.listed_names]
    cards = [_model_card(state, name) for name in names] + [
        _model_card(state, name, parent=state.model_id) for name in state.engine.adapters
    ]
    router = _router()
    if router is None:
        return cards
    # With a host: its state first, and every other model it can load.
    infos = {info.name: info for info in router.host.models()}
    default = infos[router.host.default]
    for card in cards:
        if "parent" not in card:
            card["state"] = default.state.value
    for name, info in infos.items():
        if name != router.host.default:
            details = model_card_fields(router.host.loaded(name))
            cards.append({**_model_card(state, name, details=details), "state": info.state.value})
    return cards


def _router() -> ModelRouter | None:
    from quart import current_app

    router: ModelRouter | None = current_app.extensions.get("trio_mlx_host")
    return router


def _install_models(app: QuartTrio) -> None:
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": _model_cards(_state())}

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str) -> dict[str, Any]:
        state = _state()
        if model_id in state.listed_names:
            return _model_card(state, model_id)
        if model_id in state.model_names:
            return _model_card(state, state.model_id)
        if model_id not in state.engine.adapters and state.serves(model_id):  # a pattern's
            return _model_card(state, model_id)
        for card in _model_cards(state):
            if card["id"] == model_id:
                return card
        raise NotFound(
            f"the model {model_id!r} does not exist", param="model", code="model_not_found"
        )

    async def operate(model_id: str, load: bool) -> dict[str, Any]:
        router = _router()
        if router is None:
            raise InvalidRequest(
                "this server serves one model: start it with several --model, or --model-dir, "
                "to load and unload models",
                param="model",
                code="single_model",
            )
        if load:
            await router.host.load(model_id)
        else:
            await router.host.unload(model_id)
        info = next(i for i in router.host.models() if i.name == model_id)
        details = model_card_fields(router.host.loaded(model_id))
        return {**_model_card(_state(), model_id, details=details), "state": info.state.value}

    @app.post("/v1/models/<path:model_id>/load")
    async def load_model(model_id: str) -> dict[str, Any]:
        return await operate(model_id, load=True)

    @app.post("/v1/models/<path:model_id>/unload")
    async def unload_model(model_id: str) -> dict[str, Any]:
        return await operate(model_id, load=False)


def _adapter_path(settings: Settings, path: str) -> Path:
    """Resolve ``path`` inside ``--adapter-dir``; anything that escapes it is refused."""
    root = settings.adapter_dir
    if root is None:
        raise Forbidden(
            "mounting adapters is disabled: start the server with --adapter-dir",
            param="path",
            code="adapters_disabled",
        )
    if ".." in Path(path).parts:
        raise InvalidRequest("path must not contain '..'", param="path", code="invalid_path")
    root = root.resolve()
    # resolve() follows symlinks, so a link pointing out of the folder is caught too.
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise Forbidden(
            "path must be inside the server's adapter folder", param="path", code="path_outside"
        )
    if not resolved.is_dir():
        raise NotFound(f"no adapter folder {path!r} in the adapter folder", param="path")
    return resolved


def _install_adapters(app: QuartTrio) -> None:
    def card(state: ServerState, name: str) -> dict[str, Any]:
        return {"id": name, "object": "adapter", "path": state.adapter_paths.get(name)}

    @app.get("/v1/adapters")
    async def list_adapters() -> dict[str, Any]:
        state = _state()
        return {"object": "list", "data": [card(state, n) for n in state.engine.adapters]}

    @app.post("/v1/adapters")
    async def mount_adapter() -> Response:
        state = _state()
        mount = _schema.parse_adapter_mount(await _body())
        path = _adapter_path(state.settings, mount.path)
        await state.engine.mount_adapter(mount.name, str(path))
        root = state.settings.adapter_dir
        assert root is not None
        state.adapter_paths[mount.name] = str(path.relative_to(root.resolve()))
        return _json(card(state, mount.name), status=201)

    @app.delete("/v1/adapters/<name>")
    async def unmount_adapter(name: str) -> dict[str, Any]:
        state = _state()
        await state.engine.unmount_adapter(name)
        state.adapter_paths.pop(name, None)
        return {"id": name, "object": "adapter", "deleted": True}


def _install_tokens(app: QuartTrio) -> None:
    @app.post("/tokenize")
    async def tokenize() -> Response:
        state = _state()
        parsed = await _parsed(partial(_schema.parse_tokenize, settings=state.settings))
        (prompt,) = await resolve_prompts(state.engine, state.settings, (parsed.prompt,))
        tokens = await state.engine.tokenize(
            prompt, tools=parsed.tools, chat_template_kwargs=parsed.chat_template_kwargs
        )
        return await _off_loop_json(
            {"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.context_length}
        )

    @app.post("/detokenize")
    async def detokenize() -> dict[str, Any]:
        state = _state()
        # At most the context's worth of ids, as /tokenize gives: decoding holds
        # the GIL throughout (620 ms for 1.3M ids), so its size must be bounded.
        context = state.engine.context_length
        ids = await _parsed(
            partial(_schema.parse_detokenize, vocab_size=state.vocab_size),
            refuse_above=None if context is None else _ID_BYTES * context + 1024,
        )
        if context is not None and len(ids) > context:
            raise InvalidRequest(
                f"{len(ids)} token ids, more than the model's context of {context}",
                param="tokens",
                code="context_length_exceeded",
            )
        text = await trio.to_thread.run_sync(state.engine.tokenizer.decode, ids)
        return {"prompt": str(text)}


def _install_service(app: QuartTrio) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        state = _state()
        router = _router()
        if router is not None:  # a host: up while it runs, whichever models are loaded
            states = {info.name: info.state.value for info in router.host.models()}
            return {"status": "ok", "model": state.model_id, "models": states}
        if state.engine.closed:
            raise EngineClosed("the engine is closed")
        stats = state.engine.statistics()
        return {
            "status": "ok",
            "model": state.model_id,
            "state": stats.state,
            "running_rows": stats.running_rows,
            "queued_rows": stats.queued_rows,
            "ranks": stats.ranks,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(_state().metrics.render(), content_type=CONTENT_TYPE_LATEST)

    @app.route("/v1/v1/<path:rest>", methods=["GET", "POST", "DELETE"])
    async def doubled_prefix(rest: str) -> Response:
        # Anthropic's client adds /v1 itself; a base URL ending in /v1 lands here.
        host = request.host_url.rstrip("/")
        raise NotFound(
            f"no route /v1/v1/{rest:.80}: the base URL has /v1 twice. Anthropic's client "
            f"adds /v1 itself: give it {host}; OpenAI's clients take {host}/v1",
            code="wrong_base_url",
        )

    @app.get("/openapi.json")
    async def openapi_json() -> dict[str, Any]:
        return openapi(_state().model_id)
