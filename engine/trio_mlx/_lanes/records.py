"""What the lane and its callers exchange: a row's spec, a step's plan and its result."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from trio_mlx._lanes.output import RowEvent
from trio_mlx._params import SamplingParams

__all__ = ["DECODE", "EmbedInput", "EmbedVector", "RowSpec", "StepPlan", "StepResult"]


@attrs.frozen
class RowSpec:
    """A row to insert: the request id, its prompt tokens and its parameters."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    #: The compiled :class:`~trio_mlx._lanes.structured.Constraint` of a constrained request.
    constraint: Any = attrs.field(default=None, eq=False, repr=False)
    #: The prompt's stable prefix in tokens (a chat's system prompt and tools: where
    #: its first other message starts), kept as a prompt-cache checkpoint; None: none.
    checkpoint: int | None = None
    #: An image request's :class:`~trio_mlx._start.vision.VisionPrompt` (its image
    #: inputs and their hashes); None: text only.
    images: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class EmbedInput:
    """One input of an embedding request, carried by a step: prefill only, no decoding."""

    #: The request's id, and the input's place in the request.
    id: int
    index: int
    tokens: tuple[int, ...]


@attrs.frozen
class EmbedVector:
    """One input's pooled hidden state (a float32 NumPy vector, not normalized), or its error."""

    id: int
    index: int
    vector: Any = attrs.field(default=None, eq=False, repr=False)
    error: BaseException | None = None


def _embeds(inputs: Iterable[EmbedInput]) -> tuple[EmbedInput, ...]:
    return tuple(inputs)


def _specs(specs: Iterable[RowSpec]) -> tuple[RowSpec, ...]:
    return tuple(specs)  # typed converters: mypy cannot infer attrs' converter=tuple


def _ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(ids)


@attrs.frozen
class StepPlan:
    """One :meth:`BatchLane.step`: the rows it removes, inserts and resumes, and its burst length.

    The actor's :class:`~trio_mlx._core.planner.StepPlanner` makes one per step; in
    distributed mode rank 0 sends the same plan to every follower
    (:mod:`trio_mlx._dist.leader`), so every rank makes the same call.
    """

    inserts: tuple[RowSpec, ...] = attrs.field(default=(), converter=_specs)
    resumes: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    removes: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    #: Most decode steps of the burst (see :meth:`BatchLane.step`).
    steps: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: The chunk prompts are cut into in this call, in tokens (at most the lane's
    #: ``prefill_budget``, which still bounds rows x width); None: the budget.
    prefill_chunk: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    #: Embedding inputs forwarded (one padded pass) before the decode step.
    embeds: tuple[EmbedInput, ...] = attrs.field(default=(), converter=_embeds)


#: A step that only decodes (no row comes or goes): one decode step.
DECODE = StepPlan()


@attrs.frozen
class StepResult:
    """What one lane call produced."""

    events: list[RowEvent]
    #: Request id -> prompt tokens served from the prompt cache, for rows inserted now.
    cached: dict[int, int]
    #: Rows the lane holds after the step (in the batch or parked).
    rows: int = 0
    #: Decode steps run (0 when no row was in the batch, more in a burst).
    steps: int = 0
    #: Live rows in the batch after the step (decoding or prefilling; not parked, not dead).
    decoding: int = 0
    #: Dead rows (finished or cancelled) still holding a KV slot after the step.
    dead: int = 0
    #: Each decode step's prompt tokens prefilled (padded, as mlx-lm runs them)
    #: and its seconds inside ``BatchGenerator.next()``: what the planner sizes
    #: the prefill chunk from (:attr:`~trio_mlx._core.planner.StepPlanner.prefill_stall`).
    timings: tuple[tuple[int, float], ...] = ()
    #: The pooled vectors of the plan's embedding inputs.
    embeddings: tuple[EmbedVector, ...] = ()
    #: Seconds of the step call without its embedding pass, and of the pass (both
    #: 0 where the engine serves no embeddings): what the embeddings' share reads.
    seconds: float = 0.0
    embed_seconds: float = 0.0
