"""Structured output: decoding constrained to a JSON schema, a regex or a Lark grammar.

`llguidance <https://github.com/guidance-ai/llguidance>`_ compiles the
constraint into a matcher over the model's vocabulary (see
``design/structured-output.md`` for why this library). Each constrained row
gets its own matcher, wrapped in a :class:`GrammarProcessor`: an mlx-lm logits
processor, so rows with different constraints and rows with none share one
batch. The processor runs where mlx-lm calls processors, on the MLX thread:
it feeds the row's newly sampled tokens to the matcher, asks for the bitmask
of allowed next tokens (a few microseconds to a few hundred in llguidance's
Rust code), unpacks it and applies it with one ``mx.where``. In the batch
lane a :class:`GrammarBatch` does that for every constrained row of a decode
step at once: one read-back of the step's tokens, the masks filled by
llguidance's thread pool into one array, unpacked in one go (by MLX on a
GPU, by numpy on a CPU: :func:`unpack_bitmask`).

Compiling runs in a worker thread, never on the Trio thread; the engine bounds
how long it may take (:data:`COMPILE_TIMEOUT`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from trio_mlx._errors import GenerationFailed, InvalidGrammar
from trio_mlx._params import SamplingParams

__all__ = [
    "COMPACT_JSON",
    "COMPILE_TIMEOUT",
    "DEFAULT_GRAMMAR_CACHE_BYTES",
    "Constraint",
    "GrammarBatch",
    "GrammarCompiler",
    "GrammarProcessor",
    "estimated_bytes",
    "grammar_source",
    "matcher_error",
    "probe",
    "unpack_bitmask",
]

#: Seconds a constraint may take to compile before the request is refused.
COMPILE_TIMEOUT = 10.0
#: Compiled grammars kept per engine (least recently used dropped first): clients tend
#: to send the same schema again, and ``n`` choices of one request share it.
CACHED_GRAMMARS = 64
#: The default byte bound of those kept grammars (their estimated size, below).
DEFAULT_GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024
#: Estimated bytes a compiled matcher holds per character of its grammar text, and at
#: least: measured 53-69 (resident memory over 16 compiled schemas of 200 and 2,000
#: properties, one mask computed each, on 512- and 3,072-token vocabularies).
_BYTES_PER_GRAMMAR_CHAR = 64
_MIN_GRAMMAR_BYTES = 64 * 1024
#: Tokens a new grammar is walked before it is handed out (:func:`probe`).
PROBE_STEPS = 8

#: llguidance's JSON options for schemas: compact JSON, no free whitespace. With
#: the library's default (any whitespace between tokens) a small model can pad
#: with blanks until ``max_tokens`` and never close the value. A schema's own
#: ``"x-guidance"`` object overrides these.
COMPACT_JSON: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}


def grammar_source(params: SamplingParams) -> tuple[str, str] | None:
    """The llguidance grammar for ``params`` and the field it came from, or None."""
    from llguidance import LLMatcher

    if params.json_schema is not None:
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                json.dumps(params.json_schema), defaults=COMPACT_JSON
            )
        except (ValueError, TypeError, RecursionError) as error:
            raise InvalidGrammar(f"json_schema: {error}", param="json_schema") from None
        return grammar, "json_schema"
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex), "regex"
    if params.grammar is not None:
        return LLMatcher.grammar_from_lark(params.grammar), "grammar"
    return None


def matcher_error(matcher: Any, param: str | None) -> InvalidGrammar | GenerationFailed:
    """The error for a matcher that failed: llguidance's reason, its state dump cut.

    A row only ever feeds its matcher tokens that matcher allowed, so a matcher
    that fails otherwise than on a token outside its grammar (an engine bug:
    :class:`~trio_mlx.GenerationFailed`) went past llguidance's limits (items in
    a row, lexer fuel, forced tokens): a property of the schema the client
    sent, :class:`~trio_mlx.InvalidGrammar` with ``code="grammar_too_complex"``.
    """
    reason = str(matcher.get_error()).split("\n<state>", 1)[0].strip()
    if "doesn't satisfy the grammar" in reason:
        return GenerationFailed(f"the constrained row left its grammar: {reason}")
    where = f"{param}: " if param else ""
    return InvalidGrammar(
        f"{where}{reason or 'the grammar failed'}", param=param, code="grammar_too_complex"
    )


def probe(matcher: Any, eos_ids: frozenset[int], param: str, steps: int = PROBE_STEPS) -> None:
    """Walk a copy of a fresh matcher a few tokens; raise :class:`InvalidGrammar` if it fails.

    llguidance compiles lazily: a schema past its limits (an object of more
    than 500 optional properties, a required self-reference that has no
    finite value) compiles, then fails at the first token generated. Taking
    the lowest allowed non-EOS token a few times finds those before the
    request is queued; the walk costs a few masks.
    """
    import numpy as np

    walker = matcher.deep_copy()
    for _ in range(steps):
        if walker.is_stopped() or walker.is_error():
            break
        bits = np.unpackbits(
            np.frombuffer(walker.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        token = next((int(t) for t in np.flatnonzero(bits) if int(t) not in eos_ids), None)
        if walker.is_error() or token is None:
            break
        walker.consume_token(token)
    if walker.is_error():
        raise matcher_error(walker, param)


def estimated_bytes(grammar: str) -> int:
    """The memory a compiled matcher of ``grammar`` holds, estimated from the text's length.

    llguidance reports no size; 64 bytes per grammar character (at least 64
    KiB) covers what was measured (53-69 bytes per character, resident memory
    over 16 compiled schemas with a mask computed each).
    """
    return max(_MIN_GRAMMAR_BYTES, _BYTES_PER_GRAMMAR_CHAR * len(grammar))


@attrs.define(eq=False)
class GrammarCompiler:
    """Compiles constraints for one model's tokenizer. Thread-safe; blocking calls.

    Compiled matchers are kept, least recently used dropped first, up to
    :data:`CACHED_GRAMMARS` of them and ``cache_bytes`` of their estimated size
    (:func:`estimated_bytes`); a grammar larger than ``cache_bytes`` is not kept.
    """

    #: mlx-lm's ``TokenizerWrapper``.
    tokenizer: Any
    #: Width of the model's logits (its ``vocab_size``); None: the tokenizer's.
    vocab_size: int | None = None
    #: The byte bound of the kept grammars (0: keep none).
    cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    #: Compiles served from the cache (a fresh copy of a matcher compiled before).
    hits: int = attrs.field(init=False, default=0)
    #: The estimated bytes of the grammars kept now.
    cached_bytes: int = attrs.field(init=False, default=0)
    _llg: Any = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _cache: OrderedDict[str, tuple[Any, int]] = attrs.field(init=False, factory=OrderedDict)

    @property
    def cached(self) -> int:
        """How many compiled grammars are kept."""
        return len(self._cache)

    def llg_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (about 20 ms at 3k tokens)."""
        with self._lock:
            if self._llg is None:
                import llguidance.hf

                self._llg = llguidance.hf.from_tokenizer(
                    self.tokenizer._tokenizer,
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_token_ids),
                )
            return self._llg

    def compile(self, params: SamplingParams) -> Constraint | None:
        """Compile ``params``'s constraint (None when it has none).

        Raises :class:`~trio_mlx.InvalidGrammar` with llguidance's reason when
        the schema, regex or grammar cannot be compiled.
        """
        source = grammar_source(params)
        if source is None:
            return None
        grammar, param = source
        words = (int(self.llg_tokenizer().vocab_size) + 31) // 32
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                self.hits += 1
                # A copy: the cached matcher itself never consumes a token.
                return Constraint(cached[0].deep_copy(), words, param)
        from llguidance import LLMatcher

        matcher = LLMatcher(self.llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(f"{param}: {matcher.get_error()}", param=param)
        probe(matcher, frozenset(self.tokenizer.eos_token_ids), param)
        self._keep(grammar, matcher)
        return Constraint(matcher.deep_copy(), words, param)

    def _keep(self, grammar: str, matcher: Any) -> None:
        size = estimated_bytes(grammar)
        if size > self.cache_bytes:
            return
        with self._lock:
            previous = self._cache.pop(grammar, None)
            if previous is not None:
                self.cached_bytes -= previous[1]
            self._cache[grammar] = (matcher, size)
            self.cached_bytes += size
            while len(self._cache) > CACHED_GRAMMARS or self.cached_bytes > self.cache_bytes:
                _grammar, (_matcher, dropped) = self._cache.popitem(last=False)
                self.cached_bytes -= dropped


def _on_gpu() -> bool:
    import mlx.core as mx

    return bool(mx.default_device() == mx.gpu)


def unpack_bitmask(words: Any, width: int, *, device: bool | None = None) -> Any:
    """llguidance's bitmasks as an MLX bool array: ``(rows, W)`` int32 -> ``(rows, width)``.

    Bit ``j`` of word ``i`` (least significant first) allows token ``32 * i + j``;
    tokens past the mask's end (a model wider than its tokenizer) are forbidden.
    ``device=True`` unpacks with MLX ops (the words travel, 4 KB per 32k tokens,
    and one small kernel expands them), ``False`` with ``np.unpackbits`` on the
    host; None picks MLX on a GPU and numpy on a CPU, where numpy measured faster
    (design/structured-output.md).
    """
    import mlx.core as mx
    import numpy as np

    words = np.ascontiguousarray(words, dtype=np.int32)
    rows, count = words.shape
    if device is None:
        device = _on_gpu()
    if device:
        shifts = mx.arange(32, dtype=mx.int32)
        bits = ((mx.array(words)[:, :, None] >> shifts) & 1).reshape(rows, count * 32)
        allowed = bits != 0
        if count * 32 < width:
            return mx.concatenate(
                [allowed, mx.zeros((rows, width - count * 32), dtype=mx.bool_)], axis=1
            )
        return allowed[:, :width]
    unpacked = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    if unpacked.shape[1] < width:
        unpacked = np.pad(unpacked, ((0, 0), (0, width - unpacked.shape[1])))
    return mx.array(unpacked[:, :width].view(np.bool_))


@attrs.define(eq=False)
class Constraint:
    """One request's compiled constraint; it makes that row's processor once."""

    matcher: Any
    #: 32-bit words in one bitmask (the tokenizer's size / 32, rounded up).
    words: int
    #: The request field it came from (``json_schema``, ``regex``, ``grammar``).
    param: str | None = None

    def processor(self) -> GrammarProcessor:
        """The logits processor for the row (call once per row)."""
        return GrammarProcessor(self.matcher, self.words, self.param)


class GrammarProcessor:
    """An mlx-lm logits processor that keeps a row inside its grammar.

    mlx-lm calls it with the row's tokens so far (prompt and generated) and
    the logits for the next token. The first call marks where generation
    starts; each later call feeds the matcher the tokens it has not seen, so a
    row parked and resumed (called again with the same tokens) is not fed
    twice. Inside a step prepared by a :class:`GrammarBatch` the matcher was
    already fed and its mask computed with the other rows'; the call only
    checks that the row moved on by exactly that one token and applies it.
    """

    def __init__(self, matcher: Any, words: int, param: str | None = None) -> None:
        self.matcher = matcher
        self.words = words
        self.param = param
        self._start: int | None = None
        self._fed = 0
        #: (batch, index) while a GrammarBatch step holds this row's mask.
        self._slot: tuple[GrammarBatch, int] | None = None

    @property
    def started(self) -> bool:
        """Whether the processor has been called once (it knows where generation starts)."""
        return self._start is not None

    def _feed(self, ids: list[int]) -> None:
        # A stopped matcher allowed only EOS, which ends the row: nothing to feed.
        if ids and not self.matcher.is_stopped() and not self.matcher.consume_tokens(ids):
            raise matcher_error(self.matcher, self.param)
        self._fed += len(ids)

    def _check(self) -> None:
        if self.matcher.is_error():
            raise matcher_error(self.matcher, self.param)

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np

        length = int(tokens.shape[-1])
        slot, self._slot = self._slot, None
        if slot is not None:
            return slot[0].apply(self, slot[1], length, logits)
        if self._start is None:
            self._start = length
        new = length - self._start - self._fed
        if new > 0:
            self._feed(tokens[length - new :].tolist())
        self._check()
        mask = np.empty((1, self.words), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = unpack_bitmask(mask, int(logits.shape[-1]))
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


#: Whether a GrammarBatch queues the forward pass before reading the tokens back:
#: on a GPU the device then runs the layers while the host computes the masks; on a
#: CPU both compete for the same cores (measured no better: design/structured-output.md).
def _overlap() -> bool:
    return _on_gpu()


class GrammarBatch:
    """Every constrained row's mask of one decode step, computed together.

    The batch lane calls :meth:`begin` before a decode step with the step's
    input tokens (the tokens sampled last step, one per row, still on the
    device) and the rows' grammar processors. The first of those processors
    that mlx-lm calls does the work for all of them (:meth:`prepare`): one
    read-back of the tokens, each matcher fed its row's token, all masks
    filled into one ``(rows, W)`` array by llguidance's thread pool, unpacked
    at once; each processor then applies its row of it. A row that fails
    (its token leaves the grammar) fails alone. :meth:`end` forgets the step.
    """

    def __init__(self) -> None:
        self._executor: Any = None
        self._tokens: Any = None
        self._rows: list[tuple[int, GrammarProcessor]] = []
        self._mask: Any = None
        self._errors: dict[int, BaseException] = {}
        self._failure: BaseException | None = None
        self._buffer: Any = None
        #: Steps whose masks were computed together, and the row-masks in them.
        self.steps = 0
        self.rows = 0

    def begin(self, tokens: Any, rows: list[tuple[int, GrammarProcessor]]) -> None:
        """Prepare a step: ``tokens`` (the step's inputs), ``rows`` (index in it, processor)."""
        import mlx.core as mx

        self._rows = [(e, p) for e, p in rows if p.started]
        if not self._rows:
            return
        self._tokens = tokens
        self._mask = None
        self._failure = None
        self._errors = {}
        # Scheduled now, ahead of the forward pass, so reading it back never waits for that.
        mx.async_eval(tokens)  # type: ignore[no-untyped-call]
        for k, (_e, processor) in enumerate(self._rows):
            processor._slot = (self, k)

    def end(self) -> None:
        """Forget the step (every slot it handed out, used or not)."""
        for _e, processor in self._rows:
            processor._slot = None
        self._rows, self._tokens, self._mask = [], None, None

    def prepare(self, logits: Any) -> None:
        """Feed every row its token and compute all masks (the step's first grammar call)."""
        import mlx.core as mx
        import numpy as np

        if _overlap():
            mx.async_eval(logits)  # type: ignore[no-untyped-call]
        ids = self._tokens.tolist()
        live = []
        for k, (e, processor) in enumerate(self._rows):
            try:
                processor._feed([int(ids[e])])
                processor._check()
            except (InvalidGrammar, GenerationFailed) as exc:
                self._errors[k] = exc
                continue
            live.append((processor.matcher, k))
        words = max(p.words for _e, p in self._rows)
        shape = (len(self._rows), words)
        if self._buffer is None or self._buffer.shape != shape:
            self._buffer = np.empty(shape, dtype=np.int32)
        buffer = self._buffer
        buffer.fill(-1)
        if live:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                live, buffer.ctypes.data, words * 4, len(self._rows)
            )
        self._mask = unpack_bitmask(buffer, int(logits.shape[-1]))
        self.steps += 1
        self.rows += len(self._rows)

    def apply(self, processor: GrammarProcessor, k: int, length: int, logits: Any) -> Any:
        """Row ``k``'s mask applied to its logits (``length``: its tokens so far, checked)."""
        import mlx.core as mx

        if self._mask is None and self._failure is None:
            try:
                self.prepare(logits)
            except Exception as exc:
                # Not one row's fault (an llguidance or MLX error): every row of the step fails.
                self._failure = exc
        if self._failure is not None:
            raise GenerationFailed(f"the grammar masks failed: {self._failure}")
        error = self._errors.get(k)
        if error is not None:
            raise error
        expected = (processor._start or 0) + processor._fed
        if length != expected:
            raise GenerationFailed(
                f"the constrained row's tokens ({length}) and its matcher ({expected}) disagree"
            )
        return mx.where(self._mask[k : k + 1], logits, mx.array(-mx.inf, dtype=logits.dtype))
