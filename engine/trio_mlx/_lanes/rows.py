"""The lane's record of a row: live (``Row``), dead but still in the batch (``Dead``),
and the guard that keeps one row's failing processor from failing the batch."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import attrs

from trio_mlx._lanes.output import RowOutput
from trio_mlx._lanes.records import RowSpec

__all__ = ["UNBOUNDED", "Dead", "Guarded", "Row"]


@attrs.define(eq=False)
class Row:
    spec: RowSpec
    output: RowOutput
    sampler: Callable[[Any], Any] | None
    processors: list[Callable[[Any, Any], Any]]
    uid: int | None = None
    last_token: int | None = None
    #: (cache, tokens in it) while parked; None when parked before its first token.
    parked: tuple[list[Any], list[int]] | None = None
    #: While it waits to be prefilled (see ``BatchLane.prefill_budget``): its
    #: prompt, the cached prefix's KV (or None) and the tokens still to prefill.
    waiting: tuple[list[int], list[Any] | None, list[int]] | None = None
    error: BaseException | None = None

    @property
    def adapter(self) -> str | None:
        return self.spec.params.adapter


#: mlx-lm's ``max_tokens`` for every row: the lane finishes rows itself (``RowOutput``).
UNBOUNDED = 1 << 40


@attrs.define(eq=False)
class Dead:
    """A finished or cancelled row whose KV slot is still in the batch."""

    row_id: int
    #: Keep its KV cache for the prompt cache when it is removed.
    store: bool
    #: Its prompt cache key (the adapter it ran under is part of it).
    key: Hashable = "base"
    #: Decode steps since it died (tokens its cache holds past its last real one).
    age: int = 0


class Guarded:
    """A processor that records its row's failure instead of failing the whole batch.

    A failed row is also appended to ``failed`` (the lane's), so the lane looks
    for failed rows only after a step in which one failed.
    """

    __slots__ = ("failed", "processor", "row")

    def __init__(self, row: Row, processor: Callable[[Any, Any], Any], failed: list[Row]) -> None:
        self.row = row
        self.processor = processor
        self.failed = failed

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if self.row.error is not None:
            return logits
        try:
            return self.processor(tokens, logits)
        except Exception as exc:
            self.row.error = exc
            self.failed.append(self.row)
            return logits
