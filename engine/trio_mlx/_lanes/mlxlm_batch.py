"""The lane's fork of mlx-lm's batch classes (MLX thread only).

mlx-lm's ``BatchGenerator`` API moves between minor releases: its prompt and decode
batches are subclassed here (``prompt_class``, ``generation_class``) and their
private fields read and set, with the cache surgery the lane needs (filter, extract,
join rows). Pinned to mlx-lm <0.33, as the prompt cache's trie is."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

from trio_mlx._lanes.processors import LogitBias
from trio_mlx._lanes.rows import Guarded
from trio_mlx._lanes.speculative import Speculator, accepted, roll_back
from trio_mlx._lanes.structured import GrammarBatch, GrammarProcessor

__all__ = [
    "extract_row",
    "filter_caches",
    "generation_class",
    "join_caches",
    "one_row_cache",
    "plain_batch",
    "plain_cache",
    "prompt_class",
    "rounded_width",
]


def _shared_bias(processors: list[list[Any]] | None) -> LogitBias | None:
    """The logit bias, when it is the one processor of every row in the batch (else None)."""
    shared: LogitBias | None = None
    for row in processors or ():
        if not row or len(row) != 1:
            return None
        guarded = row[0]
        if (
            type(guarded) is not Guarded
            or guarded.row.error is not None
            or type(guarded.processor) is not LogitBias
        ):
            return None
        if shared is None:
            shared = guarded.processor
        elif guarded.processor.key != shared.key:
            return None
    return shared


def _verified(queued: Any, drafts: Sequence[Any], width: int, block: Any = None) -> Any:
    """A speculative step's input, ``(rows, width)``: each row's pending token (of the
    lazy ``queued``), its drafts (lists, or a draft model's lazy arrays), zeros after
    them; or, given a draft model's ``block`` (every row's drafts, ``(rows, K)``), its
    first ``width - 1`` columns after the pending tokens (a row's tokens past its own
    drafts are never accepted). Nothing is read back here."""
    import mlx.core as mx

    if block is not None:
        return mx.concatenate([queued[:, None], block[:, : width - 1].astype(queued.dtype)], axis=1)
    if all(isinstance(d, list) for d in drafts):
        tail = [[*d, *[0] * (width - 1 - len(d))] for d in drafts]
        return mx.concatenate([queued[:, None], mx.array(tail, dtype=queued.dtype)], axis=1)
    parts = []
    for e, d in enumerate(drafts):
        pad = mx.zeros((width - 1 - len(d),), dtype=queued.dtype)
        row = [queued[e : e + 1], d.astype(queued.dtype)] if len(d) else [queued[e : e + 1]]
        parts.append(mx.concatenate([*row, pad]))
    return mx.stack(parts)


def _processed(batch: Any, logits: Any, inputs: Any) -> tuple[Any, list[Any]]:
    """A decode step's logits after the rows' processors, and the token histories they read.

    A batch whose rows all carry the same logit bias and nothing else gets it
    in one add (the same sums as row by row; no processor reads a history).
    Otherwise each row with processors has its history extended by its input
    token and its processors applied to its own slice.
    """
    import mlx.core as mx

    per_row = batch.logits_processors or []
    bias = _shared_bias(per_row)
    if bias is not None:
        return bias(None, logits), []
    if not any(per_row):
        return logits, []
    histories: list[Any] = []
    slices: list[Any] = []
    for e, processors in enumerate(per_row):
        row_logits = logits[e : e + 1]
        if processors:
            history = batch._token_context[e].update_and_fetch(inputs[e : e + 1])
            histories.append(history)
            for processor in processors:
                row_logits = processor(history, row_logits)
        slices.append(row_logits)
    return mx.concatenate(slices, axis=0), histories


def _sampled(batch: Any, logprobs: Any) -> Any:
    """The next token of every row: one sampler call when the rows share a sampler."""
    import mlx.core as mx

    fallback = batch.fallback_sampler
    chosen = [s or fallback for s in batch.samplers or ()]
    if all(s is fallback for s in chosen):
        return fallback(logprobs)  # every row greedy (or none has its own sampler)
    if all(s is chosen[0] for s in chosen):
        return chosen[0](logprobs)
    return mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(chosen)], axis=0)


def plain_cache(cache: Any, padding: int) -> Any:
    """A one-row ``BatchKVCache`` as a plain ``KVCache`` over the same buffers.

    Without left padding the row's keys start at position 0, so the plain cache
    takes the batch cache's arrays as they are (no copy); with padding, the
    row's part is copied out.
    """
    from mlx_lm.models.cache import KVCache

    if padding:
        return cache.extract(0)
    plain = KVCache()  # type: ignore[no-untyped-call]
    plain.keys, plain.values, plain.offset = cache.keys, cache.values, cache._idx
    return plain


def one_row_cache(plain: Any) -> Any:
    """A plain ``KVCache`` back as a one-row ``BatchKVCache`` over the same buffers."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache([0])
    if plain.keys is not None:
        cache.keys, cache.values, cache._idx = plain.keys, plain.values, plain.offset
        cache.offset = mx.array([plain.offset])
    return cache


