"""Embeddings on the MLX thread: a padded, masked prefill-only pass, pooled per input.

A step's :class:`~trio_mlx._lanes.records.EmbedInput`\\ s run as one forward
pass of the model's inner transformer (``model.model``: the final hidden
states after its last norm, before the vocabulary projection), left-padded to
the longest input. Where every layer's cache is a plain ``KVCache``, the pass
uses mlx-lm's ``BatchKVCache`` with the inputs' left padding, so its attention
mask hides the padding exactly as a decode batch's does; a model with other
cache kinds (sliding windows, recurrent state) runs its inputs one per pass.
Pooling (``last``, ``mean``, ``cls``) reads the hidden states of the real
tokens only; normalizing and truncating are the caller's
(:mod:`trio_mlx._core.embedder`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trio_mlx._lanes.records import EmbedInput, EmbedVector, StepPlan, StepResult

__all__ = ["POOLINGS", "EmbedLane", "embed_then_step"]

#: The pooling methods: the last real token, the mean of the real tokens, the first.
POOLINGS = ("last", "mean", "cls")


def hidden_model(model: Any) -> Callable[..., Any] | None:
    """The callable that gives a model's final hidden states (None: not an mlx-lm decoder)."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner) or not hasattr(inner, "layers"):
        return None
    return inner  # type: ignore[no-any-return]


@attrs.define(eq=False)
class EmbedLane:
    """Pools hidden states for embedding inputs (MLX thread only)."""

    model: Any
    #: One of :data:`POOLINGS`.
    pooling: str

    def _padded_caches(self, padding: list[int]) -> list[Any] | None:
        """One ``BatchKVCache`` a layer with ``padding``; None where the model keeps other caches."""
        from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

        kinds = make_prompt_cache(self.model)
        if any(type(cache) is not KVCache for cache in kinds):
            return None
        return [BatchKVCache(list(padding)) for _ in kinds]

    def forward(self, inputs: Sequence[EmbedInput]) -> list[EmbedVector]:
        """The pooled vector of each input (errors per pass, never raised)."""
        if not inputs:
            return []
        try:
            return self._batched(inputs)
        except Exception as exc:
            return [EmbedVector(i.id, i.index, error=exc) for i in inputs]

    def _batched(self, inputs: Sequence[EmbedInput]) -> list[EmbedVector]:
        longest = max(len(i.tokens) for i in inputs)
        padding = [longest - len(i.tokens) for i in inputs]
        caches = self._padded_caches(padding) if len(inputs) > 1 else None
        if caches is None and len(inputs) > 1:
            return [v for i in inputs for v in self._batched([i])]
        return self._pass(inputs, padding, caches)

    def _pass(
        self, inputs: Sequence[EmbedInput], padding: list[int], caches: list[Any] | None
    ) -> list[EmbedVector]:
        import mlx.core as mx
        import numpy as np

        inner = hidden_model(self.model)
        if inner is None:
            raise TypeError("the model has no inner transformer (model.model) to pool")
        rows = [[0] * pad + list(i.tokens) for i, pad in zip(inputs, padding, strict=True)]
        hidden = inner(mx.array(rows), cache=caches).astype(mx.float32)
        if self.pooling == "last":
            pooled = hidden[:, -1, :]
        elif self.pooling == "cls":
            pooled = mx.stack([hidden[row, pad, :] for row, pad in enumerate(padding)])
        else:
            width = hidden.shape[1]
            real = mx.arange(width)[None, :] >= mx.array(padding)[:, None]
            mask = real.astype(mx.float32)[:, :, None]
            pooled = (hidden * mask).sum(axis=1) / mask.sum(axis=1)
        vectors = np.array(pooled, dtype=np.float32)
        return [EmbedVector(i.id, i.index, vectors[row].copy()) for row, i in enumerate(inputs)]


def embed_then_step(lane: EmbedLane, plan: StepPlan, step: Callable[[], StepResult]) -> StepResult:
    """Forward the plan's embedding inputs, then run the batch lane's step, timing both
    (MLX thread; the pass reads its vectors back, so its time is spent, not queued)."""
    start = time.perf_counter()
    vectors = lane.forward(plan.embeds)
    middle = time.perf_counter()
    result = step()
    end = time.perf_counter()
    return attrs.evolve(
        result,
        embeddings=tuple(vectors),
        seconds=end - middle,
        embed_seconds=middle - start if plan.embeds else 0.0,
    )
