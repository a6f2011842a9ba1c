"""The lane's record of a row: live (``Row``), dead but still in the batch (``Dead``),
the guard that keeps one row's failing processor from failing the batch, and the
model wrapper that puts each row's adapter on for mlx-lm's forward calls."""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import attrs

from trio_mlx._adapters.multilora import AdapterStack
from trio_mlx._lanes.output import RowOutput
from trio_mlx._lanes.records import RowSpec

__all__ = ["UNBOUNDED", "AdapterRows", "Dead", "Guarded", "Row", "RowModel"]


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


class AdapterRows(Protocol):
    """What :class:`RowModel` reads of its lane (``BatchLane``): the adapter stack of
    the step in flight, and each row's slot in it."""

    _active_stack: AdapterStack | None

    def _slot(self, uid: int, stack: AdapterStack) -> int: ...


class RowModel:
    """The model as the lane's ``BatchGenerator`` sees it: each forward call first
    sets the adapter slot of each of its rows (see :mod:`trio_mlx._adapters.multilora`).

    mlx-lm makes every forward call from a method of the batch object whose
    ``uids`` list is that call's row order (``PromptProcessingBatch.prompt``
    for prefill, ``GenerationBatch._step`` for decode); that list is read from
    the caller, so each call gets its own rows' adapters whatever mlx-lm's
    ordering. A caller without ``uids`` of the call's batch size fails the call
    (loudly) rather than guess.
    """

    def __init__(self, model: Any, lane: AdapterRows) -> None:
        self._model = model
        self._lane = lane

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        stack = self._lane._active_stack
        if stack is not None:
            caller = sys._getframe(1).f_locals.get("self")
            uids = getattr(caller, "uids", None)
            if not isinstance(uids, list) or len(uids) != inputs.shape[0]:
                raise RuntimeError(
                    "cannot tell the rows of this mlx-lm forward call: per-row adapters need "
                    "the calling batch's uids"
                )
            stack.set_rows([self._lane._slot(uid, stack) for uid in uids])
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