def plain_batch(caches: list[Any]) -> bool:
    """Whether every layer is a plain ``BatchKVCache`` holding keys, between passes
    (no right padding pending): the caches :func:`filter_caches` takes."""
    from mlx_lm.models.cache import BatchKVCache

    kind: Any = BatchKVCache  # mlx-lm's fields are untyped: no narrowing to its stubs
    return bool(caches) and all(
        type(c) is kind and c.keys is not None and c._right_padding is None for c in caches
    )


def _filter_batch(batch: Any, keep: list[int], rest: Callable[[list[int]], None]) -> None:
    """Filter a prompt or decode batch: its caches by :func:`filter_caches` where
    they are plain, the batch's other fields by mlx-lm's ``filter`` (``rest``)."""
    caches = batch.prompt_cache
    if not keep or not plain_batch(caches):
        rest(keep)
        return
    filter_caches(caches, keep)
    batch.prompt_cache = []  # mlx-lm's filter does the rest of the batch's fields
    try:
        rest(keep)
    finally:
        batch.prompt_cache = caches


def filter_caches(caches: list[Any], keep: list[int]) -> None:
    """Keep rows ``keep`` of every layer, as ``BatchKVCache.filter`` does, with one read.

    mlx-lm's ``filter`` reads each layer's left padding back after gathering it
    (``tolist`` of a new array): one wait per layer, and the first one waits for
    the decode step still running, so the next step cannot be built while it
    runs. Every layer's rows carry the same padding (every layer is joined,
    filtered and prefilled alike), so here it is read once, from the array the
    last step already used, and the gathers are queued without a wait.
    """
    import mlx.core as mx

    padding: list[int] = caches[0].left_padding.tolist()
    shift = min(padding[i] for i in keep)
    rows = mx.array(keep)
    for c in caches:
        keys, values = c.keys[rows], c.values[rows]
        if shift:
            keys, values = keys[..., shift:, :], values[..., shift:, :]
        c.keys, c.values = keys, values
        c.offset = c.offset[rows]
        c.left_padding = c.left_padding[rows] - shift
        c._idx -= shift


