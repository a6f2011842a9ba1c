"""KV memory: what rows' caches cost at worst, and whether they fit a budget. Pure.

Theory of operation
===================

A row's KV cache grows with its tokens (prompt plus generated), and the
process dies when MLX cannot allocate (an out-of-memory abort takes every
request down with it). So the arbiter admits a row only when the rows'
*worst case* fits a byte budget (:class:`KVBudget`), from a per-token cost
measured on the model's own caches at load (:class:`KVProfile`):

- layers whose cache grows with the row (``KVCache``, ``QuantizedKVCache``)
  cost ``per_token`` bytes a token;
- sliding-window layers (``RotatingKVCache``) cost their bytes a token up to
  their window, never more (``windows``);
- recurrent or linear-attention state (``ArraysCache``) costs ``per_row``
  bytes whatever the length.

Caches grow in steps of ``step`` tokens (mlx-lm allocates 256 positions at a
time), so a row's tokens are rounded up to one.

mlx-lm's batch cache is one buffer per layer, ``rows x longest row``: a short
row beside a long one is left-padded to the long one's length. So a batch
costs ``rows x row_bytes(longest)``, not the sum of its rows
(:meth:`KVProfile.batch_bytes`); a 60k-token row beside seven short ones
holds eight 60k-token caches.

Nothing here touches MLX or a clock: the numbers come in, so every rule is
a plain function the property tests drive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

__all__ = [
    "KV_MEMORY_FRACTION",
    "MIN_PROMPT_CACHE_BYTES",
    "MIN_ROW_TOKENS",
    "PROMPT_CACHE_FRACTION",
    "KVBudget",
    "KVProfile",
    "default_limit",
    "default_prompt_cache",
]

#: The share of MLX's memory limit, less the weights, that the rows' KV caches may
#: reserve by default. The rest covers what the reservation does not count: the
#: copy a batch cache makes when rows join or leave it (mlx-lm concatenates and
#: slices, so old and new buffers live together for a moment), prefill activations,
#: logits and MLX's buffer cache.
KV_MEMORY_FRACTION = 0.5
#: The default budget never holds less than one row of this many tokens: a machine
#: too small for that still serves short requests.
MIN_ROW_TOKENS = 4096
#: The share of MLX's memory limit, less the weights, that the prompt cache may hold
#: by default (it comes out of the rows' share above). An agent's checkpoints are
#: whole prompts: a 1B llama holds 32 KB a token, so one 40k-token turn is 1.3 GB,
#: and a fixed cap of 256 MiB kept none of them on the H200 (design/engine.md).
PROMPT_CACHE_FRACTION = 0.2
#: The default prompt cache never holds less than this.
MIN_PROMPT_CACHE_BYTES = 256 * 1024 * 1024
#: Tokens the row-capacity search goes up to (beyond any model's context).
_MAX_TOKENS = 1 << 40


def _non_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"'{attribute.name}' must be an int >= 0: {value!r}")


def _windows(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    ok = isinstance(value, tuple) and all(
        isinstance(pair, tuple) and len(pair) == 2 and all(type(n) is int and n >= 0 for n in pair)
        for pair in value
    )
    if not ok:
        raise ValueError(f"'{attribute.name}' must be a tuple of (window, bytes) int pairs")


@attrs.frozen
class KVProfile:
    """What one row's KV cache costs, by layer kind (see the module's notes)."""

    #: Bytes a token over the layers whose cache grows with the row.
    per_token: int = attrs.field(default=0, validator=_non_negative)
    #: (window in tokens, bytes a token) of the sliding-window layers.
    windows: tuple[tuple[int, int], ...] = attrs.field(default=(), validator=_windows)
    #: Bytes a row costs whatever its length (recurrent state).
    per_row: int = attrs.field(default=0, validator=_non_negative)
    #: Caches grow this many tokens at a time.
    step: int = attrs.field(default=256, validator=attrs.validators.ge(1))

    def row_bytes(self, tokens: int) -> int:
        """The most bytes one row of ``tokens`` tokens holds."""
        length = -(-max(0, tokens) // self.step) * self.step
        windowed = sum(cost * min(length, window) for window, cost in self.windows)
        return self.per_token * length + windowed + self.per_row

    def batch_bytes(self, lengths: Sequence[int]) -> int:
        """The most bytes a batch of rows of these token counts holds (rows x the longest)."""
        if not lengths:
            return 0
        return len(lengths) * self.row_bytes(max(lengths))


@attrs.frozen
class KVBudget:
    """The bytes the rows' KV caches may reserve, and the profile that prices a row."""

    profile: KVProfile
    limit: int = attrs.field(validator=_non_negative)

    def fits(self, lengths: Sequence[int]) -> bool:
        """Whether a batch of rows of these token counts fits the budget."""
        return self.profile.batch_bytes(lengths) <= self.limit

    def row_capacity(self) -> int | None:
        """The most tokens one row may hold alone (None: any length fits; 0: none fits)."""
        row_bytes = self.profile.row_bytes
        if row_bytes(_MAX_TOKENS) <= self.limit:
            return None
        if row_bytes(0) > self.limit:
            return 0
        low, high = 0, _MAX_TOKENS  # row_bytes(low) fits; row_bytes(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if row_bytes(middle) <= self.limit:
                low = middle
            else:
                high = middle
        return low


def default_limit(memory: int, weights: int, reserved: int, profile: KVProfile) -> int:
    """The default budget: ``KV_MEMORY_FRACTION`` of ``memory`` less ``weights``, less
    ``reserved`` (the prompt cache's cap), never below one row of ``MIN_ROW_TOKENS``."""
    room = int(max(0, memory - weights) * KV_MEMORY_FRACTION) - reserved
    return max(room, profile.row_bytes(MIN_ROW_TOKENS))


def default_prompt_cache(memory: int, weights: int) -> int:
    """The prompt cache's default cap: ``PROMPT_CACHE_FRACTION`` of ``memory`` less
    ``weights``, never below ``MIN_PROMPT_CACHE_BYTES``."""
    room = int(max(0, memory - weights) * PROMPT_CACHE_FRACTION)
    return max(room, MIN_PROMPT_CACHE_BYTES)
