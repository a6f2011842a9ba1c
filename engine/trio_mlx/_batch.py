"""The batch lane: continuous batching on mlx-lm's ``BatchGenerator`` (MLX thread only).

Every row carries its own sampler (``make_sampler``) and logits processors
(``make_logits_processors``: penalties and logit_bias), so the whole
:class:`~trio_mlx.SamplingParams` surface batches. One :meth:`BatchLane.step`
call is one worker call: it removes cancelled rows, inserts admitted and
resumed ones, runs one ``BatchGenerator.next()`` (or a short burst of them,
see :meth:`BatchLane.step`) and returns every row's
:class:`~trio_mlx._output.RowEvent` at once. Admitted rows reach mlx-lm's
prompt batch within ``prefill_budget`` tokens per step (``_feed``); its prefill
is queued, not waited for, and rows that finish it join the decode batch
without a forward pass of their own (``_prompt_class``, ``_generation_class``).

Rows are finished by the lane, not by mlx-lm (``RowOutput`` applies
``max_tokens``, EOS and stop strings; mlx-lm gets no stop tokens and an
unreachable ``max_tokens``), so a finished or cancelled row stops producing
output at once while its KV slot is freed later, in bulk: *deferred removal*.
A dead row stays in the batch (decoding tokens nobody reads) until one
``BatchGenerator.remove`` takes every dead row out at once: when the step
call admits or resumes rows (the batch's KV is rebuilt then anyway), when
dead rows reach ``removal_fraction`` of the live ones, when the oldest has
been dead ``removal_delay`` decode steps (the bound on how long a cancelled
row holds its slot), or when no live row is left. Every trigger is computed
from the commands and the tokens, never from a clock, so every rank of
distributed mode removes the same rows at the same step.

Parking (preemption) takes a row's KV cache out with
``remove(..., return_prompt_caches=True)``. Decode is pipelined, so that
cache already holds the last emitted token: it is trimmed by one and the row
is re-inserted as ``[[last_token]]`` with ``all_tokens = tokens[:-1]``, which
continues token for token like an uninterrupted run. (A row back in the batch
but not stepped yet holds no last token: nothing is trimmed then.)

Every mlx-lm call of the engine's batching lives in this module: its
``BatchGenerator`` API moves between minor releases, and the lane's subclasses
read and set private fields of its prompt and decode batches (pinned to
mlx-lm <0.33, as the prompt cache's trie is).
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import attrs

from trio_mlx._errors import NotFound
from trio_mlx._multilora import AdapterStack
from trio_mlx._output import RowEvent, RowOutput, merge_events
from trio_mlx._params import SamplingParams
from trio_mlx._prompt_cache import PromptCache
from trio_mlx._structured import GrammarBatch, GrammarProcessor

__all__ = [
    "BatchLane",
    "RowSpec",
    "StepPlan",
    "StepResult",
    "eos_processors",
    "make_processors",
    "make_row_sampler",
    "row_processors",
]

logger = logging.getLogger("trio_mlx")


@attrs.frozen
class RowSpec:
    """A row to insert: the request id, its prompt tokens and its parameters."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    #: The compiled :class:`~trio_mlx._structured.Constraint` of a constrained request.
    constraint: Any = attrs.field(default=None, eq=False, repr=False)


def _specs(specs: Iterable[RowSpec]) -> tuple[RowSpec, ...]:
    return tuple(specs)  # typed converters: mypy cannot infer attrs' converter=tuple


def _ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(ids)