def extract_row(caches: list[Any], idx: int) -> list[Any]:
    """Row ``idx`` of every layer as plain ``KVCache``s, as ``BatchKVCache.extract``
    does, reading the left padding once instead of once per layer."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    start = int(caches[0].left_padding.tolist()[idx])
    out = []
    for c in caches:
        plain = KVCache()  # type: ignore[no-untyped-call]
        plain.keys = mx.contiguous(c.keys[idx : idx + 1, :, start : c._idx])
        plain.values = mx.contiguous(c.values[idx : idx + 1, :, start : c._idx])
        plain.offset = plain.keys.shape[2]
        out.append(plain)
    return out


def join_caches(ours: list[Any], theirs: list[Any]) -> bool:
    """Append ``theirs``' rows to ``ours``, layer by layer, as ``BatchKVCache.extend`` does.

    mlx-lm pads both caches to the longer one (a copy of every row) and then
    concatenates them (a second copy of every row). When a long prompt joins
    rows with short contexts, that is two copies of the whole batch at the long
    row's length, on the step every running row waits for. Here each layer's
    keys and values are one new zeroed array that each side's used positions
    are written into: the same arrays (the unused tail is zero instead of
    whatever the buffers held), one allocation and one copy of what is used.
    False, and nothing changed, unless every layer of both is a plain
    ``BatchKVCache`` with keys of one dtype.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    kind: Any = BatchKVCache  # mlx-lm's fields are untyped: no narrowing to its stubs
    pairs: list[tuple[Any, Any]] = list(zip(ours, theirs, strict=True))
    for a, b in pairs:
        if type(a) is not kind or type(b) is not kind or a.keys is None or b.keys is None:
            return False
        if a.keys.dtype != b.keys.dtype or a.values.dtype != b.values.dtype:
            return False

    for a, b in pairs:
        idx = max(a._idx, b._idx)
        size = max(a.keys.shape[2], b.keys.shape[2])
        a.keys = _right_justified(a.keys, a._idx, b.keys, b._idx, idx, size)
        a.values = _right_justified(a.values, a._idx, b.values, b._idx, idx, size)
        a.left_padding = mx.concatenate(
            [a.left_padding + (idx - a._idx), b.left_padding + (idx - b._idx)]
        )
        a.offset = mx.concatenate([a.offset, b.offset])
        a._idx = idx
    return True


def _right_justified(x: Any, x_used: int, y: Any, y_used: int, end: int, size: int) -> Any:
    """``x``'s rows over ``y``'s, each one's first ``*_used`` positions ending at ``end``."""
    import mlx.core as mx

    rows = x.shape[0]
    out = mx.zeros((rows + y.shape[0], x.shape[1], size, x.shape[3]), dtype=x.dtype)
    if x_used:
        out[:rows, :, end - x_used : end] = x[..., :x_used, :]
    if y_used:
        out[rows:, :, end - y_used : end] = y[..., :y_used, :]
    return out


_GENERATION_CLASS: Any = None


