"""Image rows' prefill inside the batch lane's prefill budget (MLX thread only).

An image row whose images are not all in the prompt cache is prefilled here before it
joins the batch (``Row.waiting``, as a text row whose prompt is served): each decode
step does one piece of the oldest image row's work before the batch's
``BatchGenerator.next()``: first the vision encoder's pass (the prompt's input
embeddings, :meth:`~trio_mlx._start.vision.Vision.embed`), then the language model over
the next chunk of those embeddings into the row's cache
(:meth:`~trio_mlx._start.vision.Vision.advance`). A chunk is at most the lane's chunk
(its ``prefill_budget``, ``long_prompt_chunk`` and the plan's ``prefill_chunk``) less
the text rows' prefill pass of the step (gemma3: an image is never cut, so its chunk
may be the whole image). Rows waiting to join when an image row came go
first (it starts once they have joined); text rows join a step while their pass and the
image's piece of it stay within the budget (``BatchLane._feed``: the image row is not in
mlx-lm's prompt batch, so it pads none of them). So the decode streams beside
back-to-back image requests wait at most one chunk (or the encoder's pass) per step, not
a whole image prompt. The row's work is dropped with it (cancel, park, failure); a
parked row starts again from its prompt (the prompt cache may serve a part) when resumed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any, Protocol

import attrs

from trio_mlx._lanes.output import RowEvent
from trio_mlx._lanes.prompt_cache import PromptCache
from trio_mlx._lanes.rows import Row

__all__ = ["ImageLane", "ImagePrefill", "ImagePrefills"]


@attrs.define(eq=False)
class ImagePrefill:
    """An image row's prompt on its way into its cache: the encoder pass
    (``Vision.embed``) gives the input embeddings of the tokens past the cached
    prefix, then the language model runs them a chunk at a time (``Vision.advance``),
    all but the last token, one chunk per decode step (:class:`ImagePrefills`)."""

    tokens: list[int]
    #: The processor's model inputs (``trio_mlx._start.vision.VisionPrompt``).
    prompt: Any
    #: The row's prompt cache key (the result is kept under it).
    key: Hashable
    #: The cached prefix's KV (a copy, written into), or None: a fresh one at the encoder pass.
    cache: list[Any] | None
    #: Tokens the cache holds before the prefill (served by the prompt cache).
    start: int
    #: The token ids and input embeddings of ``tokens[start:]`` (set by the encoder pass).
    ids: Any = None
    embeds: Any = None
    #: M-RoPE families: their positions, ``(3, 1, n)`` (``trio_mlx._start.vision_mrope``).
    positions: Any = None
    #: Positions of them already run into the cache.
    at: int = 0

    @property
    def left(self) -> int:
        """Positions still to run (all but the last token)."""
        return len(self.tokens) - 1 - self.start - self.at


class ImageLane(Protocol):
    """What the image prefill reads of the batch lane it serves (``BatchLane``; named
    by shape, as the lane imports this module)."""

    prompt_cache: PromptCache | None
    vision: Any
    cache_min_prefix: int
    prefill_budget: int | None
    long_prompt_chunk: int | None
    prefill_step_size: int
    _rows: dict[int, Row]
    _waiting: deque[int]
    _prefilling: dict[int, int]
    _chunk: int | None

    def _key(self, row: Row) -> Hashable: ...

    def _pass_tokens(self) -> int: ...


@attrs.define(eq=False)
class ImagePrefills:
    """The image rows being prefilled, oldest first (their ``ImagePrefill``)."""

    #: Row id -> its prefill, in arrival order: only the first one runs.
    jobs: dict[int, ImagePrefill] = attrs.field(factory=dict)
    #: Row id -> the rows that waited to join the batch when it came: it starts after them.
    ahead: dict[int, frozenset[int]] = attrs.field(factory=dict)
    #: Prompt positions the current decode step's piece ran (the encoder's: its image
    #: tokens): the text rows joining in the step fit in what it leaves of the budget.
    used: int = 0

    def start(self, lane: ImageLane, row: Row) -> int:
        """Queue a new (or restarted) image row: to wait for the batch if the prompt cache
        holds its images, else for its prefill here; returns the tokens the cache serves."""
        prompt = list(row.spec.prompt)
        args = (prompt, row.spec.images, lane.prompt_cache, lane._key(row))
        found: tuple[list[Any], list[int]] | ImagePrefill
        found = lane.vision.start(*args, lane.cache_min_prefix)
        if isinstance(found, tuple):
            cache, rest = found
            row.waiting = (prompt, cache, rest)
            lane._waiting.append(row.spec.id)
            return len(prompt) - len(rest)
        self.jobs[row.spec.id] = found
        self.ahead[row.spec.id] = frozenset(lane._waiting)
        return found.start

    def drop(self, ids: Iterable[int]) -> None:
        """Forget these rows' prefills (cancelled, parked, failed): their arrays go with them."""
        for row_id in ids:
            self.jobs.pop(row_id, None)
            self.ahead.pop(row_id, None)

    def run(self, lane: ImageLane) -> tuple[int, float, list[RowEvent]]:
        """One piece of the oldest image row's prefill, within what the step's budget
        leaves: (prompt positions it ran, seconds, a failed row's error event). A
        prefilled row waits to join the batch (``lane._waiting``)."""
        self.used = 0
        if not self.jobs:
            return 0, 0.0, []
        row_id, job = next(iter(self.jobs.items()))
        row = lane._rows.get(row_id)
        if row is None:  # gone without a drop: forget it
            self.drop([row_id])
            return 0, 0.0, []
        if job.embeds is None and not self.ahead[row_id].isdisjoint(lane._waiting):
            return 0, 0.0, []  # rows that came first still wait: they join first
        budget, plan = lane.prefill_budget, lane._chunk
        bounds = (budget, lane.long_prompt_chunk, plan, lane.prefill_step_size)
        room = min(x for x in bounds if x is not None)
        if budget is not None and lane._prefilling:
            room = min(room, budget - lane._pass_tokens())
        if room < 1:
            return 0, 0.0, []  # the text rows' pass takes the budget: a later step
        vision, start = lane.vision, time.perf_counter()
        try:
            tokens = vision.embed(job) if job.embeds is None else vision.advance(job, room)
            if not job.left:
                cache, rest = vision.finish(job, lane.prompt_cache)
                self.drop([row_id])
                row.waiting = (job.tokens, cache, rest)
                lane._waiting.append(row_id)
        except Exception as exc:
            self.drop([row_id])
            lane._rows.pop(row_id, None)
            return 0, time.perf_counter() - start, [RowEvent(row_id, error=exc)]
        self.used = tokens
        return tokens, time.perf_counter() - start, []
