"""Speculative decoding inside the batch: the per-step plan, verification and rollback.

A speculative step (``generation_class``'s ``_speculate``) asks
:class:`Speculator` which rows draft and how far (:meth:`Speculator.plan`), runs
ONE forward pass over every row's pending token
and drafts (shorter rows padded; their padding is never accepted), and each row
accepts its longest valid prefix (:func:`accepted`): a greedy row where its
drafts equal the target's argmax, a sampled row by the rejection rule for a
deterministic draft (accept ``x`` with probability ``p(x)``; on a rejection the
next token is drawn from ``p`` without ``x``), so its tokens follow the target's
distribution. The positions a row rejected are rolled back (:func:`roll_back`):
the batch's ``BatchKVCache`` is cut to the longest acceptance and each row that
accepted fewer is shifted right by the difference (its left padding grows), so
every row's tokens stay contiguous and end at the batch's index as everywhere
else in the lane. Models whose caches are not all plain ``KVCache`` do not
speculate (see :func:`cache_reason`).

Rows that never speculate (they still share the step): rows with logits
processors (grammars, penalties, bias, ``min_tokens``, a reasoning budget),
rows that asked for logprobs, XTC rows, rows just out of prefill, and
``SamplingParams(speculate=False)``. ``K`` adapts per row: one more after a
step that accepted every draft, the accepted count (at least 1) after one that
did not, and a row whose draft was wholly rejected pauses for 1, 2, 4, ... 64
steps (one whose lookups find nothing, 1 ... 16: looking costs host time). A wholly
rejected step costs a row about a plain step (its verification, and the pipelining
it breaks), so a row that keeps missing (a model that does not copy what the lookup
finds) pays about 1/64 of its steps; a step whose batch holds no speculating row
skips the governor's bookkeeping. Drafts
are made before the pending tokens are read (a lookup guesses the pending token from the
tokens before it), so a step that finds none runs as a plain, pipelined one, and a
speculative step reads back once. Above ``max_batch`` rows no step
speculates, nor at a batch size where speculative steps did not measure 5% more tokens
a second than plain ones (the governor, :meth:`Speculator.observe`): a verification
as dear as several plain steps loses even at high acceptance. A draft model drafts
for every row in the same forwards (:mod:`trio_mlx._lanes.draft_batch`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trio_mlx._lanes.draft_batch import DraftBatch
from trio_mlx._lanes.drafter import PromptLookup
from trio_mlx._params import SamplingParams

__all__ = [
    "RowDraft",
    "Speculation",
    "Speculator",
    "accepted",
    "cache_reason",
    "roll_back",
    "target_filter",
]

logger = logging.getLogger("trio_mlx")

#: The longest pause (steps) of a row whose drafts keep being rejected: at 16 a bundled
#: model that did not copy what its lookups found read 0.94x of plain steps on an H100 at
#: one row (a wholly rejected step costs about a plain step there, every 17th step).
MAX_PAUSE = 64
#: The longest pause (steps) of a row whose lookups keep finding nothing.
MAX_IDLE_PAUSE = 16
#: The governor: how fast a step's rate moves the mean (exponential weight of a step).
RATE_WEIGHT = 0.1
#: Every this many steps the governor runs the other kind of step for ``PROBE_STEPS``
#: steps, to keep its rate current (plain steps while speculating pays, and the reverse);
#: each probe that leaves a size class's verdict as it was doubles that class's interval,
#: up to ``PROBE_MAX`` (a probe costs: a draft model first catches up with every row).
PROBE_EVERY = 64
PROBE_MAX = 512
PROBE_STEPS = 4
#: A probe of the slower kind may cost at most this share of the steps between probes
#: (what its steps lose against the faster kind's, counted in the faster kind's steps):
#: at 64 rows on the CPU a speculative step took 7 plain steps' time, and probes every
#: 512 steps still cost 8%. The interval this asks for is kept under ``PROBE_LIMIT``.
PROBE_SHARE = 0.02
PROBE_LIMIT = 4096
#: Speculation runs where it measured at least this much faster than plain steps: a
#: switch's steps are not counted (they shift a forward's wait between kinds), and a
#: draft model's catch-up is in them, so a tie costs more than it shows.
MARGIN = 1.05
#: Intervals longer than this between step ends (an idle lane, a park) are not rates.
MAX_INTERVAL = 1.0
#: A step that carries prefill work (prompt tokens, an image) is not a decode rate, nor
#: are the steps after it that may pay for it (a GPU runs a queued prefill during a later
#: step): this many steps in all. Counted, a batch's arrival (64 prompts prefilled while
#: the first rows decode) made a plain probe look slow, and the governor then kept
#: speculating at 64 rows on an H100 at 0.81x of plain steps.
UNSETTLED_STEPS = 3


@attrs.frozen
class Speculation:
    """How the lane speculates (built from :class:`~trio_mlx.EngineSettings`)."""

    #: ``"prompt_lookup"``, or ``"draft_model"`` (``draft``, a loaded mlx-lm model).
    method: str = "prompt_lookup"
    draft: Any = attrs.field(default=None, eq=False, repr=False)
    #: Most draft tokens a row verifies per step (``K``).
    num_draft_tokens: int = 4
    #: Above this many rows in the batch (dead ones included), no step speculates.
    max_batch: int = 8
    #: Whether the governor keeps steps plain where speculating measured slower.
    governed: bool = True


@attrs.define(eq=False)
class RowDraft:
    """A speculating row's state: its drafter (None: the lane's draft model drafts
    for it, :class:`~trio_mlx._lanes.draft_batch.DraftBatch`), its ``K`` and its pause."""

    drafter: PromptLookup | None
    #: None: greedy; else the row's sampler as (temperature, filter of the log-probabilities).
    sampled: tuple[float, Callable[[Any], Any]] | None
    k: int
    pause: int = 0
    misses: int = 0
    #: Steps in a row its lookup found no draft (it then pauses 1, 2, 4, ... 16 steps).
    idle: int = 0


def _size_class(rows: int) -> int:
    """The governor's batch size classes: 1, 2-3, 4-7, 8-15, ... rows (rows come and go
    every few steps; within a class a row's rate changes little)."""
    return rows.bit_length()