def generation_class() -> Any:
    """mlx-lm's ``GenerationBatch`` with the lane's two hooks: grammar masks, unstepped rows.

    *Grammar masks.* Before each decode step it hands the step's input tokens
    and every live constrained row's :class:`~trio_mlx._lanes.structured.GrammarProcessor`
    to the lane's :class:`~trio_mlx._lanes.structured.GrammarBatch` (``grammar``; None:
    off), which then computes all their masks at once when mlx-lm calls the
    first of them (one token read-back and one parallel fill per step instead
    of one per row). A batch without a constrained row steps exactly as
    mlx-lm's.

    *Unstepped rows.* Rows that finished their prefill join as *fresh*
    (``prompt_class``'s ``generate``): their next input is the prompt's last
    token, not a sampled one, so the decode step that includes them computes
    their first token along with everyone's next one, instead of mlx-lm's
    extra forward pass for the arrivals alone. What that step emits for a
    fresh row is its prompt's last token: the lane drops it (``fresh``). A
    fresh row's grammar processor runs alone on that step (it has not seen
    the prompt yet), as on mlx-lm's own first step. Arrivals into an empty
    batch take mlx-lm's first step at once (there is no pass to share).

    *Less host work per step* (every MLX op and every Python object per row
    is paid on the worker thread each step; see design/performance.md). The
    step (``_forward``) does the work of mlx-lm's ``GenerationBatch._step``,
    except that the log-probability vectors are split into one array per row
    only while a row in the batch asked for logprobs (``logprob_uids``), and
    a logit bias shared by every row is one add; otherwise every row's entry is the
    whole batch's array, which nobody reads. The grammar rows are looked for
    only while a constrained row is in the batch (``grammar_uids``). ``next``
    returns ``(uid, token, logprobs)`` tuples and skips mlx-lm's per-row
    ``max_tokens`` and stop-sequence checks: the lane gives it neither (it
    finishes rows itself), so no row ever finishes in here.
    """
    global _GENERATION_CLASS
    if _GENERATION_CLASS is not None:
        return _GENERATION_CLASS
    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch

    class _Generation(GenerationBatch):
        grammar: GrammarBatch | None = None
        #: Uids whose next emitted token is their prompt's last one (see above).
        fresh: set[int]
        #: The last step's seconds building its graph, queueing it (``mx.async_eval``:
        #: MLX's encoding, kernels compiled, buffers allocated) and waiting for the
        #: step before it (the device's work); for the slow-step log. None: the
        #: lane's step had no decode pass (the lane resets it before each step).
        phases: tuple[float, float, float] | None = None
        #: The seconds of mlx-lm's own first step of rows that arrived at an idle
        #: batch (see ``extend``; not split in phases). None: none this step.
        arrivals_step: float | None = None
        #: Uids of rows that asked for logprobs (a superset of those in the batch).
        logprob_uids: set[int]
        #: Uids of constrained rows (a superset of those in the batch).
        grammar_uids: set[int]

        #: Whether the one row's caches are mlx-lm's plain ``KVCache``s (it decodes alone).
        solo: bool = False
        #: Whether a row alone may go solo (the lane's ``solo_decode``; off for good
        #: once the model's caches turn out not to be plain ``BatchKVCache``s).
        solo_allowed: bool = True
        #: Speculative decoding (:mod:`trio_mlx._lanes.speculative`; None: off).
        speculator: Speculator | None = None
        #: When the last step ended (the speculation governor's clock; None: none yet).
        step_end: float | None = None
        #: Steps, this one first, whose time is not a decode rate (the lane sets it when
        #: a step carries prefill work: see ``Speculator.observe``).
        unsettled: int = 0
        #: After a speculative step: each row's accepted drafts, emitted after its token.
        extra: list[list[int]] | None = None

        def _enter_solo(self) -> None:
            b: Any = self
            caches = b.prompt_cache
            if not caches:
                return
            from mlx_lm.models.cache import BatchKVCache

            if any(type(c) is not BatchKVCache for c in caches):
                self.solo_allowed = False  # rotating, quantized, state-space...: the model's kinds
                return
            padding = int(caches[0].left_padding.item())
            b.prompt_cache = [plain_cache(c, padding) for c in caches]
            self.solo = True

        def _leave_solo(self) -> None:
            if self.solo:
                b: Any = self
                b.prompt_cache = [one_row_cache(c) for c in b.prompt_cache]
                self.solo = False

        def extract_cache(self, idx: int) -> list[Any]:
            self._leave_solo()
            b: Any = self
            if plain_batch(b.prompt_cache):
                return extract_row(b.prompt_cache, idx)
            return super().extract_cache(idx)

        def filter(self, keep: list[int]) -> None:
            self._leave_solo()
            _filter_batch(self, keep, super().filter)

        def extend(self, batch: Any) -> None:
            self._leave_solo()
            if getattr(batch, "unstepped", False):
                if self.uids:
                    self.fresh.update(batch.uids)
                else:
                    # Nothing decodes: no pass to share, so the arrivals' own first
                    # step now (mlx-lm's), and an idle engine's TTFT stays as it was.
                    began = time.perf_counter()
                    batch._step()
                    self.arrivals_step = time.perf_counter() - began
            b: Any = self
            if (
                b.prompt_cache
                and batch.prompt_cache
                and join_caches(b.prompt_cache, batch.prompt_cache)
            ):
                batch.prompt_cache = []  # joined: mlx-lm's extend keeps ours as it is
            super().extend(batch)  # type: ignore[no-untyped-call]

        def _step(self) -> Any:
            grammar = self.grammar
            rows: list[tuple[int, GrammarProcessor]] = []
            if grammar is not None and self.grammar_uids and self._next_tokens is not None:
                fresh = self.fresh
                for e, processors in enumerate(self.logits_processors or ()):
                    if fresh and self.uids[e] in fresh:
                        continue
                    for p in processors or ():
                        if (
                            isinstance(p, Guarded)
                            and p.row.error is None
                            and isinstance(p.processor, GrammarProcessor)
                        ):
                            rows.append((e, p.processor))
            if not rows:
                return self._forward()
            assert grammar is not None
            grammar.begin(self._next_tokens, rows)
            try:
                return self._forward()
            finally:
                grammar.end()

        def _forward(self) -> tuple[list[int], list[Any]]:
            # Pipelined: the forward pass for the tokens sampled last step is
            # queued before those tokens are read back, so the GPU works while
            # the host turns them into text. The returned tokens are that last
            # step's, which the KV cache now holds.
            b: Any = self  # mlx-lm's attributes are untyped
            if not self.solo and len(b.uids) == 1 and not self.fresh and self.solo_allowed:
                self._enter_solo()
            speculator = self.speculator
            if speculator is not None and not speculator.rows:
                # No row may speculate: no governor bookkeeping, and the next step
                # that has one measures from its own start, not this step's end.
                speculator, self.step_end = None, None
            tried = speculator is not None and speculator.wanted(b.uids)
            if tried:
                assert speculator is not None
                done = self._speculate(speculator)
                if done is not None:
                    self._observed(speculator, True, sum(map(len, self.extra or ())))
                    return done
                tried = False  # no row had a draft: a plain step, nothing was read
            queued, queued_lps = b._next_tokens, b._next_logprobs
            b._current_tokens, b._current_logprobs = queued, queued_lps
            built = time.perf_counter()
            logits, contexts = _processed(b, self._logits(queued), queued)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            b._next_tokens = _sampled(b, logprobs)
            queueing = time.perf_counter()
            if b.logprob_uids:
                b._next_logprobs = list(logprobs)
                mx.async_eval(b._next_tokens, b._next_logprobs, contexts)  # type: ignore[no-untyped-call]
            else:  # nobody reads a row's vector: every row shares the batch's
                b._next_logprobs = [logprobs] * len(b.uids)
                mx.async_eval(b._next_tokens, logprobs, contexts)  # type: ignore[no-untyped-call]
            waiting = time.perf_counter()
            mx.eval(queued, queued_lps)
            tokens: list[int] = queued.tolist()
            self.phases = (queueing - built, waiting - queueing, time.perf_counter() - waiting)
            for history, token in zip(b.tokens, tokens, strict=False):
                history.append(token)
            if speculator is not None:
                self._observed(speculator, tried, 0)
            return tokens, queued_lps

        def _observed(self, speculator: Speculator, tried: bool, drafts: int) -> None:
            """Tell the speculation governor this step's rows, tokens and duration."""
            now = time.perf_counter()
            last, self.step_end = self.step_end, now
            settled, self.unsettled = self.unsettled <= 0, max(0, self.unsettled - 1)
            if last is not None:
                rows = len(self.uids)
                speculator.observe(rows, tried, rows + drafts, now - last, settled)

        def _speculate(self, speculator: Speculator) -> tuple[list[int], list[Any]] | None:
            """A speculative step (see :mod:`trio_mlx._lanes.speculative`): drafts are
            made before the pending tokens are read, and the step reads back once (it is
            not pipelined: the next step's input is what this one accepts). None, and
            nothing run or read, when no row has a draft."""
            b: Any = self
            queued, queued_lps = b._next_tokens, b._next_logprobs
            fresh, want_lps = self.fresh, b.logprob_uids
            processors = b.logits_processors or [None] * len(b.uids)
            eligible = [
                not processors[e] and uid not in fresh and uid not in want_lps
                for e, uid in enumerate(b.uids)
            ]
            drafts = speculator.plan(b.uids, b.tokens, queued, eligible)
            width = 1 + max(len(d) for d in drafts)
            if width == 1:
                return None
            built = time.perf_counter()
            b._current_tokens, b._current_logprobs = queued, queued_lps
            batch = speculator.batch
            inputs = _verified(queued, drafts, width, None if batch is None else batch.block)
            # Here, in a method of the batch: RowModel reads the rows' uids off its caller.
            logits = b.model(inputs, cache=b.prompt_cache)
            first, contexts = _processed(b, logits[:, 0, :], queued)
            logprobs = first - mx.logsumexp(first, axis=-1, keepdims=True)
            sampled = _sampled(b, logprobs)
            targets = mx.argmax(logits, axis=-1)
            queueing = time.perf_counter()
            mx.eval(sampled, logprobs, contexts, targets, inputs, queued_lps)  # the one read back
            pending: list[int] = queued.tolist()
            drafts = [d if isinstance(d, list) else d.tolist() for d in drafts]
            rows = speculator.rows
            taken, nexts = accepted(
                logits,
                drafts,
                [rows[u].sampled if d else None for u, d in zip(b.uids, drafts, strict=True)],
                targets,
            )
            plain: list[int] = sampled.tolist()
            chosen = [p if n is None else n for p, n in zip(plain, nexts, strict=True)]
            roll_back(b.prompt_cache, width, taken)
            speculator.record(b.uids, drafts, taken)
            b._next_tokens = mx.array(chosen, dtype=sampled.dtype)
            b._next_logprobs = list(logprobs) if want_lps else [logprobs] * len(b.uids)
            mx.async_eval(b._next_tokens, [c.state for c in b.prompt_cache])  # type: ignore[no-untyped-call]
            self.extra = [d[:n] for d, n in zip(drafts, taken, strict=True)]
            for history, token, more in zip(b.tokens, pending, self.extra, strict=False):
                history.append(token)
                history.extend(more)
            self.phases = (queueing - built, 0.0, time.perf_counter() - queueing)
            return pending, queued_lps

        def _logits(self, queued: Any) -> Any:
            """The step's logits: traced where the lane has a traced step that takes
            it (``BatchLane.traced_decode``), else the model's own step."""
            b: Any = self
            lane = b.model._lane  # the RowModel's
            traced = lane._traced
            # Per-row adapters swap their layers in for the step: the traced graph
            # holds the base model's, so such a step runs eagerly.
            if traced is not None and not self.solo and lane._active_stack is None:
                logits = traced.logits(queued, b.prompt_cache)
                if logits is not None:
                    return logits
            return b.model(queued[:, None], cache=b.prompt_cache)[:, -1, :]

        def next(self) -> Any:
            if not self.uids:
                return []
            tokens, logprobs = self._step()
            extra, self.extra = self.extra, None
            if extra is None:
                return list(zip(self.uids, tokens, logprobs, strict=True))
            # A speculative step: each row's token, then its accepted drafts.
            out = []
            for uid, token, lps, more in zip(self.uids, tokens, logprobs, extra, strict=True):
                out.append((uid, token, lps))
                out.extend((uid, t, lps) for t in more)
            return out

    _GENERATION_CLASS = _Generation
    return _Generation