@attrs.frozen
class StepPlan:
    """One :meth:`BatchLane.step`: the rows it removes, inserts and resumes, and its burst length.

    The actor's :class:`~trio_mlx._planner.StepPlanner` makes one per step; in
    distributed mode rank 0 sends the same plan to every follower
    (:mod:`trio_mlx._distributed`), so every rank makes the same call.
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
    #: the prefill chunk from (:attr:`~trio_mlx._planner.StepPlanner.prefill_stall`).
    timings: tuple[tuple[int, float], ...] = ()


#: The smallest top_p handed to mlx-lm (a normal float32, far below any token's mass).
_TOP_P_FLOOR = 1e-30


def make_row_sampler(params: SamplingParams, tokenizer: Any) -> Callable[[Any], Any] | None:
    """mlx-lm's sampler for ``params``, or None for greedy (the batch's shared fallback)."""
    if params.temperature == 0:
        return None
    from mlx_lm.sample_utils import make_sampler

    special = list(tokenizer.encode("\n", add_special_tokens=False)) + sorted(
        tokenizer.eos_token_ids
    )
    # mlx-lm compares the mass above each token with top_p in float32: a top_p that
    # underflows to 0 there drops every token and indexes past the vocabulary. Any
    # p below the top token's mass keeps that token alone, so the floor changes nothing.
    top_p = max(params.top_p, _TOP_P_FLOOR) if params.top_p < 1.0 else 0.0
    return make_sampler(
        params.temperature,
        top_p=top_p,
        min_p=params.min_p,
        top_k=params.top_k,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=special,
    )


def _min_tokens_processor(minimum: int, eos_ids: Sequence[int]) -> Callable[[Any, Any], Any]:
    """Bans the end-of-sequence tokens until ``minimum`` tokens were generated.

    The count is the growth of ``tokens`` since the first call (the tokens a
    processor sees start with however much of the prompt the lane fed), so a
    row parked and re-inserted with its history keeps counting where it was.
    """
    import mlx.core as mx

    banned = mx.array(sorted(eos_ids), dtype=mx.int32)
    base: list[int] = []

    def processor(tokens: Any, logits: Any) -> Any:
        if not base:
            base.append(len(tokens))
        if len(tokens) - base[0] >= minimum:
            return logits
        logits[..., banned] = -float("inf")
        return logits

    return processor


def eos_processors(
    params: SamplingParams, eos_ids: Sequence[int]
) -> list[Callable[[Any, Any], Any]]:
    """The processor that holds ``eos_ids`` back for ``min_tokens`` (empty when none applies)."""
    if params.min_tokens > 0 and eos_ids and not params.ignore_eos:
        return [_min_tokens_processor(params.min_tokens, eos_ids)]
    return []


class _LogitBias:
    """mlx-lm's logit bias processor, as an object the lane can recognise.

    Adds the same values as ``make_logits_processors``' closure; ``key``
    tells two rows with the same bias apart from others, so a decode step
    whose rows all carry the same bias and nothing else adds it to the whole
    batch at once (``_generation_class``).
    """

    __slots__ = ("indices", "key", "values")

    def __init__(self, bias: dict[int, float]) -> None:
        import mlx.core as mx

        self.key = tuple(bias.items())
        self.indices = mx.array(list(bias.keys()))
        self.values = mx.array(list(bias.values()))

    def __call__(self, tokens: Any, logits: Any) -> Any:
        return logits.at[:, self.indices].add(self.values)


def make_processors(params: SamplingParams) -> list[Callable[[Any, Any], Any]]:
    """mlx-lm's logits processors for ``params`` (empty when none apply)."""
    from mlx_lm.sample_utils import make_logits_processors

    size = params.repetition_context_size
    bias = [_LogitBias(dict(params.logit_bias))] if params.logit_bias else []
    return bias + list(
        make_logits_processors(
            None,
            params.repetition_penalty,
            size,
            params.presence_penalty or None,
            size,
            params.frequency_penalty or None,
            size,
        )
    )


def row_processors(spec: RowSpec, eos_ids: Sequence[int]) -> list[Callable[[Any, Any], Any]]:
    """Every logits processor of a row: ``eos_processors``, ``make_processors`` and,
    last, its grammar mask.

    The grammar (structured output) comes last so no bias or penalty can bring
    back a token it forbids.
    """
    grammar = [spec.constraint.processor()] if spec.constraint is not None else []
    return [*eos_processors(spec.params, eos_ids), *make_processors(spec.params), *grammar]


@attrs.define(eq=False)
class _Row:
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
_UNBOUNDED = 1 << 40


@attrs.define(eq=False)
class _Dead:
    """A finished or cancelled row whose KV slot is still in the batch."""

    row_id: int
    #: Keep its KV cache for the prompt cache when it is removed.
    store: bool
    #: Its prompt cache key (the adapter it ran under is part of it).
    key: Hashable = "base"
    #: Decode steps since it died (tokens its cache holds past its last real one).
    age: int = 0


