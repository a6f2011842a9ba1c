"""``Engine.embed`` and its work on the Trio side: check, tokenize, submit, gather.

The request goes to the actor as one row of :attr:`~trio_mlx._core.gate.LaneName.EMBED`
(see ``design/engine.md``, "Embeddings"); this module checks it first and turns
the vectors that came back into :class:`~trio_mlx.Embeddings`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from trio_mlx._core.actor import Actor
from trio_mlx._core.embedder import (
    EmbedWork,
    check_dimensions,
    configured_pooling,
    embed_tokens,
    finish,
)
from trio_mlx._core.gate import LaneName
from trio_mlx._core.prompts import PromptEncoder
from trio_mlx._core.request import Request, failure
from trio_mlx._errors import EngineClosed, InvalidRequest
from trio_mlx._lanes.embed import hidden_model
from trio_mlx._params import Embeddings
from trio_mlx._start.loading import Loaded
from trio_mlx._start.settings import EngineSettings

__all__ = ["EmbeddingAPI", "embed", "pooling", "with_pooling"]

#: Embedding results with more floats than this are built in a thread.
_INLINE_FLOATS = 65_536


def pooling(loaded: Loaded, settings: EngineSettings) -> str | None:
    """How the engine pools embeddings (None: it serves none)."""
    if loaded.channel is not None or hidden_model(loaded.model) is None:
        return None
    return settings.embedding_pooling


async def embed(
    actor: Actor,
    loaded: Loaded,
    settings: EngineSettings,
    tokenize: Callable[[Any], Awaitable[list[int]]],
    inputs: Any,
    dimensions: int | None,
) -> Embeddings:
    """Check the request, submit it as one EMBED row and wait for its vectors."""
    if pooling(loaded, settings) is None:
        raise InvalidRequest(
            "this model serves no embeddings: "
            + (
                "it configures no pooling (start the engine with embedding_pooling)"
                if hidden_model(loaded.model) is not None
                else "mlx-lm's model has no inner transformer (model.model) to pool"
            ),
            param="model",
            code="embeddings_unsupported",
        )
    hidden = loaded.config.get("hidden_size")
    width = hidden if isinstance(hidden, int) else None
    check_dimensions(dimensions, supported=settings.embedding_matryoshka, width=width)
    tokens = await embed_tokens(inputs, settings.max_embedding_inputs, tokenize)
    if actor.closed:
        raise EngineClosed("the engine is closed")
    request_id = actor.new_id()
    work = EmbedWork(request_id, tuple(tuple(t) for t in tokens))
    request = Request(request_id, LaneName.EMBED, embed=work)
    await actor.submit(request)
    try:
        await request.done.wait()
    except BaseException:
        actor.cancel_nowait(request)
        raise
    for event in request.outbox.take():
        if event.error is not None:
            raise failure(event.error)
    if not work.complete:
        raise EngineClosed("the engine closed before the embeddings were computed")

    def build() -> Embeddings:
        vectors = tuple(tuple(finish(v, dimensions).tolist()) for v in work.vectors)
        return Embeddings(vectors, tuple(len(t) for t in tokens))

    # Thousands of wide vectors become floats in a thread, off the event loop.
    large = len(work.vectors) * len(work.vectors[0]) > _INLINE_FLOATS
    return await trio.to_thread.run_sync(build) if large else build()


async def with_pooling(settings: EngineSettings, path: str) -> EngineSettings:
    """``settings`` with the pooling the model folder configures, unless one is set
    (a Hub id has no folder: none is read)."""
    if settings.embedding_pooling is not None:
        return settings
    found = await trio.to_thread.run_sync(configured_pooling, path)
    return attrs.evolve(settings, embedding_pooling=found)


class EmbeddingAPI:
    """``Engine``'s embeddings methods (a base class, so the engine module stays small)."""

    _actor: Actor
    _loaded: Loaded
    _settings: EngineSettings
    _prompts: PromptEncoder

    def _refuse_distributed(self, what: str, param: str | None = None) -> None:
        raise NotImplementedError  # the engine's

    @property
    def embedding_pooling(self) -> str | None:
        """How :meth:`embed` pools (``last``, ``mean``, ``cls``); None: no embeddings."""
        return pooling(self._loaded, self._settings)

    async def embed(
        self, inputs: Sequence[str | Sequence[int]], *, dimensions: int | None = None
    ) -> Embeddings:
        """Embed each input (text, or token ids): its pooled final hidden state, unit length.

        The request is one row to the arbiter; its inputs go several per padded
        pass, which take at most ``embedding_share`` of the MLX thread's time
        while chat rows decode. ``dimensions`` keeps the first that many values,
        normalized again (only with ``embedding_matryoshka``). Raises
        :class:`~trio_mlx.InvalidRequest` (``param="input"``) for no inputs, more
        than ``max_embedding_inputs``, an empty, over-long or mistyped input, and
        ``embeddings_unsupported`` when the model has no pooling configured.
        """
        self._refuse_distributed("embeddings", "input")
        return await embed(
            self._actor, self._loaded, self._settings, self._embed_input, inputs, dimensions
        )

    async def _embed_input(self, item: str | Sequence[int]) -> list[int]:
        return list((await self._prompts.tokenize(item, None, None)).tokens)