def target_filter(params: SamplingParams) -> tuple[float, Callable[[Any], Any]] | None:
    """The distribution a sampled row's sampler draws from, as mlx-lm's sampler makes
    it: (temperature, the filters it applies, in its order); None for a greedy row."""
    if params.temperature == 0:
        return None
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    steps: list[Callable[[Any], Any]] = []
    if params.top_p < 1.0:
        top_p = max(params.top_p, 1e-30)  # as processors.make_row_sampler
        steps.append(lambda x: apply_top_p(x, top_p))
    if params.min_p != 0.0:
        steps.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        steps.append(lambda x: apply_top_k(x, params.top_k))

    def apply(logprobs: Any) -> Any:
        for step in steps:
            logprobs = step(logprobs)
        return logprobs

    return params.temperature, apply


def cache_reason(caches: Sequence[Any]) -> str | None:
    """Why a model with these (fresh) caches cannot speculate; None: it can."""
    from mlx_lm.models.cache import KVCache

    other = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if not caches or not other:
        return None
    return (
        f"its caches ({', '.join(other)}) cannot be rolled back per row in the batch "
        "(only plain KVCache layers are)"
    )


@attrs.define(eq=False)
class Speculator:
    """The lane's speculation state (MLX thread): rows by generator uid, and counters."""

    settings: Speculation
    #: Generator uid -> the row's state (rows that may speculate).
    rows: dict[int, RowDraft] = attrs.field(factory=dict)
    #: Draft tokens verified and accepted, by method (read by ``statistics()``).
    drafted: Counter[str] = attrs.field(factory=Counter)
    accepted: Counter[str] = attrs.field(factory=Counter)
    #: Speculative steps run.
    steps: int = 0
    #: The governor's mean tokens per second and row, by (the batch's size class:
    #: 1, 2-3, 4-7, ... rows, whether the step tried to speculate): see :meth:`observe`.
    rates: dict[tuple[int, bool], float] = attrs.field(factory=dict)
    #: The mean seconds a step took, by the same keys.
    durations: dict[tuple[int, bool], float] = attrs.field(factory=dict)
    #: Steps the governor kept plain because speculating measured slower.
    held_back: int = 0
    _last_kind: tuple[int, bool] | None = None
    #: By size class: its steps since its last probe (a class the batch passes through
    #: as rows join is probed by its own steps, not the others'), the steps between
    #: probes, and the verdict when the last probe began.
    _since_probe: Counter[int] = attrs.field(factory=Counter)
    _interval: dict[int, int] = attrs.field(factory=dict)
    _verdict: dict[int, bool] = attrs.field(factory=dict)
    #: Steps left of the current probe, and what it runs (speculating or not).
    _probing: int = 0
    _probe_kind: bool = False
    #: The draft model's drafts for every row at once (the ``draft_model`` method).
    batch: DraftBatch | None = None

    def __attrs_post_init__(self) -> None:
        if self.settings.draft is not None:
            self.batch = DraftBatch(self.settings.draft)

    def join(self, uid: int, params: SamplingParams) -> None:
        """A row joined the batch under ``uid``; it speculates unless it opted out."""
        if not params.speculate or params.xtc_probability > 0:
            return
        self.rows[uid] = RowDraft(
            PromptLookup() if self.batch is None else None,
            target_filter(params),
            self.settings.num_draft_tokens,
        )

    def part(self, uid: int) -> None:
        self.rows.pop(uid, None)
        if self.batch is not None:
            self.batch.part(uid)

    def observe(
        self, rows: int, tried: bool, tokens: int, seconds: float, settled: bool = True
    ) -> None:
        """A step of ``rows`` rows emitted ``tokens`` in ``seconds`` (from the previous
        step's end to its own); ``tried``: it tried to speculate (a look that found no
        draft cost the step its pipelining, so it counts as speculating). Only a step
        of the same kind as the one before counts: a step after a change of kind pays
        for, or skips, the other kind's pipelining; nor does one that is not
        ``settled`` (it carried prefill work, or came just after: ``UNSETTLED_STEPS``)."""
        kind, before = (_size_class(rows), tried), self._last_kind
        self._last_kind = kind
        if kind != before or not settled or not 0.0 < seconds <= MAX_INTERVAL:
            return
        for means, value in ((self.rates, tokens / seconds / rows), (self.durations, seconds)):
            old = means.get(kind)
            means[kind] = value if old is None else old + RATE_WEIGHT * (value - old)

    def _probe_cost(self, size: int, speculate: bool) -> float:
        """What a probe of the kind not running costs a size class, in steps of the kind
        running: its steps' time, in those steps, times the share of it lost."""
        now, probe = (size, speculate), (size, not speculate)
        # observe() writes both means together, and only for intervals above zero.
        if probe not in self.rates or not self.rates.get(now):
            return 0.0
        lost = max(0.0, 1.0 - self.rates[probe] / self.rates[now])
        return PROBE_STEPS * self.durations[probe] / self.durations[now] * lost

    def _governed(self, rows: int) -> bool:
        """The governor: whether this step may speculate. Speculation is measured first,
        then plain steps; after that a batch size class speculates where it measured at
        least ``MARGIN`` times as fast as plain steps, and every ``PROBE_EVERY`` of its
        steps (more, up to ``PROBE_MAX``, while probes change nothing; more still where a
        probe is dear: ``PROBE_SHARE``) the other kind runs ``PROBE_STEPS`` steps to keep
        its rate current."""
        if self._probing > 0:
            self._probing -= 1
            return self._probe_kind
        size = _size_class(rows)
        spec, plain = self.rates.get((size, True)), self.rates.get((size, False))
        if spec is None:
            return True
        self._since_probe[size] += 1
        speculate = plain is not None and spec >= MARGIN * plain
        if plain is not None and not speculate:
            self.held_back += 1
        interval = self._interval.get(size, PROBE_EVERY)
        if plain is None or self._since_probe[size] >= interval:
            # Plain steps not measured yet, or a probe of the kind not running now.
            if plain is not None:
                same = self._verdict.get(size) == speculate
                backoff = min(PROBE_MAX, 2 * interval) if same else PROBE_EVERY
                dear = min(PROBE_LIMIT, self._probe_cost(size, speculate) / PROBE_SHARE)
                self._interval[size] = max(backoff, int(dear))
                self._verdict[size] = speculate
            self._since_probe[size], self._probing = 0, PROBE_STEPS - 1
            self._probe_kind = plain is not None and not speculate
            return self._probe_kind
        return speculate

    def wanted(self, uids: Sequence[int]) -> bool:
        """Whether this step may speculate (decided before the pending tokens are read):
        not above ``max_batch`` rows, nor where it measured slower than plain steps;
        each paused row's pause counts down one step."""
        if len(uids) > self.settings.max_batch:
            return False
        if self.settings.governed and not self._governed(len(uids)):
            return False
        ready = False
        rows = self.rows
        for uid in uids:
            row = rows.get(uid)
            if row is None:
                continue
            if row.pause > 0:
                row.pause -= 1
            else:
                ready = True
        return ready

    def plan(
        self,
        uids: Sequence[int],
        histories: Sequence[Sequence[int]],
        pending: Any,
        eligible: Sequence[bool],
    ) -> list[Any]:
        """Each row's drafts for this step (empty: it does not speculate now), made
        without reading ``pending``, the rows' pending tokens (a lazy array): lists of
        token ids looked up from the tokens before them, or a draft model's lazy arrays
        drafted from ``pending`` (every draft-model row drafts in the same forwards; a
        paused or ineligible one is fed its tokens there, so it never falls far behind)."""
        if self.batch is not None:
            members = []
            for e, (uid, history, ok) in enumerate(zip(uids, histories, eligible, strict=True)):
                row = self.rows.get(uid)
                if row is not None:
                    members.append((e, uid, history, row.k if ok and row.pause == 0 else 0))
            return self.batch.draft(len(uids), members, pending)
        drafts: list[Any] = []
        for uid, history, ok in zip(uids, histories, eligible, strict=True):
            row = self.rows.get(uid)
            if row is None or not ok:
                drafts.append([])
                continue
            if row.pause > 0:
                drafts.append([])
                continue
            assert row.drafter is not None
            draft = row.drafter.following(history, row.k)
            if draft:
                row.idle = 0
            else:
                # Looking costs host time each step: a row whose text is not
                # repeating anything looks less often.
                row.pause = min(MAX_IDLE_PAUSE, 1 << row.idle)
                row.idle += 1
            drafts.append(draft)
        return drafts

    def record(
        self, uids: Sequence[int], drafts: Sequence[list[int]], taken: Sequence[int]
    ) -> None:
        """Count a step's drafts and acceptances; adapt each row's ``K``."""
        self.steps += 1
        method = self.settings.method
        limit = self.settings.num_draft_tokens
        if self.batch is not None:
            self.batch.settle(dict(zip(uids, taken, strict=True)))
        for uid, draft, n in zip(uids, drafts, taken, strict=True):
            if not draft:
                continue
            self.drafted[method] += len(draft)
            self.accepted[method] += n
            row = self.rows.get(uid)
            if row is None:
                continue
            if row.drafter is not None:
                row.drafter.settle(n)
            if n == len(draft):
                row.k, row.misses = min(limit, row.k + 1), 0
            else:
                row.k = max(1, n)
            if n == 0:
                row.pause = min(MAX_PAUSE, 1 << row.misses)
                row.misses += 1
            else:
                row.misses = 0


