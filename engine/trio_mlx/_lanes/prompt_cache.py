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

    def fetch(
        self, key: Hashable, tokens: Sequence[int], *, min_prefix: int = 1, share: bool = False
    ) -> tuple[list[Any] | None, list[int]]:
        """The nearest cache for ``tokens`` and the tokens it does not cover (never empty).

        A cached prefix shorter than ``min_prefix`` tokens is not worth its
        copy: the prompt is then prefilled in full (None, ``tokens``). With
        ``share`` the entry's arrays are shared, not copied: only for a
        caller that never writes into them (the batch lane: mlx-lm merges an
        inserted cache into the batch's own buffers); each layer object is
        still a copy, so trimming it leaves the stored entry whole.
        """
        import copy

        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        tokens = list(tokens)
        if self._shared_prefix(key, tokens) < max(1, min_prefix):
            return None, tokens  # not worth the trie search for the best entry either
        found = self._nearest(key, tokens)
        if found is None:
            return None, tokens
        entry, entry_len, reuse = found
        if reuse < max(1, min_prefix):
            return None, tokens
        if reuse >= len(tokens) or entry_len > reuse:
            # An exact hit still needs one token to compute the next logits;
            # a longer entry is cut back to the shared prefix.
            reuse = min(reuse, len(tokens) - 1)
            if reuse < max(1, min_prefix) or not can_trim_prompt_cache(entry):
                return None, tokens
        cache = [copy.copy(layer) for layer in entry] if share else copy.deepcopy(entry)
        if entry_len > reuse:
            trim_prompt_cache(cache, entry_len - reuse)
        return cache, tokens[reuse:]

    def _shared_prefix(self, key: Hashable, tokens: list[int]) -> int:
        """Tokens of ``tokens`` that some entry shares (an upper bound on any reuse)."""
        node = self._lru._trie._trie.get(key)
        depth = 0
        while node is not None and depth < len(tokens):
            node = node.get(tokens[depth])
            if node is not None:
                depth += 1
        return depth

    def _nearest(self, key: Hashable, tokens: list[int]) -> tuple[list[Any], int, int] | None:
        """The best entry for ``tokens``: (its cache, its length, tokens of it to reuse).

        The choice is mlx-lm's ``LRUPromptCache.fetch_nearest_cache``'s (an
        exact match, else the longer entry when it shares more than the
        longest stored prefix, else that prefix), made over its trie without
        copying anything (the trie is private to mlx-lm: pinned to <0.33).
        """
        from mlx_lm.models.cache import can_trim_prompt_cache

        trie = self._lru._trie
        result = trie.search(key, tokens)
        if result.exact is not None:
            return trie.get(result.model, result.exact).prompt_cache, len(tokens), len(tokens)
        short = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short:
            cache = trie.get(result.model, result.longer).prompt_cache
            if can_trim_prompt_cache(cache):
                return cache, len(result.longer), min(len(tokens) - 1, result.common_prefix)
        if short > 0:
            return trie.get(result.model, result.shorter).prompt_cache, short, short
        return None

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
        # Queued, not waited for: the copies run behind the decode step in
        # flight, and the batch's buffers are let go as soon as they have run.
        mx.async_eval([c.state for _, cache in entries for c in cache])  # type: ignore[no-untyped-call]
        for tokens, cache in entries:
            self._lru.insert_cache(key, list(tokens), cache)
