"""Prompt-cache reuse over mlx-lm's byte-capped ``LRUPromptCache`` (MLX thread only).

Entries are of three kinds, mlx-lm's ``LRUPromptCache`` eviction classes: a
request's whole context at the end of its generation (``"assistant"``), the
end of its prompt (``"user"``: all but the prompt's last token, which the
first decode step takes) and the end of its stable prefix (``"system"``: the
system prompt and tools, where the chat's first other message starts). The
last two are *checkpoints*: a cache that cannot be trimmed (a sliding window
that wrapped, a linear-attention state) is reused only by extending an entry
that is a prefix of the new prompt, and an agent's next turn shares the
previous prompt, not its reply. See design/engine.md, "The prompt cache".
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from trio_mlx._lanes.prompt_disk import DiskTier

__all__ = ["BASE", "PromptCache", "PromptCacheStatistics", "detached"]

#: The key of the base model's entries (an adapter's are keyed apart).
BASE = "base"

#: An entry's kind: mlx-lm's eviction class (see the module's notes).
GENERATION, PROMPT, PREFIX = "assistant", "user", "system"


def detached(cache: list[Any]) -> list[Any]:
    """A copy of ``cache`` whose arrays are its own (lazy copies, to be evaluated).

    A cache taken out of a batch holds slices of the batch's buffers: kept as
    they are, they keep the whole buffers alive while ``nbytes`` counts only
    the slices (1-1.5 GB held under a 36 MB count, measured).
    """
    import mlx.core as mx
    from mlx.utils import tree_map

    out = copy.deepcopy(cache)  # the objects; their arrays are still shared
    for layer in out:
        layer.state = tree_map(
            lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, layer.state
        )
    return out


def trimmable(cache: list[Any]) -> bool:
    """Whether every layer of ``cache`` can be cut back (mlx-lm's rule)."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    return bool(can_trim_prompt_cache(cache))


def held_tokens(cache: list[Any], tokens: int) -> int:
    """The tokens ``cache`` holds, from the layers that count them; ``tokens``
    when none does (every layer a state that has no length)."""
    lengths = [c.offset for c in cache if isinstance(getattr(c, "offset", None), int)]
    return max(lengths) if lengths else tokens


@attrs.frozen
class PromptCacheStatistics:
    """A snapshot of the prompt cache (``/metrics`` reads it through the engine's)."""

    #: Entries and bytes held in memory, and the byte cap.
    entries: int
    bytes: int
    max_bytes: int
    #: Lookups that served a prefix, those that did not, and the tokens served.
    hits: int
    misses: int
    tokens_reused: int
    #: The disk tier (0 when it is off): entries of this model and bytes in the
    #: folder at its last scan, entries read back, written, and skipped as corrupt.
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    disk_failures: int = 0


@attrs.define(eq=False)
class PromptCache:
    """KV caches of earlier requests, keyed by their tokens, capped at ``max_bytes``."""

    max_bytes: int
    max_entries: int = 64
    #: The disk tier (None: off); only the base model's checkpoints go there.
    disk: DiskTier | None = None
    hits: int = attrs.field(init=False, default=0)
    misses: int = attrs.field(init=False, default=0)
    tokens_reused: int = attrs.field(init=False, default=0)
    _lru: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        self._lru = LRUPromptCache(max_size=self.max_entries, max_bytes=self.max_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return int(self._lru.nbytes)

    def statistics(self) -> PromptCacheStatistics:
        """A snapshot of the counts (read from any thread: plain integers)."""
        disk = self.disk
        return PromptCacheStatistics(
            entries=len(self._lru),
            bytes=self.nbytes,
            max_bytes=self.max_bytes,
            hits=self.hits,
            misses=self.misses,
            tokens_reused=self.tokens_reused,
            disk_entries=disk.entries if disk is not None else 0,
            disk_bytes=disk.nbytes if disk is not None else 0,
            disk_hits=disk.hits if disk is not None else 0,
            disk_writes=disk.writes if disk is not None else 0,
            disk_failures=disk.failures if disk is not None else 0,
        )

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
        from mlx_lm.models.cache import trim_prompt_cache

        tokens = list(tokens)
        least = max(1, min_prefix)
        found = self._nearest(key, tokens) if len(tokens) > 1 else None
        reuse = found[2] if found is not None else 0
        loaded = self._from_disk(key, tokens, max(reuse, least - 1))
        if loaded is not None:
            self.hits += 1
            self.tokens_reused += loaded[1]
            return loaded[0], tokens[loaded[1] :]
        if found is None or reuse < least:
            self.misses += 1
            return None, tokens
        entry, entry_tokens, reuse = found
        self._touch(key, entry_tokens)
        cache = [copy.copy(layer) for layer in entry] if share else copy.deepcopy(entry)
        if len(entry_tokens) > reuse:
            trim_prompt_cache(cache, len(entry_tokens) - reuse)
        self.hits += 1
        self.tokens_reused += reuse
        return cache, tokens[reuse:]

    def covered(self, key: Hashable, tokens: Sequence[int]) -> int:
        """The tokens :meth:`fetch` would serve ``tokens`` from memory under ``key``
        (nothing is copied, counted or moved in the LRU order)."""
        found = self._nearest(key, list(tokens)) if len(tokens) > 1 else None
        return found[2] if found is not None else 0

    def _nearest(self, key: Hashable, tokens: list[int]) -> tuple[list[Any], list[int], int] | None:
        """The best entry for ``tokens``: (its cache, its tokens, tokens of it to reuse).

        At most all but the last token is reused (the last one computes the
        next logits), so the search is for ``tokens[:-1]``: an entry of
        exactly those is taken as it is; a longer entry that shares more than
        the longest stored prefix is cut back to what it shares, if it can be
        cut (``can_trim_prompt_cache``: not a sliding window that wrapped,
        not a recurrent state); otherwise the longest stored prefix, which
        every cache kind extends. Made over mlx-lm's trie without copying
        anything (the trie is private to mlx-lm: pinned to <0.33).
        """
        trie = self._lru._trie
        wanted = tokens[:-1]
        result = trie.search(key, wanted)
        if result.exact is not None:
            return trie.get(key, wanted).prompt_cache, wanted, len(wanted)
        short = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short:
            cache = trie.get(key, result.longer).prompt_cache
            if trimmable(cache):
                return cache, result.longer, result.common_prefix
        if short > 0:
            return trie.get(key, result.shorter).prompt_cache, result.shorter, short
        return None

    def _touch(self, key: Hashable, tokens: list[int]) -> None:
        """Make an entry the most recently used of its kind."""
        order = self._lru._lru
        for kind in order._ordering:
            lru = order._lrus[kind]
            try:
                lru.remove((key, tokens))
            except ValueError:
                continue
            lru.append((key, tokens))
            return

    def _from_disk(
        self, key: Hashable, tokens: list[int], longer_than: int
    ) -> tuple[list[Any], int] | None:
        """A checkpoint from the disk tier that serves at least ``disk.min_tokens``
        more than ``longer_than`` tokens (reading a file beats prefilling only
        that far: design/engine.md), kept in memory too."""
        if self.disk is None or key != BASE:
            return None
        longer_than += self.disk.min_tokens - 1
        if len(tokens) - 1 <= longer_than:
            return None
        found = self.disk.lookup(tokens, longer_than)
        if found is None:
            return None
        cache, length = found
        self._lru.insert_cache(key, tokens[:length], cache, cache_type=PROMPT)
        return copy.deepcopy(cache), length

    def clear(self) -> None:
        """Drop every entry held in memory (the disk tier keeps its own) and zero
        the counts (the loader's warm-up rows are no one's)."""
        self._lru.trim_to(n_sequences=0)
        self.hits = self.misses = self.tokens_reused = 0

    def close(self) -> None:
        """Drop every entry and finish the disk tier's queued writes."""
        self.clear()
        if self.disk is not None:
            self.disk.close()

    def store(
        self, key: Hashable, tokens: Sequence[int], cache: list[Any], *, kind: str = GENERATION
    ) -> None:
        """Keep ``cache`` (holding exactly ``tokens``) for later requests."""
        self.store_many(key, [(tokens, cache)], kind=kind)

    def store_many(
        self,
        key: Hashable,
        entries: Sequence[tuple[Sequence[int], list[Any]]],
        *,
        kind: str = GENERATION,
    ) -> None:
        """Keep several (tokens, cache) pairs, evaluated together.

        The caches must own their arrays (see :func:`detached`): a cache taken
        out of a batch by mlx-lm's ``extract`` does.
        """
        entries = [(tokens, cache) for tokens, cache in entries if tokens]
        if self.max_bytes <= 0 or not entries:
            return
        import mlx.core as mx

        # Queued, not waited for: the copies run behind the decode step in
        # flight, and the batch's buffers are let go as soon as they have run.
        mx.async_eval([c.state for _, cache in entries for c in cache])  # type: ignore[no-untyped-call]
        disk = self.disk if key == BASE and kind != GENERATION else None
        for tokens, cache in entries:
            self._lru.insert_cache(key, list(tokens), cache, cache_type=kind)
            if disk is not None and len(tokens) >= disk.min_tokens:
                # The writer thread only reads evaluated arrays: MLX evaluates
                # on this thread alone.
                mx.eval([c.state for c in cache])
                disk.submit(list(tokens), cache)

    def checkpoint(self, key: Hashable, tokens: Sequence[int], cache: list[Any], kind: str) -> None:
        """Keep a copy of a cache that goes on being filled (a prefill's, mid-flight)."""
        if self.max_bytes > 0 and tokens:
            self.store(key, tokens, detached(cache), kind=kind)
