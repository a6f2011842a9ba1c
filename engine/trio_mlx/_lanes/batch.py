"""The batch lane: continuous batching on mlx-lm's ``BatchGenerator`` (MLX thread only).

Every row carries its own sampler and logits processors, so the whole
:class:`~trio_mlx.SamplingParams` surface batches. One :meth:`BatchLane.step` call is one
worker call: it removes cancelled rows, inserts admitted and resumed ones, runs one
``BatchGenerator.next()`` (or a short burst) and returns every row's
:class:`~trio_mlx._lanes.output.RowEvent` at once. Admitted rows reach mlx-lm's prompt batch
within ``prefill_budget`` tokens per step (``_feed``); rows that finish prefill join the
decode batch without a forward pass of their own.

Rows are finished by the lane, not by mlx-lm (``RowOutput`` applies ``max_tokens``, EOS and
stop strings), so a finished or cancelled row stops producing output at once while its KV
slot is freed later, in bulk: *deferred removal* (one ``BatchGenerator.remove`` for every
dead row: when rows are admitted or resumed, when dead rows reach ``removal_fraction`` of
the live ones, when the oldest has been dead ``removal_delay`` decode steps, or when no live
row is left; never by a clock, so every rank of distributed mode removes alike).

Parking (preemption) takes a row's KV cache out (``return_prompt_caches=True``). Decode is
pipelined, so that cache holds the last emitted token: it is trimmed by one and the row
re-inserted as ``[[last_token]]`` with ``all_tokens = tokens[:-1]``, token for token like an
uninterrupted run (a row not stepped since it was back holds no last token: nothing is
trimmed). Image rows' prefill: :mod:`~trio_mlx._lanes.image_prefill`; mlx-lm's batch
classes' subclasses (private fields): :mod:`trio_mlx._lanes.mlxlm_batch`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs

from trio_mlx._adapters.multilora import AdapterStack
from trio_mlx._errors import NotFound
from trio_mlx._lanes.image_prefill import ImagePrefills
from trio_mlx._lanes.mlxlm_batch import generation_class, prompt_class, rounded_width
from trio_mlx._lanes.output import RowEvent, RowOutput, merge_events
from trio_mlx._lanes.processors import make_row_sampler, row_processors
from trio_mlx._lanes.prompt_cache import PromptCache
from trio_mlx._lanes.records import DECODE, RowSpec, StepPlan, StepResult
from trio_mlx._lanes.rows import UNBOUNDED, Dead, Guarded, Row, RowModel
from trio_mlx._lanes.slow_steps import SlowStepLog, buffer_length, gc_seconds, memory_now
from trio_mlx._lanes.speculative import UNSETTLED_STEPS, Speculation, Speculator, cache_reason
from trio_mlx._lanes.structured import GrammarBatch

__all__ = ["BatchLane"]

logger = logging.getLogger("trio_mlx")


@attrs.define(eq=False)
class BatchLane:
    """The continuous batch. Construct and call only on the MLX thread."""

    model: Any
    tokenizer: Any
    max_batch: int
    prompt_cache: PromptCache | None = None
    cache_key: Hashable = "base"
    prefill_step_size: int = 2048
    prefill_batch_size: int = 16
    #: Shortest cached prefix worth taking from the prompt cache (tokens): a
    #: shorter one (a chat template's shared header) is prefilled instead.
    cache_min_prefix: int = 64
    #: Most prompt tokens prefilled per decode step, padded as mlx-lm pads them
    #: (rows x the longest chunk); None: mlx-lm's bounds only. See ``_feed``.
    prefill_budget: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    #: The chunk a long prompt is cut into, when smaller than the budget: a longer
    #: prompt is prefilled alone, a chunk a step, and no pass holds more while it
    #: waits or prefills, unless the server is behind (``_feed``, ``_shielded``).
    #: None: the budget's.
    long_prompt_chunk: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    #: Experimental, off (1): prefill passes right-padded to a multiple of this
    #: width (design/performance.md: it did not lower the worst step on the H200).
    prefill_width_multiple: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: Most decode steps a dead row keeps its KV slot (see the module's notes).
    removal_delay: int = 16
    #: Remove dead rows once there are at least live / removal_fraction of them (0: never by count).
    removal_fraction: int = 8
    #: Compute every constrained row's grammar mask of a decode step together
    #: (:class:`~trio_mlx._lanes.structured.GrammarBatch`); False: each row's processor alone.
    grammar_batch: bool = True
    #: Decode a row alone in the batch over plain ``KVCache``s (see ``_Generation``);
    #: False: as a one-row batch (``TRIO_MLX_SOLO_DECODE=0``, for side-by-side runs).
    solo_decode: bool = True
    #: Decode steps traced once per batch shape (:mod:`trio_mlx._accel.traced_decode`)
    #: once a traced step matched the model's own; the loader sets it (on on CUDA).
    traced_decode: bool = False
    #: Keep prompt-cache checkpoints of each row's prefill (its stable prefix and its
    #: whole prompt, see :mod:`trio_mlx._lanes.prompt_cache`). None: where the
    #: model's caches may become untrimmable (any layer not a plain ``KVCache``);
    #: a ``KVCache`` row's end-of-generation entry is cut back to them instead
    #: (the loader sets it when the prompt cache has a disk tier: what it keeps).
    prompt_checkpoints: bool | None = None
    #: A vision model's :class:`~trio_mlx._start.vision.Vision`, which prefills image rows.
    vision: Any = None
    #: The mounted plain LoRA adapters, stacked (set by the engine; None: no adapters).
    adapter_stack: Callable[[], AdapterStack] | None = None
    #: A decode step this slow is logged (``SlowStepLog``), once per ``slow_step_quiet`` s.
    slow_step_seconds: float = 0.5
    slow_step_quiet: float = 10.0
    #: Speculative decoding (:mod:`trio_mlx._lanes.speculative`); None: off.
    speculation: Speculation | None = None
    #: Its state while on (None: off, or the model's caches cannot roll back).
    speculator: Speculator | None = attrs.field(init=False, default=None)
    #: Seconds spent inside ``BatchGenerator.next()``, and its calls (decode steps).
    generator_seconds: float = attrs.field(init=False, default=0.0)
    decode_steps: int = attrs.field(init=False, default=0)
    _slow_log: SlowStepLog = attrs.field(init=False, factory=SlowStepLog)
    #: Rows inserted per adapter name (base rows not counted); the stack whose layers
    #: are on the model during the current ``next()`` (else None).
    adapter_rows: Counter[str] = attrs.field(init=False, factory=Counter)
    _active_stack: AdapterStack | None = attrs.field(init=False, default=None)
    _generator: Any = attrs.field(init=False, default=None)
    _rows: dict[int, Row] = attrs.field(init=False, factory=dict)
    _by_uid: dict[int, int] = attrs.field(init=False, factory=dict)
    #: Dead rows by generator uid (see deferred removal in the module's notes).
    _dead: dict[int, Dead] = attrs.field(init=False, factory=dict)
    _eos_ids: frozenset[int] = attrs.field(init=False, factory=frozenset)
    #: The decode steps' shared grammar masks (see ``grammar_batch``).
    grammar: GrammarBatch = attrs.field(init=False, factory=GrammarBatch)
    #: Rows waiting to be handed to the generator for prefill, in arrival order.
    _waiting: deque[int] = attrs.field(init=False, factory=deque)
    #: Generator uids in prefill -> prompt tokens it has still to prefill.
    _prefilling: dict[int, int] = attrs.field(init=False, factory=dict)
    #: Generator uids in prefill whose prompt was longer than ``long_prompt_chunk``
    #: when it joined (pruned against ``_prefilling`` when read).
    _long_prefills: set[int] = attrs.field(init=False, factory=set)
    #: Rows whose processor failed since the last decode step looked (see ``Guarded``).
    _failed: list[Row] = attrs.field(init=False, factory=list)
    #: The current step call's prefill chunk (its plan's ``prefill_chunk``; None: the budget).
    _chunk: int | None = attrs.field(init=False, default=None)
    #: The current step call's (prompt tokens, seconds) per decode step.
    _timings: list[tuple[int, float]] = attrs.field(init=False, factory=list)
    #: The traced step once built (see ``traced_decode``).
    _traced: Any = attrs.field(init=False, default=None)
    #: Generator uids in prefill whose checkpoints are kept -> their prompt cache key.
    _marks: dict[int, Hashable] = attrs.field(init=False, factory=dict)
    _images: ImagePrefills = attrs.field(init=False, factory=ImagePrefills)  # image prefills

    def __attrs_post_init__(self) -> None:
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        caches = make_prompt_cache(self.model)
        if self.speculation is not None and not (reason := cache_reason(caches)):
            self.speculator = Speculator(self.speculation)
        elif self.speculation is not None:
            logger.info("speculative decoding is off for this model: %s", reason)
        self._generator = self._new_generator()
        if self.prompt_checkpoints is None:
            self.prompt_checkpoints = any(type(c) is not KVCache for c in caches)

    def _new_generator(self) -> Any:
        from mlx_lm.generate import BatchGenerator

        # Every forward call goes through RowModel, which sets per-row adapter slots.
        model = RowModel(self.model, self)
        generator = BatchGenerator(
            model,
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(self.max_batch, self.prefill_batch_size),
            prefill_step_size=self.prefill_step_size,
        )
        # The decode batch every row joins and the prompt batch every arrival is
        # prefilled in (mlx-lm extends these two objects): the lane's subclasses.
        generation = generation_class().empty(model, generator.sampler)
        generation.grammar = self.grammar if self.grammar_batch else None
        generation.fresh = set()
        generation.logprob_uids = set()
        generation.grammar_uids = set()
        generation.solo_allowed = self.solo_decode
        generation.speculator = self.speculator
        generator._generation_batch = generation
        generator._prompt_batch = prompt_class().empty(
            model, generator.sampler, prefill_step_size=self.prefill_step_size
        )
        return generator

    @property
    def _fresh(self) -> set[int]:
        """Uids in the decode batch whose next emitted token is their prompt's last one."""
        fresh: set[int] = self._generator._generation_batch.fresh
        return fresh

    @property
    def _logprob_uids(self) -> set[int]:
        """Uids in the decode batch whose rows read their logprobs (see generation_class)."""
        uids: set[int] = self._generator._generation_batch.logprob_uids
        return uids

    @property
    def _grammar_uids(self) -> set[int]:
        """Uids in the batch (dead or alive) with a grammar processor (see generation_class)."""
        uids: set[int] = self._generator._generation_batch.grammar_uids
        return uids

    def _joined(self, row: Row, uid: int) -> None:
        """Bookkeeping of a row that got the generator's ``uid``."""
        row.uid = uid
        self._by_uid[uid] = row.spec.id
        if row.spec.params.logprobs:
            self._logprob_uids.add(uid)
        if row.spec.constraint is not None:
            self._grammar_uids.add(uid)
        if self.speculator is not None:
            self.speculator.join(uid, row.spec.params)

    def _parted(self, uid: int) -> None:
        """Bookkeeping of a row that stops decoding under ``uid`` (the reverse of ``_joined``)."""
        self._by_uid.pop(uid, None)
        self._marks.pop(uid, None)
        self._logprob_uids.discard(uid)
        if self.speculator is not None:
            self.speculator.part(uid)

    @property
    def rows(self) -> int:
        """Rows in the lane, parked ones included (dead ones not)."""
        return len(self._rows)

    def uses_adapter(self, name: str) -> bool:
        """Whether a row in the lane (in the batch or parked) runs under the adapter ``name``."""
        return any(row.adapter == name for row in self._rows.values())

    def _stack(self) -> AdapterStack | None:
        return self.adapter_stack() if self.adapter_stack is not None else None

    def _slot(self, uid: int, stack: AdapterStack) -> int:
        """The adapter slot of the generator's row ``uid`` (0: base; a dead row decodes as base)."""
        row_id = self._by_uid.get(uid)
        if row_id is None:
            return 0
        name = self._rows[row_id].adapter
        return 0 if name is None else stack.slots[name]

    def _key(self, row: Row) -> Hashable:
        """The row's prompt cache key: its adapter's, and its images' (their pixels' hashes)."""
        key: Hashable = self.cache_key
        if row.adapter is not None:
            stack = self._stack()
            mount = stack.mounts.get(row.adapter) if stack is not None else None
            key = (self.cache_key, "adapter", row.adapter, mount)
        images = row.spec.images
        return key if images is None else (key, "images", images.digests)

    @property
    def dead_rows(self) -> int:
        """Finished or cancelled rows whose KV slots the batch still holds."""
        return len(self._dead)

    @property
    def solo(self) -> bool:
        """Whether the batch's one row is decoding over plain caches (``solo_decode``)."""
        return bool(self._generator._generation_batch.solo)

    @property
    def traced(self) -> Any:
        """The traced decode step in use (a :class:`~trio_mlx._accel.traced_decode.TracedDecode`), or None."""
        return self._traced

    def after_job(self) -> None:
        """After an exclusive job: a traced step over weights the job replaced is dropped
        (built and checked again at the next decode step)."""
        from trio_mlx._accel import traced_decode as _traced_decode

        if self._traced is not None and self._traced.weights != _traced_decode.weights(self.model):
            self._traced = None

    def _trace(self) -> None:
        """Build and check the traced decode step; off for good if it does not match."""
        from trio_mlx._accel import traced_decode as _traced_decode

        self._traced = _traced_decode.build(self.model)
        self.traced_decode = self._traced is not None

    def _result(self, events: list[RowEvent], cached: dict[int, int], steps: int) -> StepResult:
        timings, self._timings = tuple(self._timings), []
        return StepResult(
            events, cached, len(self._rows), steps, len(self._by_uid), len(self._dead), timings
        )

    def step(
        self,
        plan: StepPlan = DECODE,
        *,
        seconds: float = 0.0,
        interrupt: Callable[[], bool] | None = None,
    ) -> StepResult:
        """Remove, insert and resume ``plan``'s rows, then run one decode step, or a burst of them.

        With ``plan.steps > 1`` the lane keeps decoding, up to that many steps or
        until ``seconds`` have passed, and stops early after any step in which
        a row finished, failed or produced its first token, or once
        ``interrupt()`` is true (the actor has news: a cancel, a submission).
        A row's tokens from the whole burst come back as one event.
        """
        inserts, resumes, steps = plan.inserts, plan.resumes, plan.steps
        self._chunk = plan.prefill_chunk
        events: list[RowEvent] = []
        cached: dict[int, int] = {}
        start = time.perf_counter()
        self._kill(plan.removes, store=False)
        compacted = 0
        if self._dead and (inserts or resumes or self._compaction_due()):
            compacted = len(self._dead)
            self._compact()
        for spec in inserts:
            try:
                cached[spec.id] = self._insert(spec)
            except Exception as exc:
                self._rows.pop(spec.id, None)
                events.append(RowEvent(spec.id, error=exc))
        for row_id in resumes:
            try:
                self._resume(row_id)
            except Exception as exc:
                self._drop(row_id)
                events.append(RowEvent(row_id, error=exc))
        elapsed = time.perf_counter() - start
        if elapsed >= self.slow_step_seconds and (compacted or inserts or resumes):
            self._slow_log.admission(
                self.slow_step_quiet,
                f"{elapsed * 1000:.0f} ms; {compacted} "
                f"dead rows compacted, {len(inserts)} rows inserted, {len(resumes)} resumed, "
                f"{len(self._by_uid)} rows in the batch",
            )
        decoded = 0
        if self._by_uid or self._waiting or self._images.jobs:
            burst, decoded = self._burst(steps, seconds, interrupt)
            events.extend(burst)
        return self._result(events, cached, decoded)

    def _burst(
        self, steps: int, seconds: float, interrupt: Callable[[], bool] | None
    ) -> tuple[list[RowEvent], int]:
        start = time.perf_counter()
        # Every row with an event in the burst, in order of its first: its error
        # events. A row's tokens gather in its RowOutput (in ``outputs``) and
        # become one event when the burst ends.
        order: dict[int, list[RowEvent]] = {}
        outputs: dict[int, RowOutput] = {}
        decoded = 0
        while True:
            # News for the arbiter (a row ended) or the consumer (a first token).
            news = self._decode(order, outputs)
            decoded += 1
            for dead in self._dead.values():
                dead.age += 1
            if self._dead and self._compaction_due():
                self._compact()
            if (
                news
                or decoded >= steps
                or not (self._by_uid or self._waiting or self._images.jobs)
                or time.perf_counter() - start >= seconds
                or (interrupt is not None and interrupt())
            ):
                events = []
                for row_id, errors in order.items():
                    output = outputs.get(row_id)
                    if output is None:
                        events.append(merge_events(errors))
                    else:
                        event = output.take()
                        events.append(merge_events([event, *errors]) if errors else event)
                return events, decoded

    def _compaction_due(self) -> bool:
        """Whether the dead rows should leave the batch now (see the module's notes)."""
        live = len(self._by_uid)
        return (
            not live
            or len(self._dead) * self.removal_fraction >= live
            # The first dead row is the oldest: rows die in order and age together.
            or next(iter(self._dead.values())).age >= self.removal_delay
        )

    def _compact(self) -> None:
        """Take every dead row out of the batch in one ``remove``; keep finished rows' caches."""
        dead, self._dead = self._dead, {}
        if not dead:
            return
        keep = [uid for uid, d in dead.items() if d.store]
        entries: dict[Hashable, list[tuple[list[int], list[Any]]]] = {}
        if keep and self.prompt_cache is not None:
            from mlx_lm.models.cache import trim_prompt_cache

            for uid, (cache, tokens) in self._generator.extract_cache(keep).items():
                # Tokens decoded after the row died are no one's: trim them off
                # (a cache that cannot be cut back is not kept: its prompt's
                # checkpoints stand in for it).
                age = dead[uid].age
                if age:
                    if not trim_prompt_cache(cache, age):
                        continue
                    tokens = tokens[:-age]
                entries.setdefault(dead[uid].key, []).append((list(tokens), cache))
        self._generator.remove(list(dead))
        self._fresh.difference_update(dead)
        self._grammar_uids.difference_update(dead)
        for uid in dead:
            self._prefilling.pop(uid, None)
        if self.prompt_cache is not None:
            for key, stored in entries.items():
                self.prompt_cache.store_many(key, stored)

    def _kill(self, ids: Sequence[int], *, store: bool) -> None:
        """Rows stop at once (no more events); their KV slots go with the next compaction."""
        self._images.drop(ids)
        for row_id in ids:
            row = self._rows.pop(row_id, None)
            if row is not None and row.uid is not None:
                self._parted(row.uid)
                self._dead[row.uid] = Dead(
                    row_id, store and self.prompt_cache is not None, self._key(row)
                )

    def close(self) -> None:
        """Drop every row and release the generator (on the MLX thread, at shutdown)."""
        if self._traced is not None:
            logger.info("traced decode: %s", self._traced.summary())
        self._rows.clear()
        self._by_uid.clear()
        self._waiting.clear()
        self._images.drop(list(self._images.jobs))
        self._generator.close()
        self._restart_generator()
        if self.prompt_cache is not None:
            self.prompt_cache.close()

    def _restart_generator(self) -> None:
        """A fresh generator, and no dead, prefilling or failed rows of the old one."""
        for rows in (self._dead, self._prefilling, self._long_prefills, self._failed):
            rows.clear()
        self._generator = self._new_generator()

    def discard(self, ids: Sequence[int]) -> int:
        """Remove rows (and every dead one) without decoding; returns the rows left."""
        self._kill(ids, store=False)
        self._compact()
        return len(self._rows)

    def park(self, ids: Sequence[int]) -> None:
        """Take rows out of the batch, keeping their KV caches to resume later."""
        import mlx.core as mx

        self._compact()
        rows = [self._rows[i] for i in ids if i in self._rows]
        self._images.drop(ids)  # an image row's prefill too
        for row in rows:
            row.waiting = None  # not prefilled yet: it starts from its prompt again
        if any(row.uid is None for row in rows):
            self._waiting = deque(i for i in self._waiting if i not in set(ids))
        uids = [row.uid for row in rows if row.uid is not None]
        caches = self._generator.remove(uids, return_prompt_caches=True) if uids else {}
        fresh = self._fresh
        kept = []
        for row in rows:
            if row.uid is None:
                continue
            self._parted(row.uid)
            self._grammar_uids.discard(row.uid)
            entry = caches.get(row.uid)
            row.parked = None
            if row.output.generated > 0 and entry is not None and row.last_token is not None:
                cache, tokens = entry
                if row.uid in fresh:
                    # Not stepped since it was resumed: the cache ends before last_token.
                    tokens = [*tokens, row.last_token]
                else:
                    for layer in cache:
                        layer.trim(1)
                kept.append(cache)
                row.parked = (cache, list(tokens))
            fresh.discard(row.uid)
            self._prefilling.pop(row.uid, None)
            row.uid = None
        # Materialized now (one sync for all): a lazy slice would keep the batch's buffers alive.
        mx.eval([layer.state for cache in kept for layer in cache])

    def fail_all(self, error: BaseException) -> list[RowEvent]:
        """Fail and forget every row in the batch (parked rows stay)."""
        events = []
        for row_id, row in list(self._rows.items()):
            if row.uid is not None:
                events.append(RowEvent(row_id, error=error, generated=row.output.generated))
                self._drop(row_id)
        return events

    def _insert(self, spec: RowSpec) -> int:
        adapter = spec.params.adapter
        if adapter is not None:
            stack = self._stack()
            if stack is None or adapter not in stack.slots:
                raise NotFound(f"no adapter named {adapter!r} is mounted", param="adapter")
            self.adapter_rows[adapter] += 1
        row = Row(
            spec,
            RowOutput(spec.id, spec.params, self._eos_ids, self.tokenizer.detokenizer),
            make_row_sampler(spec.params, self.tokenizer),
            [],
        )
        row.processors = [
            Guarded(row, p, self._failed) for p in row_processors(spec, sorted(self._eos_ids))
        ]
        self._rows[spec.id] = row
        return self._start(row)

    def _start(self, row: Row) -> int:
        """Queue a new (or restarted) row for prefill; returns the tokens the prompt cache serves."""
        if row.spec.images is not None:  # its images prefilled first, unless cached
            return self._images.start(self, row)
        prompt = list(row.spec.prompt)
        cache, rest = None, prompt
        if self.prompt_cache is not None:
            cache, rest = self.prompt_cache.fetch(
                self._key(row), prompt, min_prefix=self.cache_min_prefix, share=True
            )
        row.waiting = (prompt, cache, rest)
        self._waiting.append(row.spec.id)
        return len(prompt) - len(rest)

    def _feed(self) -> list[RowEvent]:
        """Hand waiting rows to the generator, oldest first, within ``prefill_budget``.

        mlx-lm prefills every prompt of its prompt batch in the same forward
        pass, right-padded to the longest chunk: a step costs the rows still
        prefilling times ``min(chunk, longest left)`` tokens. A row joins while
        that and the step's image prefill stay within the budget (one always may
        when none is prefilling), so a long prompt is cut into chunks interleaved with
        decode steps and short prompts are not padded to its length; the rest
        wait for a later step, in order. The step's plan may cut prompts into
        smaller chunks (``StepPlan.prefill_chunk``, the planner's stall bound);
        rows still join a pass while rows x width stays within the budget.
        While a prompt longer than ``long_prompt_chunk`` waits or prefills, the
        bound is that chunk instead (unless the rest of the backlog is past the
        budget: ``_shielded``): that prompt is prefilled alone, a chunk a step,
        and no pass is longer than one of its chunks. Dead rows are compacted
        first (the batch's KV is rebuilt when rows join anyway).
        """
        budget, long = self.prefill_budget, self.long_prompt_chunk
        left = [n for n in self._prefilling.values() if n > 0]
        bound, used = budget, self._images.used  # the image prefill's part of this step
        # Only read when rows wait: ``_feed`` runs every decode step.
        if (
            budget is not None
            and long is not None
            and long < budget
            and self._waiting
            and self._shielded(long, budget, left)
        ):
            bound = long
        chunk = min(x for x in (budget, long, self._chunk, self.prefill_step_size) if x is not None)
        self._generator.prefill_step_size = chunk
        prompts = self._generator._prompt_batch
        prompts.width_multiple, prompts.width_limit = self.prefill_width_multiple, chunk
        room = self.prefill_batch_size - len(self._prefilling)
        feed: list[Row] = []
        while self._waiting:
            row = self._rows.get(self._waiting[0])
            if row is None or row.waiting is None:
                self._waiting.popleft()  # cancelled, failed or parked while it waited
                continue
            n = len(row.waiting[2]) - 1  # mlx-lm prefills all but the last token
            if bound is not None and (left or feed or used):
                more = [*left, n] if n > 0 else left
                if room <= 0 or (more and len(more) * self._pass_width(more, chunk) + used > bound):
                    break
            self._waiting.popleft()
            feed.append(row)
            room -= 1
            if n > 0:
                left.append(n)
        events: list[RowEvent] = []
        if not feed:
            return events
        if self._dead:
            self._compact()
        for row in feed:
            try:
                self._insert_waiting(row)
            except Exception as exc:
                self._rows.pop(row.spec.id, None)
                events.append(RowEvent(row.spec.id, error=exc))
        return events

    def _shielded(self, long: int, budget: int, left: list[int]) -> bool:
        """Whether the streams are shielded from long passes now: a prompt longer
        than ``long`` tokens is prefilling or waiting to, and the prompt tokens
        of every other prompt prefilling (``left``, tokens to go) or waiting
        stay within ``budget``. Past that the server is behind on prefill, and
        passes of up to the budget serve the queue sooner (H200 open loop:
        design/performance.md)."""
        rows = (self._rows.get(row_id) for row_id in self._waiting)
        waiting = [len(r.waiting[2]) - 1 for r in rows if r is not None and r.waiting is not None]
        backlog = left + waiting
        self._long_prefills.intersection_update(self._prefilling)
        if not self._long_prefills and max(backlog, default=0) <= long:
            return False
        return sum(backlog) - max(backlog, default=0) <= budget

    def _pass_tokens(self) -> int:
        """Prompt tokens (padded) the next ``BatchGenerator.next()`` prefills."""
        left = [n for n in self._prefilling.values() if n > 0]
        return len(left) * self._pass_width(left, self._generator.prefill_step_size) if left else 0

    def _pass_width(self, left: list[int], chunk: int) -> int:
        """How wide mlx-lm's next prefill pass is for rows with ``left`` tokens to go."""
        return rounded_width(min(chunk, max(left)), self.prefill_width_multiple, chunk)

    def _insert_waiting(self, row: Row) -> None:
        assert row.waiting is not None
        prompt, cache, rest = row.waiting
        row.waiting = None
        done = len(prompt) - len(rest)
        # mlx-lm prefills segment by segment and reports each one's end: the
        # stable prefix is one, and all but the last token another (mlx-lm
        # splits the last token off), where the row's checkpoints are taken.
        segments = [rest]
        mark = self.prompt_checkpoints and self.prompt_cache is not None
        stable = row.spec.checkpoint
        if mark and stable is not None and done < stable < len(prompt) - 1:
            segments = [rest[: stable - done], rest[stable - done :]]
        (uid,) = self._generator.insert_segments(
            [segments],
            max_tokens=[UNBOUNDED],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:done]],
            samplers=[row.sampler],
            logits_processors=[row.processors],
        )
        self._joined(row, uid)
        self._prefilling[uid] = len(rest) - 1
        if mark and len(rest) > 1 and len(prompt) > self.cache_min_prefix:
            self._marks[uid] = self._key(row)
        if self.long_prompt_chunk is not None and len(rest) - 1 > self.long_prompt_chunk:
            self._long_prefills.add(uid)

    def _checkpoint(self, uids: list[int]) -> None:
        """Keep the caches of rows that just prefilled a segment (see ``_insert_waiting``)."""
        from trio_mlx._lanes.prompt_cache import PREFIX, PROMPT

        cache_store = self.prompt_cache
        assert cache_store is not None
        for uid, (cache, tokens) in self._generator.extract_cache(uids).items():
            row_id = self._by_uid.get(uid)
            if row_id is None:
                continue
            whole = len(tokens) >= len(self._rows[row_id].spec.prompt) - 1
            cache_store.checkpoint(
                self._marks[uid], list(tokens), cache, PROMPT if whole else PREFIX
            )

    def _resume(self, row_id: int) -> None:
        row = self._rows[row_id]
        if row.parked is None or row.last_token is None:
            self._start(row)
            return
        cache, tokens = row.parked
        row.parked = None
        (uid,) = self._generator.insert(
            [[row.last_token]],
            max_tokens=[UNBOUNDED],
            caches=[cache],
            all_tokens=[tokens[:-1]],
            samplers=[row.sampler],
            logits_processors=[row.processors],
        )
        self._joined(row, uid)

    def _drop(self, row_id: int) -> None:
        if (row := self._rows.pop(row_id, None)) is not None and row.uid is not None:
            self._parted(row.uid)

    def _decode(self, order: dict[int, list[RowEvent]], outputs: dict[int, RowOutput]) -> bool:
        """One decode step; adds its events to a burst's (see ``_burst``); whether any is news.

        Tokens go to the rows' outputs (``RowOutput.add``), errors to ``order``.
        """
        image_tokens, image_seconds, failed_images = self._images.run(self)
        news = False
        for event in [*failed_images, *self._feed()]:
            order.setdefault(event.id, []).append(event)
            news = True
        prefill = image_tokens + (self._pass_tokens() if self._prefilling else 0)
        if self.traced_decode and self._traced is None:
            self._trace()
        traced = self._traced
        before = (traced.traces, traced.traced_steps) if traced is not None else (0, 0)
        collected = gc_seconds[0]
        generation = self._generator._generation_batch
        generation.phases = generation.arrivals_step = None  # set again by a decode pass
        generation.unsettled = UNSETTLED_STEPS if prefill else generation.unsettled  # no rates
        memory = memory_now()
        start = time.perf_counter()
        stack = self._stack()
        if stack is not None and not (
            stack.modules and any(row.adapter is not None for row in self._rows.values())
        ):
            stack = None
        try:
            if stack is None:
                _prompt_responses, responses = self._generator.next()
            else:
                with stack.on(self.model):
                    self._active_stack = stack
                    try:
                        _prompt_responses, responses = self._generator.next()
                    finally:
                        self._active_stack = None
        except Exception as exc:
            # The generator's state is unknown now: start a fresh one.
            for event in self.fail_all(exc):
                order.setdefault(event.id, []).append(event)
            self._restart_generator()
            return True
        elapsed = time.perf_counter() - start
        self.decode_steps += 1
        self.generator_seconds += elapsed
        self._timings.append((prefill, elapsed + image_seconds))
        if elapsed >= self.slow_step_seconds:
            how = "eager"  # the model's own step, or no decode pass
            if traced is not None and traced.traced_steps > before[1]:
                how = f"traced, {traced.traces - before[0]} new shapes"
            self._slow_log.step(
                self.slow_step_quiet,
                self._generator,
                elapsed=elapsed,
                gc=gc_seconds[0] - collected,
                memory=memory,
                carried=(
                    f"{len(self._by_uid)} rows in the batch, a prefill pass of {prefill} "
                    f"positions, {len(self._prefilling)} rows prefilling, buffer "
                    f"{buffer_length(self._generator)} positions, {how}"
                ),
                step=self.decode_steps,
            )
        prefilling, marks = self._prefilling, self._marks
        checkpoints: list[int] = []
        for progress in _prompt_responses:
            if progress.end_of_prompt:
                prefilling.pop(progress.uid, None)
                marks.pop(progress.uid, None)
            elif progress.uid in prefilling:
                done, total = progress.progress
                prefilling[progress.uid] = max(0, total - done - 1)
                if progress.end_of_segment and progress.uid in marks:
                    checkpoints.append(progress.uid)
        if checkpoints:
            self._checkpoint(checkpoints)
        finished: list[int] = []
        failed: list[int] = []
        fresh = self._fresh
        by_uid, rows = self._by_uid, self._rows
        for uid, token, logprobs in responses:
            if fresh and uid in fresh:
                fresh.discard(uid)  # its prompt's last token (see generation_class)
                continue
            row_id = by_uid.get(uid)
            if row_id is None:
                continue  # a dead row
            if finished and finished[-1] == row_id:
                continue  # a speculative step's tokens after the row's last one
            row = rows[row_id]
            output = row.output
            if row.error is not None:
                error = RowEvent(row_id, error=row.error, generated=output.generated)
                order.setdefault(row_id, []).append(error)
                failed.append(row_id)
                continue
            row.last_token = token
            if row_id not in outputs:
                outputs[row_id] = output
                order.setdefault(row_id, [])
            finish = output.add(token, logprobs)
            if finish is not None:
                finished.append(row_id)
            elif output.generated == 1:
                news = True
        if self._failed:
            # A failed processor may belong to a row that got no response this step.
            for row in self._failed:
                row_id = row.spec.id
                if rows.get(row_id) is row and row_id not in failed:
                    order.setdefault(row_id, []).append(RowEvent(row_id, error=row.error))
                    failed.append(row_id)
            self._failed.clear()
        if finished:
            self._kill(finished, store=True)
        if failed:
            self._kill(failed, store=False)
        return news or bool(finished or failed)
