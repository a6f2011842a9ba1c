"""Structured output: decoding constrained to a JSON schema, a regex or a Lark grammar.

`llguidance <https://github.com/guidance-ai/llguidance>`_ compiles the
constraint into a matcher over the model's vocabulary (see
``design/structured-output.md`` for why this library). Each constrained row
gets its own matcher, wrapped in a :class:`GrammarProcessor`: an mlx-lm logits
processor, so rows with different constraints and rows with none share one
batch. The processor runs where mlx-lm calls processors, on the MLX thread:
it feeds the row's newly sampled tokens to the matcher, asks for the bitmask
of allowed next tokens (a few microseconds to a few hundred in llguidance's
Rust code), unpacks it with numpy and applies it with one ``mx.where``.

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
    "Constraint",
    "GrammarCompiler",
    "GrammarProcessor",
    "grammar_source",
]

#: Seconds a constraint may take to compile before the request is refused.
COMPILE_TIMEOUT = 10.0
#: Compiled grammars kept per engine (least recently used dropped first): clients tend
#: to send the same schema again, and ``n`` choices of one request share it.
CACHED_GRAMMARS = 64

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
        except (ValueError, TypeError) as error:
            raise InvalidGrammar(f"json_schema: {error}", param="json_schema") from None
        return grammar, "json_schema"
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex), "regex"
    if params.grammar is not None:
        return LLMatcher.grammar_from_lark(params.grammar), "grammar"
    return None


@attrs.define(eq=False)
class GrammarCompiler:
    """Compiles constraints for one model's tokenizer. Thread-safe; blocking calls."""

    #: mlx-lm's ``TokenizerWrapper``.
    tokenizer: Any
    #: Width of the model's logits (its ``vocab_size``); None: the tokenizer's.
    vocab_size: int | None = None
    #: Compiles served from the cache (a fresh copy of a matcher compiled before).
    hits: int = attrs.field(init=False, default=0)
    _llg: Any = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _cache: OrderedDict[str, Any] = attrs.field(init=False, factory=OrderedDict)

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
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                self.hits += 1
                # A copy: the cached matcher itself never consumes a token.
                return Constraint(cached.deep_copy())
        from llguidance import LLMatcher

        matcher = LLMatcher(self.llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(f"{param}: {matcher.get_error()}", param=param)
        with self._lock:
            self._cache[grammar] = matcher
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return Constraint(matcher.deep_copy())


@attrs.define(eq=False)
class Constraint:
    """One request's compiled constraint; it makes that row's processor once."""

    matcher: Any

    def processor(self) -> GrammarProcessor:
        """The logits processor for the row (call once per row)."""
        return GrammarProcessor(self.matcher)


class GrammarProcessor:
    """An mlx-lm logits processor that keeps a row inside its grammar.

    mlx-lm calls it with the row's tokens so far (prompt and generated) and
    the logits for the next token. The first call marks where generation
    starts; each later call feeds the matcher the tokens it has not seen, so a
    row parked and resumed (called again with the same tokens) is not fed
    twice.
    """

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._start: int | None = None
        self._fed = 0
        self._neg: Any = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np

        length = int(tokens.shape[-1])
        if self._start is None:
            self._start = length
        new = length - self._start - self._fed
        # A stopped matcher allowed only EOS, which ends the row: nothing to feed.
        if new > 0 and not self._matcher.is_stopped():
            ids = tokens[length - new :].tolist()
            if not self._matcher.consume_tokens(ids):
                raise GenerationFailed(
                    f"the constrained row left its grammar: {self._matcher.get_error()}"
                )
        self._fed += max(new, 0)
        if self._matcher.is_error():
            raise GenerationFailed(f"the grammar matcher failed: {self._matcher.get_error()}")
        if self._neg is None:
            self._neg = mx.array(-mx.inf, dtype=logits.dtype)
        # One bit per token, little-endian: unpacked here (tens of microseconds at
        # 150k tokens) so the device sees one bool array and one where().
        bits = np.unpackbits(
            np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        width = int(logits.shape[-1])
        if bits.shape[0] < width:
            bits = np.pad(bits, (0, width - bits.shape[0]))
        return mx.where(mx.array(bits[:width].view(np.bool_)), logits, self._neg)
