"""Prompt-cache reuse over mlx-lm's byte-capped ``LRUPromptCache`` (MLX thread only)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs

__all__ = ["PromptCache"]


@attrs.define(eq=False)
class PromptCache:
    """KV caches of earlier requests, keyed by their tokens, capped at ``max_bytes``."""

    max_bytes: int
    max_entries: int = 64
    _lru: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        self._lru = LRUPromptCache(max_size=self.max_entries, max_bytes=self.max_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return int(self._lru.nbytes)

    def fetch(self, key: Hashable, tokens: Sequence[int]) -> tuple[list[Any] | None, list[int]]:
        """The nearest cache for ``tokens`` and the tokens it does not cover (never empty)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        tokens = list(tokens)
        cache, rest = self._lru.fetch_nearest_cache(key, tokens)
        if cache is None:
            return None, tokens
        rest = list(rest)
        if not rest:
            # An exact hit still needs one token to compute the next logits.
            if not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, rest

    def clear(self) -> None:
        """Drop every cached entry."""
        self._lru.trim_to(n_sequences=0)

    def store(self, key: Hashable, tokens: Sequence[int], cache: list[Any]) -> None:
        """Keep ``cache`` (holding exactly ``tokens``) for later requests."""
        self.store_many(key, [(tokens, cache)])

    def store_many(self, key: Hashable, entries: Sequence[tuple[Sequence[int], list[Any]]]) -> None:
        """Keep several (tokens, cache) pairs, evaluated together."""
        entries = [(tokens, cache) for tokens, cache in entries if tokens]
        if self.max_bytes <= 0 or not entries:
            return
        import mlx.core as mx

        # A cache taken out of a batch is a lazy slice of the batch's whole KV
        # buffers: until it is evaluated it keeps them alive while ``nbytes``
        # counts only the slice (1-1.5 GB held under a 36 MB count, measured).
        mx.eval([c.state for _, cache in entries for c in cache])
        for tokens, cache in entries:
            self._lru.insert_cache(key, list(tokens), cache)