class _RowModel:
    """The model as the lane's ``BatchGenerator`` sees it: each forward call first
    sets the adapter slot of each of its rows (see :mod:`trio_mlx._multilora`).

    mlx-lm makes every forward call from a method of the batch object whose
    ``uids`` list is that call's row order (``PromptProcessingBatch.prompt``
    for prefill, ``GenerationBatch._step`` for decode); that list is read from
    the caller, so each call gets its own rows' adapters whatever mlx-lm's
    ordering. A caller without ``uids`` of the call's batch size fails the call
    (loudly) rather than guess.
    """

    def __init__(self, model: Any, lane: BatchLane) -> None:
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


class _Guarded:
    """A processor that records its row's failure instead of failing the whole batch.

    A failed row is also appended to ``failed`` (the lane's), so the lane looks
    for failed rows only after a step in which one failed.
    """

    __slots__ = ("failed", "processor", "row")

    def __init__(self, row: _Row, processor: Callable[[Any, Any], Any], failed: list[_Row]) -> None:
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


def _shared_bias(processors: list[list[Any]] | None) -> _LogitBias | None:
    """The logit bias, when it is the one processor of every row in the batch (else None)."""
    shared: _LogitBias | None = None
    for row in processors or ():
        if not row or len(row) != 1:
            return None
        guarded = row[0]
        if (
            type(guarded) is not _Guarded
            or guarded.row.error is not None
            or type(guarded.processor) is not _LogitBias
        ):
            return None
        if shared is None:
            shared = guarded.processor
        elif guarded.processor.key != shared.key:
            return None
    return shared


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


def _plain_cache(cache: Any, padding: int) -> Any:
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