_PROMPT_CLASS: Any = None


def prompt_class() -> Any:
    """mlx-lm's ``PromptProcessingBatch`` as the lane prefills.

    * ``prompt``: the same chunked prefill (right-padded, one forward per
      chunk), but queued with ``mx.async_eval`` instead of waiting for it,
      and without mlx-lm's ``mx.clear_cache()`` after each chunk: the host
      builds the next decode step while the device prefills, and the
      allocator keeps its buffers (on CUDA, dropping them costs a device
      synchronisation now and fresh allocations in every later step; mlx-lm
      still clears every 512 decode steps).
    * ``generate``: rows whose prompt is prefilled join the decode batch
      *unstepped* (see :func:`generation_class`), without a forward pass of
      their own.
    * ``split`` of every row (a group whose prefill ended together): the
      batch is handed over as it is; mlx-lm deep-copies its caches and then
      filters both halves.

    ``split`` (mlx-lm's, for part of the rows) copies a batch through
    ``self.__class__``, so every batch split off the lane's prompt batch is
    one of these.
    """
    global _PROMPT_CLASS
    if _PROMPT_CLASS is not None:
        return _PROMPT_CLASS
    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

    class _Prompt(PromptProcessingBatch):
        #: Each pass's width rounded up to a multiple of this (the lane's
        #: ``prefill_width_multiple``; 1: the longest chunk, as mlx-lm pads),
        #: but not past ``width_limit`` (the lane's chunk) unless the chunk is.
        width_multiple: int = 1
        width_limit: int = 0

        def prompt(self, tokens: list[list[int]]) -> None:
            if len(tokens) != len(self.uids):
                raise ValueError("one token list per row of the prompt batch is needed")
            if not tokens:
                return
            for held, more in zip(self.tokens, tokens, strict=True):
                held += more  # what each row's cache holds once this runs
            lengths = [len(t) for t in tokens]
            width = rounded_width(max(lengths), self.width_multiple, self.width_limit)
            padding = [width - n for n in lengths]
            padded = any(padding)
            if padded:
                for layer in self.prompt_cache:
                    layer.prepare(lengths=lengths, right_padding=padding)
            inputs = mx.array([t + [0] * (width - len(t)) for t in tokens])
            for start in range(0, width, self.prefill_step_size):
                self.model(
                    inputs[:, start : start + self.prefill_step_size], cache=self.prompt_cache
                )
                mx.async_eval([layer.state for layer in self.prompt_cache])  # type: ignore[no-untyped-call]
            if padded:
                for layer in self.prompt_cache:
                    layer.finalize()
                mx.async_eval([layer.state for layer in self.prompt_cache])  # type: ignore[no-untyped-call]

        def filter(self, keep: list[int]) -> None:
            _filter_batch(self, keep, super().filter)

        def split(self, indices: list[int]) -> Any:
            b: Any = self
            whole = len(set(indices)) == len(self.uids)
            if not whole and not plain_batch(b.prompt_cache):
                return super().split(indices)
            moved = self.__class__.__new__(self.__class__)
            moved.__dict__.update(self.__dict__)
            if whole:
                # The whole batch moves on (a group prefilled together): hand it over
                # as it is instead of mlx-lm's deep copy of its caches and two filters.
                self.uids, self.prompt_cache, self.tokens = [], [], []
                self.samplers, self.logits_processors, self.max_tokens = [], [], []
                self.stop_sequences = []
                return moved
            # Part of the batch moves on (rows whose prompt is done): mlx-lm
            # deep-copies every cache and then filters both copies. The filters
            # give each side arrays of its own, so copying the cache objects
            # (not their arrays) is enough.
            moved.prompt_cache = [copy.copy(c) for c in b.prompt_cache]
            self.filter(sorted(set(range(len(self.uids))) - set(indices)))
            moved.filter(sorted(indices))
            return moved

        def generate(self, tokens: list[list[int]]) -> Any:
            if any(len(t) > 1 for t in tokens):
                self.prompt([t[:-1] for t in tokens])
            n = len(self.uids)
            batch: Any = GenerationBatch(
                model=self.model,
                uids=[],
                inputs=mx.array([t[-1] for t in tokens], dtype=mx.uint32),
                prompt_cache=self.prompt_cache,
                tokens=[],
                samplers=[],
                fallback_sampler=self.fallback_sampler,
                logits_processors=[],
                stop_sequences=[],
                max_tokens=[],
            )
            # Filled in after construction: a GenerationBatch built with rows
            # runs their first step at once, which is what this avoids.
            batch.uids = self.uids
            batch.tokens = self.tokens
            batch.samplers = self.samplers
            batch.logits_processors = self.logits_processors
            batch.stop_sequences = self.stop_sequences
            batch.max_tokens = self.max_tokens
            batch._next_logprobs = [_no_logprobs()] * n
            batch._token_context = [_token_buffer(t) for t in self.tokens]
            batch._num_tokens = [0] * n
            batch._matchers = [s.matcher() for s in self.stop_sequences]
            batch.unstepped = True
            self.uids, self.prompt_cache, self.tokens = [], [], []
            self.samplers, self.logits_processors, self.max_tokens = [], [], []
            self.stop_sequences = []
            return batch

    _PROMPT_CLASS = _Prompt
    return _Prompt


def rounded_width(width: int, multiple: int, limit: int) -> int:
    """``width`` rounded up to a multiple of ``multiple``, unless that is past ``limit``."""
    rounded = -(-width // multiple) * multiple
    return rounded if rounded <= max(width, limit) else width


def _no_logprobs() -> Any:
    """The placeholder logprobs of a fresh row's dropped first emission."""
    import mlx.core as mx

    return mx.zeros((1,))


def _token_buffer(tokens: list[int]) -> Any:
    from mlx_lm.models.cache import TokenBuffer

    return TokenBuffer(tokens)  # type: ignore[no-untyped-call]
