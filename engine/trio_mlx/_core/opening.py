"""Opening an engine: the MLX thread started (or shared), the model loaded, the actor run.

:func:`open_engine` is the public way in; :func:`open_on` opens an engine on a
worker thread another owner holds (a :class:`~trio_mlx.ModelHost`'s engines share
one), which gives the model's memory back with :func:`free_memory` once the engine
is closed and unreferenced.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from trio_mlx._adapters.registry import AdapterRegistry
from trio_mlx._core import embedding as _embedding
from trio_mlx._core.actor import Actor
from trio_mlx._core.arbiter import ArbiterPolicy
from trio_mlx._core.engine import Engine
from trio_mlx._core.planner import StepPlanner
from trio_mlx._core.request import Request
from trio_mlx._core.worker import Worker
from trio_mlx._errors import InvalidRequest
from trio_mlx._lanes.embed import EmbedLane
from trio_mlx._lanes.output import RowEvent
from trio_mlx._lanes.serial import run_serial
from trio_mlx._memory import KVBudget
from trio_mlx._start.loading import Loaded, load, load_error, resolve_model
from trio_mlx._start.settings import EngineSettings

__all__ = ["free_memory", "open_engine", "open_on"]


def free_memory() -> None:
    """On the MLX thread: collect unreachable arrays and empty MLX's buffer cache.

    Objects a program froze (``gc.freeze()``: the server freezes what start-up made,
    a model loaded by then included) are out of the collector's reach, so they are
    thawed for this collection and what survives it is frozen again: one full
    collection per engine closed (about 0.1 s over a served model's million objects).
    """
    import mlx.core as mx

    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    mx.clear_cache()


@asynccontextmanager
async def open_engine(
    model: str | os.PathLike[str] | None = None,
    settings: EngineSettings | None = None,
    **overrides: Any,
) -> AsyncIterator[Engine]:
    """Load a model on a dedicated MLX thread and serve it for the block's duration.

    ``model`` is a model directory (or a Hugging Face repo id mlx-lm can load);
    ``None`` means the bundled default model. ``settings`` (an
    :class:`~trio_mlx.EngineSettings`; default: every setting's default) says how
    the engine runs; keyword arguments override single settings, so
    ``open_engine(path, max_batch=16)`` is ``open_engine(path, EngineSettings(max_batch=16))``.
    A bad value raises :class:`~trio_mlx.InvalidRequest` naming the setting.

    The settings: ``adapter_path`` fuses a LoRA
    adapter into the base model. ``max_batch`` rows decode together;
    ``max_queue`` bounds the waiting requests (past it, submission raises
    :class:`~trio_mlx.EngineOverloaded`). A request that cannot batch waits at
    most ``drain_timeout`` seconds for the batch to drain before the running
    rows are parked (``None``: wait for them to finish). ``prompt_cache_bytes``
    caps the prompt cache (0 disables it; ``None``, the default: a fifth of
    MLX's memory limit less the weights, at least 256 MiB; 256 MiB in distributed mode, where
    every rank must evict alike). ``prompt_cache_dir`` adds its disk
    tier: checkpoints of long prompts kept in that folder across restarts, at
    most ``prompt_cache_disk_bytes`` bytes of them (``None``, the default: no
    disk tier; see ``design/engine.md``). ``prefill_step_size`` and
    ``prefill_batch_size`` are mlx-lm's: prompt tokens per prefill chunk, and
    prompts prefilled together. ``prefill_budget`` bounds the prompt tokens
    (padded) prefilled between two decode steps: a longer prompt is prefilled
    a chunk per step, so running streams keep their pace while it arrives
    (``None``: 1,536 on a GPU, 512 on the CPU; see ``design/performance.md``).
    ``long_prompt_chunk`` is the chunk a longer prompt is cut into when it is
    smaller than the budget: such a prompt is prefilled alone, that many
    tokens a step, and while it waits or prefills no pass holds more; with
    none about, or while the other prompts waiting hold more than the budget,
    prompts share passes of up to the budget (``None``, the default: no such
    chunk; it smooths the streams around a rare long prompt and costs TTFT
    when many prompts are long: ``design/performance.md``).
    ``prefill_stall`` bounds a long prompt's stall in time: while rows decode,
    each step's chunk is sized from the measured step times so that a step
    that prefills one prompt's chunk takes about ``prefill_stall`` times a
    decode-only step (> 1; at most ``prefill_budget`` tokens; ``None``: chunks
    of the fixed budget).
    ``parallel`` only matters when the process was started by ``mlx.launch``
    as one of several ranks (see ``design/distributed.md``): ``"tensor"`` or
    ``"pipeline"`` forces how the model is split, ``"auto"`` lets mlx-lm
    choose (tensor where the architecture supports it). ``chat_template``
    (Jinja text) replaces the model's chat template, as
    ``mlx_lm.server --chat-template`` does.
    ``grammar_timeout`` bounds how many seconds a request's JSON schema, regex
    or grammar may take to compile (in a worker thread) before the request is
    refused with :class:`~trio_mlx.InvalidGrammar`; two compile at once, and
    a compile past its deadline gives up its slot at once (llguidance cannot
    stop it: at most four such abandoned compiles may run, then new ones are
    refused with :class:`~trio_mlx.EngineOverloaded` until one ends).
    ``grammar_cache_bytes`` bounds the compiled grammars kept for reuse, by
    their estimated size (0 keeps none).
    ``max_unread_tokens`` bounds what one request buffers for a reader that
    does not read: past that many unread tokens (each top log-probability
    alternative counting as one more) the request is cancelled and its stream
    raises :class:`~trio_mlx.ReaderStalled` (``None``: no bound).
    ``max_loras`` bounds the adapters mounted at once (a mount past it raises
    :class:`~trio_mlx.AdapterConflict`; ``None``: no bound).
    ``kv_memory_bytes`` is what the rows' KV caches may hold at worst (each
    counting its prompt plus ``max_tokens``): a row waits in the queue until it
    fits beside the running ones, a request too large to fit alone is refused
    with :class:`~trio_mlx.InvalidRequest`, and ``max_tokens`` is cut to the
    room one request has (``None``: half of MLX's memory limit less the weights,
    less ``prompt_cache_bytes``; see ``design/engine.md``).
    A vision-language model (a folder whose config has a ``vision_config``; the
    ``vision`` extra) takes images in chats (:class:`~trio_mlx.ImageInput` parts);
    ``max_image_pixels`` bounds each image's width x height.
    The remaining settings tune the scheduler's inner bounds (burst length,
    grouped admission, row removal, traced decode, a decision hook for tests);
    :class:`~trio_mlx.EngineSettings` says what each does.

    Leaving the block stops admission, lets in-flight work finish within
    ``grace_period`` seconds, ends the rest with
    :class:`~trio_mlx.EngineClosed` and joins the MLX thread.
    """
    async with open_on(None, model, _settings(settings, overrides)) as engine:
        yield engine


@asynccontextmanager
async def open_on(
    worker: Worker | None, model: str | os.PathLike[str] | None, settings: EngineSettings
) -> AsyncIterator[Engine]:
    """:func:`open_engine` on ``worker``, an MLX thread the caller started and
    stops (``None``: a thread of the engine's own). Engines sharing a worker
    take turns on it, one call at a time."""
    try:
        policy = ArbiterPolicy(
            max_batch=settings.max_batch,
            max_queue=settings.max_queue,
            drain_timeout=settings.drain_timeout,
            min_batch_steps=settings.min_batch_steps,
        )
    except (TypeError, ValueError) as invalid:  # attrs' validators: name the argument
        message = str(invalid.args[0]) if invalid.args else str(invalid)
        named = re.match(r"'(\w+)'", message)
        raise InvalidRequest(message, param=named.group(1) if named else None) from invalid
    path = resolve_model(model)
    settings = await _embedding.with_pooling(settings, path)
    loader = partial(load, path, settings)
    # Errors of the start and of the body are re-raised as themselves, not
    # wrapped in the nursery's ExceptionGroup.
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            engine: Engine = await nursery.start(
                _serve,
                policy,
                Path(path).name,
                loader,
                settings,
                worker,
            )
        except Exception as exc:
            error = load_error(path, exc) or exc
        else:
            try:
                yield engine
            except BaseException as exc:
                error = exc
            finally:
                # Cancelled from outside: no grace, end the work now.
                grace = 0.0 if isinstance(error, trio.Cancelled) else settings.grace_period
                with trio.CancelScope(shield=True):
                    await engine._shutdown(grace)
    if error is not None:
        raise error


async def _serve(
    policy: ArbiterPolicy,
    model_id: str,
    load: Callable[[], Loaded],
    settings: EngineSettings,
    shared: Worker | None,
    *,
    task_status: trio.TaskStatus[Engine],
) -> None:
    """The engine's one long-lived task: start the thread, load, then run the actor."""
    worker = Worker() if shared is None else shared
    if shared is None:
        worker.start()
    unwatch: Callable[[], None] = lambda: None  # noqa: E731
    try:
        loaded = await worker.run(load)
        registry = AdapterRegistry(max_loras=settings.max_loras)
        loaded.lane.adapter_stack = lambda: registry.stack
        limit = settings.kv_memory_bytes
        budget = KVBudget(loaded.kv_profile, loaded.kv_default if limit is None else limit)
        actor = Actor(
            attrs.evolve(policy, memory=budget),
            worker,
            loaded.lane,
            _planner(settings, loaded),
            serial_work=partial(_serial_work, loaded, registry),
            adapters=lambda: registry.names,
            decision_hook=settings.decision_hook,
            max_unread=settings.max_unread_tokens,
            embedder=EmbedLane(loaded.model, settings.embedding_pooling or "last"),
        )
        engine = Engine(model_id, loaded, registry, actor, settings)
        engine.grammar_timeout = float(settings.grammar_timeout)
        engine.grammar_cache_bytes = settings.grammar_cache_bytes
        engine.max_image_pixels = settings.max_image_pixels
        unwatch = worker.watch(actor.on_worker_death)
        try:
            async with trio.open_nursery() as nursery:
                if loaded.leader is not None:  # distributed rank 0: watchdog and heartbeat
                    actor.ranks = loaded.leader.ranks
                    loaded.leader.attach(nursery, worker, actor.close_nowait)
                await actor.run(engine, task_status=task_status)
                nursery.cancel_scope.cancel()
        finally:
            # KV caches are MLX arrays: free them on the thread that made them.
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await worker.run(loaded.lane.close)
    finally:
        unwatch()
        # A shared worker's owner gives the memory back (``free_memory``) once it holds
        # no reference to the engine: here the caller's block still does.
        if shared is None:
            with trio.CancelScope(shield=True):
                await worker.stop()


def _settings(settings: EngineSettings | None, overrides: Mapping[str, Any]) -> EngineSettings:
    """``settings`` (default: every default) with the keyword ``overrides`` applied."""
    if settings is not None and not isinstance(settings, EngineSettings):
        raise TypeError(f"settings must be an EngineSettings, not {type(settings).__name__}")
    unknown = sorted(set(overrides) - set(attrs.fields_dict(EngineSettings)))
    if unknown:
        raise TypeError(f"open_engine() got unexpected keyword arguments: {', '.join(unknown)}")
    return attrs.evolve(settings, **overrides) if settings else EngineSettings(**overrides)


def _planner(settings: EngineSettings, loaded: Loaded) -> StepPlanner:
    """The actor's step planner, bounded by ``settings`` and reading the lane's caps live."""
    lane = loaded.lane
    return StepPlanner(
        lambda: lane.prefill_batch_size,
        lambda: lane.prefill_budget,
        burst_steps=settings.burst_steps,
        burst_seconds=settings.burst_seconds,
        # The CPU admits arrivals at once (see Loaded.grouping).
        admit_group=settings.admit_group or (16 if loaded.grouping else 1),
        admit_fraction=settings.admit_fraction,
        admit_wait_steps=settings.admit_wait_steps,
        admit_wait_seconds=settings.admit_wait_seconds,
        prefill_stall=settings.prefill_stall,
        prefill_floor=settings.prefill_floor,
        timing_lag=settings.timing_lag,
        embed_share=settings.embedding_share,
        embed_tokens=settings.embedding_batch_tokens,
    )


def _serial_work(
    loaded: Loaded,
    registry: AdapterRegistry,
    request: Request,
    emit: Callable[[list[RowEvent]], None],
    on_cached: Callable[[int], None],
) -> Callable[[], Any]:
    """The worker-side callable of a serial generation (the actor runs it as a job)."""
    spec = request.spec
    assert spec is not None

    run = partial(
        run_serial,
        loaded.model,
        loaded.tokenizer,
        spec,
        cancelled=request.cancel_flag,
        emit=emit,
        on_cached=on_cached,
        vision=loaded.vision,
    )

    def work() -> Any:
        adapter = spec.params.adapter
        if adapter is None:
            return run(prompt_cache=loaded.prompt_cache)
        with registry.use(loaded.model, adapter):
            return run()

    leader = loaded.leader
    if leader is None:
        return work
    # Distributed: the followers run the same generation (no adapters there).
    return partial(leader.run_serial, spec, partial(run, prompt_cache=loaded.prompt_cache))
