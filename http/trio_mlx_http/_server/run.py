"""What ``trio-mlx serve`` and ``trio-mlx generate`` run, inside ``trio.run``."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from hypercorn.config import Config
from quart_trio import QuartTrio

import trio_mlx
from trio_mlx_http._fast_blas import HINT
from trio_mlx_http._server import serve as _serve
from trio_mlx_http._server.app import create_app, shutdown_trigger
from trio_mlx_http._server.serve import ConnectionGuard, ConnectionLimits
from trio_mlx_http._server.startup import bound_socket
from trio_mlx_http._server.state import ServerState
from trio_mlx_http._settings import Settings

__all__ = ["generate", "serve", "serve_http"]

logger = logging.getLogger("trio_mlx_http")


def _engine_settings(args: argparse.Namespace) -> trio_mlx.EngineSettings:
    """The engine's settings from the command line's flags (each unset flag: its default)."""
    options: dict[str, Any] = {"adapter_path": args.adapter_path}
    for name in (
        "max_batch",
        "max_queue",
        "drain_timeout",
        "parallel",
        "prompt_cache_bytes",
        "kv_memory_bytes",
        "prompt_cache_dir",
        "prompt_cache_disk_bytes",
        "grammar_timeout",
        "grammar_cache_bytes",
        "max_loras",
        "prefill_budget",
        "long_prompt_chunk",
        "prefill_stall",
        "embedding_pooling",
        "embedding_matryoshka",
        "embedding_share",
        "max_embedding_inputs",
        "prompt_lookup",
        "draft_model",
        "num_draft_tokens",
        "speculation_max_batch",
        "max_image_pixels",
    ):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    template = _chat_template(getattr(args, "chat_template", None))
    if template is not None:
        options["chat_template"] = template
    if getattr(args, "prompt_concurrency", None) is not None:
        # mlx_lm.server's name for how many prompts are prefilled together.
        options["prefill_batch_size"] = args.prompt_concurrency
    return trio_mlx.EngineSettings(**options)


def _chat_template(template: str | None) -> str | None:
    """``--chat-template``: Jinja text, or the path of a file holding it."""
    if template is None:
        return None
    path = Path(template)
    return path.read_text() if len(template) < 4096 and path.is_file() else template


def model_names(model: str | None, served: list[str] | None) -> tuple[str | None, tuple[str, ...]]:
    """The listed model name and the other names it answers to.

    A Hugging Face repo id (``mlx-community/X``) is listed as given, a local
    folder by its name; both forms are accepted, and so is every
    ``--served-model-name`` (the first of them is then the listed one).
    """
    names: list[str] = list(served or [])
    if model is not None:
        local = Path(model).exists()
        last = Path(model).name
        names += [last, model] if local else [model, last]
    if not names:
        return None, ()
    return names[0], tuple(dict.fromkeys(names[1:]))


def _reasoning_markers(text: str | None) -> tuple[str, str] | bool | None:
    """``--reasoning-markers``: None (the tokenizer's), False (off), or (start, end)."""
    if text is None:
        return None
    if text.strip().lower() == "off":
        return False
    start, _, end = text.partition(",")  # checked by the argument parser
    return start, end


def settings_from(args: argparse.Namespace) -> Settings:
    """The server settings the flags ask for."""
    name, aliases = model_names(args.model, args.served_model_name)
    return Settings(
        model_name=name,
        model_aliases=aliases,
        served_model_names=args.served_model_name or (),
        sse_keepalive=args.sse_keepalive or None,
        chat_template_args=args.chat_template_args,
        reasoning_markers=_reasoning_markers(args.reasoning_markers),
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        api_key=args.api_key,
        adapter_dir=args.adapter_dir,
        max_body_bytes=args.max_body_bytes,
        allow_image_urls=getattr(args, "allow_image_urls", False),
        max_images=getattr(args, "max_images", 8),
        max_image_bytes=getattr(args, "max_image_bytes", 20 * 1024 * 1024),
        image_fetch_timeout=getattr(args, "image_fetch_timeout", 10.0),
        cors_origin=args.cors_origin,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
    )


def hypercorn_config(host: str, port: int, graceful_timeout: float) -> Config:
    """Hypercorn's config: one bind, our own access log, a graceful deadline."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = graceful_timeout
    config.accesslog = None  # the app logs one line per request, with token counts
    config.errorlog = logging.getLogger("hypercorn.error")  # through our logging setup, once
    return config


#: After a second signal: seconds the ends of cut streams (an error event and
#: ``[DONE]``, a few hundred bytes) get to leave before every write is aborted.
_SECOND_SIGNAL_FLUSH = 1.0


@attrs.define(eq=False)
class _Stopping:
    """What the signal task needs to stop the server, filled in as it starts."""

    #: The scope of everything but the signal receiver (start-up included).
    body: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    shutdown: trio.Event = attrs.field(factory=trio.Event)
    #: The engines to close on a second signal (None: not serving yet).
    engines: Callable[[], Sequence[trio_mlx.Engine]] | None = None
    guard: ConnectionGuard | None = None
    #: Set when a signal came before the server was serving.
    interrupted: bool = False


async def _on_signals(signals: Any, stopping: _Stopping) -> None:
    """First SIGINT/SIGTERM: stop accepting and drain; the second: end streams now.

    The receiver stays open until the process ends, so no signal ever raises
    ``KeyboardInterrupt`` in the middle of the shutdown (a third is only logged).
    """
    count = 0
    async for signum in signals:
        count += 1
        name = signal.Signals(signum).name
        engines = stopping.engines
        if engines is None:
            logger.info("%s during start-up: stopping", name)
            stopping.interrupted = True
            stopping.body.cancel()
        elif count == 1:
            logger.info("%s: no new requests; in-flight ones may finish", name)
            stopping.shutdown.set()
        elif count == 2:
            logger.warning("second %s: ending in-flight requests now", name)
            stopping.shutdown.set()
            # Every stream ends with an error event and [DONE]; non-streaming
            # requests answer 503. Then whatever still hangs is cut.
            for engine in engines():
                engine.close()
            await trio.sleep(_SECOND_SIGNAL_FLUSH)
            if stopping.guard is not None:
                stopping.guard.abort_writes()
            stopping.body.cancel()
        else:
            logger.info("%s: already stopping", name)


async def _close_at_deadline(
    engines: Callable[[], Sequence[trio_mlx.Engine]], shutdown: trio.Event, graceful_timeout: float
) -> None:
    """Just before Hypercorn's graceful deadline, end what still runs with a clean error.

    Hypercorn cancels the handlers at its deadline, which drops their
    connections mid-answer; closing the engines a little earlier lets each
    request answer 503 or end its stream with an error event first.
    """
    await shutdown.wait()
    await trio.sleep(max(0.0, graceful_timeout - min(0.5, graceful_timeout / 4)))
    left = 0
    for engine in engines():
        pending = engine.statistics()
        left += pending.running_rows + pending.queued_rows + pending.parked_rows
        left += pending.waiting_jobs + pending.running_jobs
    if left:
        logger.warning("graceful deadline: ending %d unfinished requests with an error", left)
    for engine in engines():
        engine.close()


def limits_from(args: argparse.Namespace) -> ConnectionLimits:
    """The connection limits the flags ask for."""
    return ConnectionLimits(max_connections=args.max_connections, write_timeout=args.write_timeout)


async def serve_http(
    app: QuartTrio,
    config: Config,
    guard: ConnectionGuard,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown`` is set and in-flight requests are drained."""
    state: ServerState = app.extensions["trio_mlx"]
    state.metrics.watch_connections(guard.statistics)
    await _serve.serve(
        app,
        config,
        guard,
        shutdown_trigger=shutdown_trigger(app, shutdown),
        task_status=task_status,
    )


async def _http(
    app: QuartTrio,
    config: Config,
    guard: ConnectionGuard,
    shutdown: trio.Event,
    done: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until the shutdown trigger, in-flight requests drained; then end ``done``."""
    await serve_http(app, config, guard, shutdown, task_status=task_status)
    done.cancel()


async def serve(args: argparse.Namespace, *, blas_hint: bool = False) -> int:
    """Open the engine, serve HTTP until a signal, shut down gracefully.

    Exit status 0 after a shutdown by signal; 130 when a signal came before
    the server was serving. ``blas_hint``: print the reference-BLAS install
    hint once serving.
    """
    stopping = _Stopping()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_on_signals, signals, stopping)
            with stopping.body:
                await _serve_until_stopped(args, stopping, blas_hint)
            nursery.cancel_scope.cancel()
    if stopping.interrupted:
        return 130
    logger.info("stopped")
    return 0


async def _serve_until_stopped(
    args: argparse.Namespace, stopping: _Stopping, blas_hint: bool
) -> None:
    settings = settings_from(args)
    config = hypercorn_config(args.host, args.port, args.graceful_timeout)
    # The port first: a busy one fails in a moment, not after minutes of model loading.
    async with (
        bound_socket(args.host, args.port) as listener,
        _open_served(args) as (served, engines),
    ):
        config.bind = [f"fd://{listener.detach()}"]  # Hypercorn owns the socket from here
        # After the engine: loading mlx-lm lowers the fd limit (to 2,048 of 4,096).
        guard = ConnectionGuard(limits_from(args).fitted(_serve.raise_fd_limit()))
        app = create_app(served, settings)
        # What start-up made (the model, mlx-lm, transformers: about a million objects)
        # lives as long as the process: out of the collector's reach, a full collection
        # walks only what requests made. It ran 94-118 ms per collection otherwise,
        # holding the GIL (and the event loop) while a large body was parsed in a thread.
        gc.freeze()
        shutdown = stopping.shutdown
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_close_at_deadline, engines, shutdown, args.graceful_timeout)
            binds = await nursery.start(_http, app, config, guard, shutdown, nursery.cancel_scope)
            stopping.engines, stopping.guard = engines, guard
            _tell_backend(blas_hint)
            names = served.names if isinstance(served, trio_mlx.ModelHost) else (served.model_id,)
            logger.info("serving %s on %s", ", ".join(names), ", ".join(binds))


def hosted(args: argparse.Namespace) -> bool:
    """Whether the flags ask for a model host (several models, or loading on demand)."""
    flags = ("model_dir", "max_models", "max_model_memory", "idle_unload")
    return len(getattr(args, "models", ())) > 1 or any(
        getattr(args, name, None) is not None for name in flags
    )


@asynccontextmanager
async def _open_served(
    args: argparse.Namespace,
) -> AsyncIterator[
    tuple[trio_mlx.Engine | trio_mlx.ModelHost, Callable[[], Sequence[trio_mlx.Engine]]]
]:
    """The engine the flags ask for, or a model host; and how to reach its engines."""
    if not hosted(args):
        async with trio_mlx.open_engine(args.model, _engine_settings(args)) as engine:
            yield engine, lambda: (engine,)
        return
    async with trio_mlx.open_host(
        args.models or None,
        model_dir=args.model_dir,
        max_models=args.max_models,
        max_model_memory=args.max_model_memory,
        idle_unload=args.idle_unload,
        load_timeout=args.load_timeout,
        settings=_engine_settings(args),
    ) as host:
        yield host, host.engines


def _tell_backend(blas_hint: bool) -> None:
    """Which BLAS serves MLX, once serving: a start-up error is told without it."""
    backend = trio_mlx.backend_info()
    level = logging.WARNING if backend.blas == "reference" else logging.INFO
    logger.log(level, "%s", backend.describe())
    if blas_hint:
        print(HINT, file=sys.stderr)


async def generate(args: argparse.Namespace, *, blas_hint: bool = False) -> int:
    """Generate one completion, streaming its text to stdout.

    ``blas_hint``: print the reference-BLAS install hint once the model has loaded.
    """
    async with trio_mlx.open_engine(args.model, _engine_settings(args)) as engine:
        if blas_hint:
            print(HINT, file=sys.stderr)
        prompt: Any = args.prompt
        if not args.raw and engine.tokenizer.has_chat_template:
            prompt = [{"role": "user", "content": args.prompt}]
            if args.system:
                prompt.insert(0, {"role": "system", "content": args.system})
        params = trio_mlx.SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
        )
        try:
            async with engine.generate(prompt, params) as stream:
                async for delta in stream:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                result = stream.result
        except trio_mlx.TrioMLXError as error:
            print(f"\nerror: {error.message}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        tps = result.completion_tokens / result.duration if result.duration else 0.0
        print(
            f"[{result.prompt_tokens} prompt tokens, {result.completion_tokens} generated, "
            f"{tps:.1f} tokens/s, finish: {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0