def accepted(
    logits: Any,
    drafts: Sequence[list[int]],
    sampled: Sequence[tuple[float, Callable[[Any], Any]] | None],
    targets: Any = None,
) -> tuple[list[int], list[int | None]]:
    """Each row's accepted draft count and, for a sampled row, its next token.

    ``logits`` (rows, width, vocabulary) are the target's over each row's pending
    token and drafts. A greedy row (``sampled`` None) accepts drafts while they
    equal the argmax before them; its next token is the argmax after the last
    accepted one (``targets``, the argmax over ``logits`` if already evaluated, saves
    a read back). A sampled row accepts
    draft ``x`` with probability ``p(x)`` and, at the first rejection, draws its
    next token from ``p`` with ``x`` removed (renormalised); with every draft
    accepted, from ``p`` after the last. Rows without drafts: 0, None.
    """
    import mlx.core as mx

    counts = [0] * len(drafts)
    nexts: list[int | None] = [None] * len(drafts)
    greedy_rows = [e for e, d in enumerate(drafts) if d and sampled[e] is None]
    if greedy_rows:
        if targets is None:
            targets = mx.argmax(logits, axis=-1)
        every: list[list[int]] = targets.tolist()
        for e in greedy_rows:
            target = every[e]
            n = 0
            for j, token in enumerate(drafts[e]):
                if token != target[j]:
                    break
                n += 1
            counts[e], nexts[e] = n, target[n]
    for e, draft in enumerate(drafts):
        how = sampled[e]
        if not draft or how is None:
            continue
        temperature, apply = how
        k = len(draft)
        row = logits[e, : k + 1].astype(mx.float32)
        logprobs = apply(row - mx.logsumexp(row, axis=-1, keepdims=True))
        probs = mx.softmax(logprobs * (1 / temperature), axis=-1)
        chosen = mx.take_along_axis(probs[:k], mx.array(draft)[:, None], axis=-1)[:, 0]
        accept: Any = (mx.random.uniform(shape=(k,)) < chosen).tolist()
        n = next((j for j, ok in enumerate(accept) if not ok), k)
        p = probs[n]
        if n < k:
            p = p * (mx.arange(p.shape[-1]) != draft[n])
        counts[e] = n
        drawn: Any = mx.random.categorical(mx.log(p)).item()
        nexts[e] = int(drawn)
    return counts, nexts


