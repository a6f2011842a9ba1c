"""The prompt cache's part of a request's usage, read in one place for every API.

Chat's ``usage.prompt_tokens_details.cached_tokens``, the Responses API's
``usage.input_tokens_details.cached_tokens`` and Anthropic's
``cache_read_input_tokens`` / ``cache_creation_input_tokens`` all come from
:func:`cache_usage`. The engine reports how many prompt tokens its prompt cache
served (``GenerationResult.cached_tokens``); it does not report how many it
stored for later requests, so ``written`` is 0 until it does.
"""

from __future__ import annotations

import attrs

from trio_mlx import GenerationResult

__all__ = ["CacheUsage", "cache_usage"]


@attrs.frozen
class CacheUsage:
    """Prompt tokens read from the prompt cache, and written to it, for one request."""

    read: int
    written: int

    def uncached(self, prompt_tokens: int) -> int:
        """The prompt tokens neither read from nor written to the cache (Anthropic's ``input_tokens``)."""
        return max(0, prompt_tokens - self.read - self.written)


def cache_usage(result: GenerationResult) -> CacheUsage:
    """The prompt cache's counts for ``result``."""
    return CacheUsage(read=result.cached_tokens, written=0)