def _one_row_cache(plain: Any) -> Any:
    """A plain ``KVCache`` back as a one-row ``BatchKVCache`` over the same buffers."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache([0])
    if plain.keys is not None:
        cache.keys, cache.values, cache._idx = plain.keys, plain.values, plain.offset
        cache.offset = mx.array([plain.offset])
    return cache


def _buffer_length(generator: Any) -> int | None:
    """Positions in the decoding batch's first layer's buffer (None: no batch, or not
    one of mlx-lm's ``BatchKVCache``s); for the slow-step log."""
    batch = getattr(generator, "_generation_batch", None)
    caches = getattr(batch, "prompt_cache", None)
    keys = getattr(caches[0], "keys", None) if caches else None
    return None if keys is None else int(keys.shape[2])


#: Seconds Python's garbage collector has run in this process since the import
#: (index 0), and when the running collection started (index 1); for the slow-step log.
_gc_seconds: list[float] = [0.0, 0.0]


def _gc_timer(phase: str, _info: dict[str, int]) -> None:
    if phase == "start":
        _gc_seconds[1] = time.perf_counter()
    else:
        _gc_seconds[0] += time.perf_counter() - _gc_seconds[1]


gc.callbacks.append(_gc_timer)


def _kernels_compiled(since: float) -> str:
    """The kernel modules MLX's CUDA backend compiled since ``since`` (a ``time.time()``),
    for the slow-step log.

    MLX compiles a module with NVRTC the first time a process meets it (a fused
    graph, a gather of a new dtype; a second or more each on the H200) and writes
    it to its PTX cache directory, ``MLX_PTX_CACHE_DIR`` or
    ``<temp>/mlx/<version>/ptx`` (a long module name as nested folders); modules
    written during a slow step are the ones it compiled then. Not listed: a module
    read back from that directory, a custom kernel's (``mx.fast.cuda_kernel``, such
    as the fused decode attention: MLX 0.32 compiles those in every process and
    never writes them), anything where the directory is absent (the CPU).
    """
    import os
    import tempfile
    from pathlib import Path

    chosen = os.environ.get("MLX_PTX_CACHE_DIR")
    roots = [Path(chosen)] if chosen else sorted(Path(tempfile.gettempdir()).glob("mlx/*/ptx"))
    names: list[str] = []
    for root in roots:
        try:
            names += sorted(
                "".join(p.relative_to(root).with_suffix("").parts)
                for p in root.rglob("*.ptx")
                if p.stat().st_mtime >= since
            )
        except OSError:  # gone meanwhile: nothing to say about it
            continue
    if not names:
        return "no kernel compiled"
    shown = ", ".join(name[:60] for name in names[:4])
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return f"{len(names)} kernel modules compiled: {shown}{more}"


def _memory_now() -> tuple[int, int]:
    """MLX's active and cached memory in bytes (read before each decode step)."""
    import mlx.core as mx

    return mx.get_active_memory(), mx.get_cache_memory()


def _memory(before: tuple[int, int] | None = None) -> str:
    """MLX's memory figures, for the slow-step log, from ``before`` (if given) to now:
    a stall that is the allocator's (a large new buffer, a cache cleared) shows as a
    jump in them."""
    import mlx.core as mx

    mib = 1 << 20
    active, cached = _memory_now()
    was = "" if before is None else f"{before[0] // mib} -> "
    was_cached = "" if before is None else f"{before[1] // mib} -> "
    return (
        f"memory active {was}{active // mib} MiB, cached {was_cached}{cached // mib} MiB, "
        f"peak {mx.get_peak_memory() // mib} MiB"
    )


def _plain_batch(caches: list[Any]) -> bool:
    """Whether every layer is a plain ``BatchKVCache`` holding keys, between passes
    (no right padding pending): the caches :func:`_filter_caches` takes."""
    from mlx_lm.models.cache import BatchKVCache

    kind: Any = BatchKVCache  # mlx-lm's fields are untyped: no narrowing to its stubs
    return bool(caches) and all(
        type(c) is kind and c.keys is not None and c._right_padding is None for c in caches
    )


def _filter_batch(batch: Any, keep: list[int], rest: Callable[[list[int]], None]) -> None:
    """Filter a prompt or decode batch: its caches by :func:`_filter_caches` where
    they are plain, the batch's other fields by mlx-lm's ``filter`` (``rest``)."""
    caches = batch.prompt_cache
    if not keep or not _plain_batch(caches):
        rest(keep)
        return
    _filter_caches(caches, keep)
    batch.prompt_cache = []  # mlx-lm's filter does the rest of the batch's fields
    try:
        rest(keep)
    finally:
        batch.prompt_cache = caches


def _filter_caches(caches: list[Any], keep: list[int]) -> None:
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


def _extract_row(caches: list[Any], idx: int) -> list[Any]:
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


def _join_caches(ours: list[Any], theirs: list[Any]) -> bool:
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


def _generation_class() -> Any:
    """mlx-lm's ``GenerationBatch`` with the lane's two hooks: grammar masks, unstepped rows.

    *Grammar masks.* Before each decode step it hands the step's input tokens
    and every live constrained row's :class:`~trio_mlx._structured.GrammarProcessor`
    to the lane's :class:`~trio_mlx._structured.GrammarBatch` (``grammar``; None:
    off), which then computes all their masks at once when mlx-lm calls the
    first of them (one token read-back and one parallel fill per step instead
    of one per row). A batch without a constrained row steps exactly as
    mlx-lm's.

    *Unstepped rows.* Rows that finished their prefill join as *fresh*
    (``_prompt_class``'s ``generate``): their next input is the prompt's last
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
            b.prompt_cache = [_plain_cache(c, padding) for c in caches]
            self.solo = True

        def _leave_solo(self) -> None:
            if self.solo:
                b: Any = self
                b.prompt_cache = [_one_row_cache(c) for c in b.prompt_cache]
                self.solo = False

        def extract_cache(self, idx: int) -> list[Any]:
            self._leave_solo()
            b: Any = self
            if _plain_batch(b.prompt_cache):
                return _extract_row(b.prompt_cache, idx)
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
                and _join_caches(b.prompt_cache, batch.prompt_cache)
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
                            isinstance(p, _Guarded)
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
            return tokens, queued_lps

        def _logits(self, queued: Any) -> Any:
            """The step's logits: traced where the lane has a traced step that takes
            it (``BatchLane.traced_decode``), else the model's own step."""
            b: Any = self
            lane = b.model._lane  # the _RowModel's
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
            return list(zip(self.uids, tokens, logprobs, strict=True))

    _GENERATION_CLASS = _Generation
    return _Generation


_PROMPT_CLASS: Any = None


def _prompt_class() -> Any:
    """mlx-lm's ``PromptProcessingBatch`` as the lane prefills.

    * ``prompt``: the same chunked prefill (right-padded, one forward per
      chunk), but queued with ``mx.async_eval`` instead of waiting for it,
      and without mlx-lm's ``mx.clear_cache()`` after each chunk: the host
      builds the next decode step while the device prefills, and the
      allocator keeps its buffers (on CUDA, dropping them costs a device
      synchronisation now and fresh allocations in every later step; mlx-lm
      still clears every 512 decode steps).
    * ``generate``: rows whose prompt is prefilled join the decode batch
      *unstepped* (see :func:`_generation_class`), without a forward pass of
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
            width = _rounded_width(max(lengths), self.width_multiple, self.width_limit)
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
            if not whole and not _plain_batch(b.prompt_cache):
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


def _rounded_width(width: int, multiple: int, limit: int) -> int:
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
    #: Most prompt tokens prefilled per decode step, counted as mlx-lm pads
    #: them (rows x the longest chunk); also the chunk a long prompt is cut
    #: into. None: no bound beyond mlx-lm's (``prefill_step_size`` per prompt,
    #: ``prefill_batch_size`` prompts). See ``_feed``.
    prefill_budget: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    #: The chunk a long prompt is cut into, when smaller than the budget: a
    #: prompt with more than this many tokens to prefill is prefilled alone,
    #: this many tokens a step, and while it waits or prefills every pass
    #: holds at most this many tokens; with no such prompt about, prompts
    #: share passes of up to the budget. So the streams' steps stay short
    #: while a long prompt arrives, and chat-sized arrivals group as before
    #: otherwise (the closed loop's throughput). Not while the server is
    #: behind: when the other prompts waiting or prefilling beside the
    #: longest hold more than the budget, passes take up to the budget again
    #: (near capacity, prompts prefilled one at a time queue behind each
    #: other). None: the budget's (``_feed``).
    long_prompt_chunk: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    #: Experimental, off (1): every prefill pass right-padded to a multiple of
    #: this width, so that passes repeat a few shapes instead of meeting new ones
    #: (on the H200 most of a long prompt's stall was the first time MLX met a
    #: shape: design/performance.md, seventh round). Costs the padded tokens'
    #: compute; at 256 it did not lower the long prompt's worst step on the
    #: H200 (eighth round), so no default sets it.
    prefill_width_multiple: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: Most decode steps a dead row keeps its KV slot (see the module's notes).
    removal_delay: int = 16
    #: Remove dead rows once there are at least live / removal_fraction of them (0: never by count).
    removal_fraction: int = 8
    #: Compute every constrained row's grammar mask of a decode step together
    #: (:class:`~trio_mlx._structured.GrammarBatch`); False: each row's processor alone.
    grammar_batch: bool = True
    #: Decode a row alone in the batch over plain ``KVCache``s (see ``_Generation``);
    #: False: as a one-row batch (``TRIO_MLX_SOLO_DECODE=0``, for side-by-side runs).
    solo_decode: bool = True
    #: Decode steps traced once per batch shape (:mod:`trio_mlx._traced_decode`),
    #: once a traced step has matched the model's own; the loader turns it on on
    #: CUDA (``TRIO_MLX_TRACED_DECODE``: 0 off, 1 on anywhere). False: the model's
    #: own step every time.
    traced_decode: bool = False
    #: The mounted plain LoRA adapters, stacked (set by the engine; None: no adapters).
    adapter_stack: Callable[[], AdapterStack] | None = None
    #: A decode step that takes this many seconds or more is logged, with what it
    #: carried (see ``_slow_step``); at most one line per ``slow_step_quiet`` seconds.
    slow_step_seconds: float = 0.5
    slow_step_quiet: float = 10.0
    #: Seconds spent inside ``BatchGenerator.next()`` (the rest of a step is this lane's own work).
    generator_seconds: float = attrs.field(init=False, default=0.0)
    #: Decode steps run (``BatchGenerator.next()`` calls), for the slow-step log.
    decode_steps: int = attrs.field(init=False, default=0)
    #: Slow steps, and slow admissions, not logged since their last line (the quiet
    #: period), and when that was: index 0 for steps, 1 for admissions.
    _slow_unlogged: list[int] = attrs.field(init=False, factory=lambda: [0, 0])
    _slow_logged_at: list[float] = attrs.field(init=False, factory=lambda: [-math.inf] * 2)
    #: Rows inserted into the batch per adapter name (base rows are not counted here).
    adapter_rows: Counter[str] = attrs.field(init=False, factory=Counter)
    #: The stack whose layers are on the model during the current ``next()`` (else None).
    _active_stack: AdapterStack | None = attrs.field(init=False, default=None)
    _generator: Any = attrs.field(init=False, default=None)
    _rows: dict[int, _Row] = attrs.field(init=False, factory=dict)
    _by_uid: dict[int, int] = attrs.field(init=False, factory=dict)
    #: Dead rows by generator uid (see deferred removal in the module's notes).
    _dead: dict[int, _Dead] = attrs.field(init=False, factory=dict)
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
    #: Rows whose processor failed since the last decode step looked (see ``_Guarded``).
    _failed: list[_Row] = attrs.field(init=False, factory=list)
    #: The current step call's prefill chunk (its plan's ``prefill_chunk``; None: the budget).
    _chunk: int | None = attrs.field(init=False, default=None)
    #: The current step call's (prompt tokens, seconds) per decode step.
    _timings: list[tuple[int, float]] = attrs.field(init=False, factory=list)
    #: The traced step once built (see ``traced_decode``).
    _traced: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids)
        self._generator = self._new_generator()

    def _new_generator(self) -> Any:
        from mlx_lm.generate import BatchGenerator

        # Every forward call goes through _RowModel, which sets per-row adapter slots.
        model = _RowModel(self.model, self)
        generator = BatchGenerator(
            model,
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(self.max_batch, self.prefill_batch_size),
            prefill_step_size=self.prefill_step_size,
        )
        # The decode batch every row joins and the prompt batch every arrival is
        # prefilled in (mlx-lm extends these two objects): the lane's subclasses.
        generation = _generation_class().empty(model, generator.sampler)
        generation.grammar = self.grammar if self.grammar_batch else None
        generation.fresh = set()
        generation.logprob_uids = set()
        generation.grammar_uids = set()
        generation.solo_allowed = self.solo_decode
        generator._generation_batch = generation
        generator._prompt_batch = _prompt_class().empty(
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
        """Uids in the decode batch whose rows read their logprobs (see _generation_class)."""
        uids: set[int] = self._generator._generation_batch.logprob_uids
        return uids

    @property
    def _grammar_uids(self) -> set[int]:
        """Uids in the batch (dead or alive) with a grammar processor (see _generation_class)."""
        uids: set[int] = self._generator._generation_batch.grammar_uids
        return uids

    def _joined(self, row: _Row, uid: int) -> None:
        """Bookkeeping of a row that got the generator's ``uid``."""
        row.uid = uid
        self._by_uid[uid] = row.spec.id
        if row.spec.params.logprobs:
            self._logprob_uids.add(uid)
        if row.spec.constraint is not None:
            self._grammar_uids.add(uid)

    def _parted(self, uid: int) -> None:
        """Bookkeeping of a row that stops decoding under ``uid`` (the reverse of ``_joined``)."""
        self._by_uid.pop(uid, None)
        self._logprob_uids.discard(uid)

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

    def _key(self, row: _Row) -> Hashable:
        """The row's prompt cache key: a prefix computed under one adapter serves only it."""
        if row.adapter is None:
            return self.cache_key
        stack = self._stack()
        mount = stack.mounts.get(row.adapter) if stack is not None else None
        return (self.cache_key, "adapter", row.adapter, mount)

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
        """The traced decode step in use (a :class:`~trio_mlx._traced_decode.TracedDecode`), or None."""
        return self._traced

    def after_job(self) -> None:
        """After an exclusive job: a traced step over weights the job replaced is dropped
        (built and checked again at the next decode step)."""
        from trio_mlx import _traced_decode

        if self._traced is not None and self._traced.weights != _traced_decode.weights(self.model):
            self._traced = None

    def _trace(self) -> None:
        """Build and check the traced decode step; off for good if it does not match."""
        from trio_mlx import _traced_decode

        traced = _traced_decode.build(self.model)
        if traced is None:
            self.traced_decode = False
            return
        self._traced = traced

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
            self._slow_admission(elapsed, compacted, len(inserts), len(resumes))
        decoded = 0
        if self._by_uid or self._waiting:
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
                or not (self._by_uid or self._waiting)
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

    def _slow_step(
        self, elapsed: float, prefill: int, how: str, gc: float, memory: tuple[int, int]
    ) -> None:
        """Log a slow decode step with what it carried, so that a stall can be told
        apart: a long prefill, a first trace, Python's garbage collector, kernels
        compiled, MLX's allocator, or none of these."""
        unlogged = self._slow_due(0)
        if unlogged is None:
            return
        generation = self._generator._generation_batch
        phases, arrivals = generation.phases, generation.arrivals_step
        if phases is not None:
            passes = (
                "the decode pass built in {:.0f} ms, queued in {:.0f} ms, the pass before it "
                "waited for {:.0f} ms".format(*(seconds * 1000 for seconds in phases))
            )
        elif arrivals is not None:
            passes = f"the arrivals' first step (mlx-lm's own) took {arrivals * 1000:.0f} ms"
        else:
            passes = "no decode pass"
        logger.info(
            "slow decode step: %.0f ms; step %d, %.0f ms of it in Python's garbage collector; "
            "%s; %d rows in the batch, a prefill pass of %d positions, "
            "%d rows prefilling, buffer %s positions, %s; %s; %s; "
            "%d slow steps not logged before it",
            elapsed * 1000,
            self.decode_steps,
            gc * 1000,
            passes,
            len(self._by_uid),
            prefill,
            len(self._prefilling),
            _buffer_length(self._generator),
            how,
            _kernels_compiled(time.time() - elapsed - 0.01),
            _memory(memory),
            unlogged,
        )

    def _slow_due(self, kind: int) -> int | None:
        """None inside ``kind``'s quiet period (counted); else the count not logged before."""
        now = time.perf_counter()
        if now - self._slow_logged_at[kind] < self.slow_step_quiet:
            self._slow_unlogged[kind] += 1
            return None
        unlogged, self._slow_unlogged[kind] = self._slow_unlogged[kind], 0
        self._slow_logged_at[kind] = now
        return unlogged

    def _slow_admission(self, elapsed: float, compacted: int, inserts: int, resumes: int) -> None:
        """Log a slow removal and admission (the work before a step's decoding); its
        quiet period is its own."""
        unlogged = self._slow_due(1)
        if unlogged is None:
            return
        logger.info(
            "slow admission: %.0f ms; %d dead rows compacted, %d rows inserted, %d resumed, "
            "%d rows in the batch; %s; %d slow steps not logged before it",
            elapsed * 1000,
            compacted,
            inserts,
            resumes,
            len(self._by_uid),
            _memory(),
            unlogged,
        )

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
                # Tokens decoded after the row died are no one's: trim them off.
                age = dead[uid].age
                if age:
                    trim_prompt_cache(cache, age)
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
        for row_id in ids:
            row = self._rows.pop(row_id, None)
            if row is not None and row.uid is not None:
                self._parted(row.uid)
                self._dead[row.uid] = _Dead(
                    row_id, store and self.prompt_cache is not None, self._key(row)
                )

    def close(self) -> None:
        """Drop every row and release the generator (on the MLX thread, at shutdown)."""
        if self._traced is not None:
            logger.info("traced decode: %s", self._traced.summary())
        self._rows.clear()
        self._by_uid.clear()
        self._dead.clear()
        self._waiting.clear()
        self._prefilling.clear()
        self._long_prefills.clear()
        self._failed.clear()
        self._generator.close()
        self._generator = self._new_generator()
        if self.prompt_cache is not None:
            self.prompt_cache.clear()

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
        row = _Row(
            spec,
            RowOutput(spec.id, spec.params, self._eos_ids, self.tokenizer.detokenizer),
            make_row_sampler(spec.params, self.tokenizer),
            [],
        )
        row.processors = [
            _Guarded(row, p, self._failed) for p in row_processors(spec, sorted(self._eos_ids))
        ]
        self._rows[spec.id] = row
        return self._start(row)

    def _start(self, row: _Row) -> int:
        """Queue a new (or restarted) row for prefill; returns the tokens the prompt cache serves."""
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
        that stays within the budget (one always may when none is
        prefilling), so a long prompt is cut into chunks interleaved with
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
        bound = budget
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
        feed: list[_Row] = []
        while self._waiting:
            row = self._rows.get(self._waiting[0])
            if row is None or row.waiting is None:
                self._waiting.popleft()  # cancelled, failed or parked while it waited
                continue
            n = len(row.waiting[2]) - 1  # mlx-lm prefills all but the last token
            if bound is not None and (left or feed):
                more = [*left, n] if n > 0 else left
                if room <= 0 or (more and len(more) * self._pass_width(more, chunk) > bound):
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
        passes of up to the budget serve the queue sooner (H200 open loop,
        seventeenth round: design/performance.md)."""
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
        return _rounded_width(min(chunk, max(left)), self.prefill_width_multiple, chunk)

    def _insert_waiting(self, row: _Row) -> None:
        assert row.waiting is not None
        prompt, cache, rest = row.waiting
        row.waiting = None
        done = len(prompt) - len(rest)
        (uid,) = self._generator.insert(
            [rest],
            max_tokens=[_UNBOUNDED],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:done]],
            samplers=[row.sampler],
            logits_processors=[row.processors],
        )
        self._joined(row, uid)
        self._prefilling[uid] = len(rest) - 1
        if self.long_prompt_chunk is not None and len(rest) - 1 > self.long_prompt_chunk:
            self._long_prefills.add(uid)

    def _resume(self, row_id: int) -> None:
        row = self._rows[row_id]
        if row.parked is None or row.last_token is None:
            self._start(row)
            return
        cache, tokens = row.parked
        row.parked = None
        (uid,) = self._generator.insert(
            [[row.last_token]],
            max_tokens=[_UNBOUNDED],
            caches=[cache],
            all_tokens=[tokens[:-1]],
            samplers=[row.sampler],
            logits_processors=[row.processors],
        )
        self._joined(row, uid)

    def _drop(self, row_id: int) -> None:
        row = self._rows.pop(row_id, None)
        if row is not None and row.uid is not None:
            self._parted(row.uid)

    def _decode(self, order: dict[int, list[RowEvent]], outputs: dict[int, RowOutput]) -> bool:
        """One decode step; adds its events to a burst's (see ``_burst``); whether any is news.

        Tokens go to the rows' outputs (``RowOutput.add``), errors to ``order``.
        """
        news = False
        for event in self._feed():
            order.setdefault(event.id, []).append(event)
            news = True
        prefill = self._pass_tokens() if self._prefilling else 0  # steady decoding: none
        if self.traced_decode and self._traced is None:
            self._trace()
        traced = self._traced
        before = (traced.traces, traced.traced_steps) if traced is not None else (0, 0)
        collected = _gc_seconds[0]
        generation = self._generator._generation_batch
        generation.phases = generation.arrivals_step = None  # set again by a decode pass
        memory = _memory_now()
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
            self._dead.clear()
            self._prefilling.clear()
            self._long_prefills.clear()
            self._failed.clear()
            self._generator = self._new_generator()
            return True
        elapsed = time.perf_counter() - start
        self.decode_steps += 1
        self.generator_seconds += elapsed
        self._timings.append((prefill, elapsed))
        if elapsed >= self.slow_step_seconds:
            how = "eager"  # the model's own step, or no decode pass
            if traced is not None and traced.traced_steps > before[1]:
                how = f"traced, {traced.traces - before[0]} new shapes"
            self._slow_step(elapsed, prefill, how, _gc_seconds[0] - collected, memory)
        prefilling = self._prefilling
        for progress in _prompt_responses:
            if progress.end_of_prompt:
                prefilling.pop(progress.uid, None)
            elif progress.uid in prefilling:
                done, total = progress.progress
                prefilling[progress.uid] = max(0, total - done - 1)
        finished: list[int] = []
        failed: list[int] = []
        fresh = self._fresh
        by_uid, rows = self._by_uid, self._rows
        for uid, token, logprobs in responses:
            if fresh and uid in fresh:
                fresh.discard(uid)  # its prompt's last token (see _generation_class)
                continue
            row_id = by_uid.get(uid)
            if row_id is None:
                continue  # a dead row
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