def roll_back(caches: Sequence[Any], width: int, taken: Sequence[int]) -> None:
    """Cut the positions the rows rejected out of a step's caches.

    The step appended ``width`` positions to every row (its pending token and
    ``width - 1`` drafts or padding); row ``e`` keeps ``1 + taken[e]``. Every
    layer is cut to the longest kept run, and each row that kept fewer is
    shifted right so that its tokens end at the batch's index (its left padding
    grows by the shift). Plain ``KVCache`` layers (a row decoding alone) are cut.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    longest = max(taken)
    cut = width - 1 - longest
    for c in caches:
        if cut:
            c.trim(cut)
    if type(caches[0]) is KVCache:
        return
    shifts = [longest - n for n in taken]
    if not any(shifts):
        return
    shift = mx.array(shifts)
    end = caches[0]._idx
    positions = mx.maximum(mx.arange(end)[None, :] - shift[:, None], 0)[:, None, :, None]
    for c in caches:
        for name in ("keys", "values"):
            buffer = getattr(c, name)
            used = buffer[..., :end, :]
            index = mx.broadcast_to(positions, (*used.shape[:3], 1))
            buffer[..., :end, :] = mx.take_along_axis(used, index, axis=2)
        c.offset = c.offset - shift
        c.left_padding = c.left_padding + shift
