"""The serial lane: one request alone on mlx-lm's ``generate_step`` (MLX thread only).

It serves what cannot batch: a fixed seed, a quantized KV cache, a LoRA
adapter, a model whose caches cannot merge, ``max_batch=1``; with images too (a
vision model's prompt goes through its encoder and into the cache first, as the
batch lane prefills it). It checks its cancellation flag between tokens (and
prefill chunks), so a cancelled request stops within one token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from trio_mlx._lanes.output import RowEvent, RowOutput
from trio_mlx._lanes.processors import make_row_sampler, row_processors
from trio_mlx._lanes.prompt_cache import PREFIX, PROMPT, PromptCache, held_tokens
from trio_mlx._lanes.records import RowSpec

__all__ = ["EMIT_INTERVAL", "run_serial"]

#: The longest a serial generation holds tokens back before sending them to Trio.
EMIT_INTERVAL = 0.002


def run_serial(
    model: Any,
    tokenizer: Any,
    spec: RowSpec,
    *,
    cancelled: threading.Event,
    emit: Callable[[list[RowEvent]], None],
    prompt_cache: PromptCache | None = None,
    cache_key: Hashable = "base",
    on_cached: Callable[[int], None] | None = None,
    agree: Callable[[bool], bool] | None = None,
    vision: Any = None,
) -> tuple[bool, int]:
    """Generate ``spec`` to its end, emitting its events in small batches.

    The first token goes out at once; later ones are sent at most every
    ``EMIT_INTERVAL`` seconds (and at the end), so the Trio loop is woken a few
    hundred times a second, not once per token.

    ``agree`` is asked after every token whether the generation goes on and
    its answer is followed (distributed ranks follow rank 0's: only rank 0
    sees cancellations).

    ``vision`` (a vision model's :class:`~trio_mlx._start.vision.Vision`) prefills a
    prompt with images (``spec.images``).

    Returns (whether it was cancelled, prompt tokens served from the cache).
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    params = spec.params
    if params.seed is not None:
        mx.random.seed(params.seed)
    prompt = list(spec.prompt)
    # A quantized KV cache serves only requests quantized alike.
    key: Hashable = cache_key
    if params.kv_bits is not None:
        key = (cache_key, "kv", params.kv_bits, params.kv_group_size)
    cache, rest = None, prompt
    if spec.images is not None:
        # A quantized cache or an adapter's is not what the images' entries hold.
        plain = params.kv_bits is None and params.adapter is None
        store = prompt_cache if plain else None
        key = (cache_key, "images", spec.images.digests)
        prefilled = _prefill_images(vision, spec, store, key, cancelled)
        if prefilled is None:
            return True, 0
        cache, rest, cached = prefilled
        prompt_cache = store
    elif prompt_cache is not None:
        cache, rest = prompt_cache.fetch(key, prompt)
    if cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
    if spec.images is None:
        cached = len(prompt) - len(rest)
    if on_cached is not None:
        on_cached(cached)
    progress = None
    if spec.images is None and (
        prompt_cache is not None and (prompt_cache.disk is not None or _checkpoints(cache))
    ):
        rest = _prefill_prefix(model, spec, rest, cache, prompt_cache, key)
        progress = _prompt_checkpoint(prompt, len(rest), cache, prompt_cache, key)
    output = RowOutput(spec.id, params, frozenset(tokenizer.eos_token_ids), tokenizer.detokenizer)
    generated: list[int] = []
    steps = generate_step(
        mx.array(rest),
        model,
        max_tokens=params.max_tokens,
        sampler=make_row_sampler(params, tokenizer),
        logits_processors=row_processors(spec, sorted(tokenizer.eos_token_ids)) or None,
        prompt_cache=cache,
        kv_bits=params.kv_bits,
        kv_group_size=params.kv_group_size,
        quantized_kv_start=0,
        prompt_progress_callback=progress,
    )
    pending: list[RowEvent] = []
    last_emit = -EMIT_INTERVAL
    for token, logprobs in steps:
        generated.append(int(token))
        event = output.push(int(token), logprobs, None)
        finished = event.finish_reason is not None
        go_on = not finished and not cancelled.is_set()
        if agree is not None:
            go_on = agree(go_on)
        if not go_on and not finished:
            # Cancelled (on rank 0, seen by every rank): the cache is not kept.
            return True, cached
        pending.append(event)
        now = time.perf_counter()
        if finished or now - last_emit >= EMIT_INTERVAL:
            emit(pending)
            pending = []
            last_emit = now
        if not go_on:
            break
    if prompt_cache is not None:
        tokens = prompt + generated
        held = held_tokens(cache, len(tokens))
        if 0 < held <= len(tokens):
            prompt_cache.store(key, tokens[:held], cache)
    return False, cached


def _prefill_images(
    vision: Any, spec: RowSpec, store: PromptCache | None, key: Hashable, cancel: threading.Event
) -> tuple[list[Any], list[int], int] | None:
    """A prompt with images in a cache, as the batch lane's image prefill makes it: what
    the prompt cache serves, the rest through the encoder and the language model a
    chunk at a time. Returns the cache, the tokens left to feed and the prompt tokens
    the prompt cache served; None: cancelled."""
    if vision is None:  # the engine refuses images for a text model before this
        raise RuntimeError("a prompt with images for a model without a vision side")
    prompt = list(spec.prompt)
    found = vision.start(prompt, spec.images, store, key, 1)
    if isinstance(found, tuple):
        cache, rest = found
        return cache, rest, len(prompt) - len(rest)
    vision.embed(found)
    while found.left:
        if cancel.is_set():
            return None
        vision.advance(found, 2048)
    cache, rest = vision.finish(found, store)
    return cache, rest, found.start


def _checkpoints(cache: list[Any]) -> bool:
    """Whether a prefill over ``cache`` keeps checkpoints: where it may become
    untrimmable (see ``BatchLane.prompt_checkpoints``)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    return any(type(c) not in (KVCache, QuantizedKVCache) for c in cache)


def _prefill_prefix(
    model: Any,
    spec: RowSpec,
    rest: list[int],
    cache: list[Any],
    prompt_cache: PromptCache,
    key: Hashable,
    step: int = 2048,
) -> list[int]:
    """Prefill up to the stable prefix (as ``generate_step`` prefills, in
    ``step``-token chunks) and keep it; returns the tokens left to prefill."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache

    prompt, stable, params = list(spec.prompt), spec.checkpoint, spec.params
    done = len(prompt) - len(rest)
    if stable is None or not done < stable < len(prompt) - 1:
        return rest
    for start in range(done, stable, step):
        model(mx.array(prompt[start : min(stable, start + step)])[None], cache=cache)
        maybe_quantize_kv_cache(cache, 0, params.kv_group_size, params.kv_bits)  # type: ignore[no-untyped-call]
        mx.eval([c.state for c in cache])
    prompt_cache.checkpoint(key, prompt[:stable], cache, PREFIX)
    return prompt[stable:]


def _prompt_checkpoint(
    prompt: list[int], rest: int, cache: list[Any], prompt_cache: PromptCache, key: Hashable
) -> Callable[[int, int], None]:
    """``generate_step``'s progress callback that keeps the cache once it holds
    all but the prompt's last token (which the first decode step takes)."""

    def progress(done: int, total: int) -> None:
        if done == total - 1 and total == rest and done > 0:
            prompt_cache.checkpoint(key, prompt[:-1], cache, PROMPT)

    return progress
