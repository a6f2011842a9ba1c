"""Request parameters and result values: frozen attrs with validators.

A bad value raises :class:`~trio_mlx.InvalidRequest` naming the field at
construction, so it never travels to the actor or the MLX thread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trio_mlx._errors import InvalidGrammar, InvalidRequest

__all__ = [
    "Completion",
    "Delta",
    "Embeddings",
    "GenerationResult",
    "SamplingParams",
    "TokenLogprob",
]

#: The most stop sequences one request may carry, and the longest one (characters).
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
#: The most alternatives ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The most ``logit_bias`` entries (OpenAI's limit is 300 tokens).
MAX_LOGIT_BIAS = 300
#: The longest JSON schema (serialized), regex or grammar a request may carry (characters).
MAX_GRAMMAR_CHARS = 2_000_000


def _number(
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    integer: bool = False,
    optional: bool = False,
) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """A validator: a finite number (an int when ``integer``) within [low, high]."""

    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        name = attribute.name
        if value is None and optional:
            return
        wrong_kind = not isinstance(value, int) if integer else not isinstance(value, int | float)
        if isinstance(value, bool) or wrong_kind:
            kind = "an integer" if integer else "a number"
            raise InvalidRequest(f"{name} must be {kind}, not {value!r}", param=name)
        try:
            value = float(value)
        except OverflowError:
            raise InvalidRequest(f"{name} is out of range", param=name) from None
        if not math.isfinite(value):
            raise InvalidRequest(f"{name} must be finite, not {value!r}", param=name)
        if low is not None and (value <= low if low_open else value < low):
            relation = ">" if low_open else ">="
            raise InvalidRequest(f"{name} must be {relation} {low}, not {value!r}", param=name)
        if high is not None and value > high:
            raise InvalidRequest(f"{name} must be <= {high}, not {value!r}", param=name)

    return check


def _boolean(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(
            f"{attribute.name} must be a boolean, not {value!r:.80}", param=attribute.name
        )


def _to_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(value)
    raise InvalidRequest(f"stop must be a string or a list of strings, not {value!r}", param="stop")


def _check_stop(_instance: Any, _attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, not {len(value)}", param="stop"
        )
    for item in value:
        if not isinstance(item, str) or not item:
            raise InvalidRequest(
                f"stop sequences must be non-empty strings: {item!r}", param="stop"
            )
        if len(item) > MAX_STOP_LENGTH:
            raise InvalidRequest(
                f"a stop sequence may be at most {MAX_STOP_LENGTH} characters", param="stop"
            )


def _to_logit_bias(value: Any) -> Mapping[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(
                f"logit_bias keys must be token ids, not {key!r}", param="logit_bias"
            ) from None
        out[token] = bias
    return out


def _check_logit_bias(
    _instance: Any, _attribute: attrs.Attribute[Any], value: Mapping[int, Any] | None
) -> None:
    if value is None:
        return
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries", param="logit_bias"
        )
    for token, bias in value.items():
        if token < 0:
            raise InvalidRequest(f"logit_bias key {token} is not a token id", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise InvalidRequest(f"logit_bias values must be numbers: {bias!r}", param="logit_bias")
        if not -100 <= bias <= 100:
            raise InvalidRequest("logit_bias values must be within [-100, 100]", param="logit_bias")


def _check_markers(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and all(
            isinstance(ids, tuple)
            and ids
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            for ids in value
        )
    )
    if not ok:
        raise InvalidRequest(
            "reasoning_markers must be two non-empty tuples of token ids",
            param="reasoning_markers",
        )


def _check_adapter(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequest("adapter must be a non-empty string", param="adapter")


def _check_kv_bits(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in (2, 3, 4, 6, 8):
        raise InvalidRequest("kv_bits must be one of 2, 3, 4, 6, 8", param="kv_bits")


def _check_kv_group_size(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in (32, 64, 128):
        raise InvalidRequest("kv_group_size must be one of 32, 64, 128", param="kv_group_size")


def _to_json_schema(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as error:
            raise InvalidGrammar(
                f"json_schema is not valid JSON: {error}", param="json_schema"
            ) from None
    return value


def _check_json_schema(_instance: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise InvalidGrammar(
            f"json_schema must be a JSON schema object, not {value!r:.80}", param="json_schema"
        )
    try:
        size = len(json.dumps(value))
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidGrammar(
            f"json_schema does not serialize as JSON: {error}", param="json_schema"
        ) from None
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidGrammar(
            f"json_schema is {size} characters as JSON, more than {MAX_GRAMMAR_CHARS}",
            param="json_schema",
        )


def _check_source(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    name = attribute.name
    if not isinstance(value, str) or not value:
        raise InvalidGrammar(f"{name} must be a non-empty string", param=name)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidGrammar(
            f"{name} is {len(value)} characters, more than {MAX_GRAMMAR_CHARS}", param=name
        )


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to generate one completion. Every field is checked at construction.

    Defaults are greedy decoding of up to 256 tokens. Which lane runs the
    request (the continuous batch, or alone) follows from these fields: a
    ``seed``, ``kv_bits`` or an ``adapter`` need the serial lane.
    """

    #: The most tokens to generate (>= 1).
    max_tokens: int = attrs.field(default=256, validator=_number(low=1, integer=True))
    #: Sampling temperature; 0 is greedy.
    temperature: float = attrs.field(default=0.0, validator=_number(low=0.0, high=100.0))
    #: Nucleus sampling mass in (0, 1].
    top_p: float = attrs.field(default=1.0, validator=_number(low=0.0, low_open=True, high=1.0))
    #: Keep only the k most likely tokens; 0 disables.
    top_k: int = attrs.field(default=0, validator=_number(low=0, integer=True))
    #: Drop tokens below min_p times the top probability; 0 disables.
    min_p: float = attrs.field(default=0.0, validator=_number(low=0.0, high=1.0))
    #: XTC ("exclude top choices") probability and threshold; 0 disables.
    xtc_probability: float = attrs.field(default=0.0, validator=_number(low=0.0, high=1.0))
    xtc_threshold: float = attrs.field(default=0.0, validator=_number(low=0.0, high=0.5))
    #: Multiplicative repetition penalty (mlx-lm's); None disables.
    repetition_penalty: float | None = attrs.field(
        default=None, validator=_number(low=0.0, low_open=True, high=10.0, optional=True)
    )
    #: Tokens of context the repetition, presence and frequency penalties look back on.
    repetition_context_size: int = attrs.field(default=20, validator=_number(low=1, integer=True))
    #: OpenAI's additive presence and frequency penalties in [-2, 2].
    presence_penalty: float = attrs.field(default=0.0, validator=_number(low=-2.0, high=2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=_number(low=-2.0, high=2.0))
    #: Token id -> bias in [-100, 100] added to its logit.
    logit_bias: Mapping[int, float] | None = attrs.field(
        default=None, converter=_to_logit_bias, validator=_check_logit_bias
    )
    #: Report the chosen token's log-probability, and this many alternatives (0-20).
    logprobs: bool = attrs.field(default=False, validator=_boolean)
    top_logprobs: int = attrs.field(
        default=0, validator=_number(low=0, high=MAX_TOP_LOGPROBS, integer=True)
    )
    #: Generation ends before any of these strings; they are not part of the output.
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop, validator=_check_stop)
    #: A fixed seed makes sampling reproducible (serial lane).
    seed: int | None = attrs.field(
        default=None, validator=_number(low=0, high=2**63 - 1, integer=True, optional=True)
    )
    #: The name of a mounted LoRA adapter to generate with (serial lane).
    adapter: str | None = attrs.field(default=None, validator=_check_adapter)
    #: Quantize the KV cache to this many bits (serial lane); None keeps full precision.
    kv_bits: int | None = attrs.field(default=None, validator=_check_kv_bits)
    kv_group_size: int = attrs.field(default=64, validator=_check_kv_group_size)
    #: Keep generating past an end-of-sequence token (until max_tokens or a stop string).
    ignore_eos: bool = attrs.field(default=False, validator=_boolean)
    #: End-of-sequence tokens are banned, and stop strings not matched, before this many tokens.
    min_tokens: int = attrs.field(default=0, validator=_number(low=0, integer=True))
    #: A matched stop string stays at the end of the output (it is cut by default).
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_boolean)
    #: At most this many tokens of reasoning: once spent, the reasoning block is ended
    #: by emitting ``reasoning_markers``' end marker (None: no bound but max_tokens).
    reasoning_budget: int | None = attrs.field(
        default=None, validator=_number(low=1, integer=True, optional=True)
    )
    #: The token ids that open and that close a reasoning block (with ``reasoning_budget``).
    reasoning_markers: tuple[tuple[int, ...], tuple[int, ...]] | None = attrs.field(
        default=None, validator=_check_markers
    )
    #: The prompt already opened the reasoning block (its chat template wrote the start).
    reasoning_opened: bool = attrs.field(default=False, validator=_boolean)
    #: May speculate where the engine does (``open_engine(prompt_lookup=True)``); False
    #: opts this request out. Outputs are the same either way (greedy token for token).
    speculate: bool = attrs.field(default=True, validator=_boolean)

    #: Constrain the output to JSON valid against this JSON schema (a mapping, or its
    #: JSON text). ``{"type": "object"}`` asks for any one JSON object. JSON is
    #: written compactly (no blank between tokens) unless the schema's
    #: ``"x-guidance"`` options say otherwise. The row stops ("stop") when the
    #: value is complete; if ``max_tokens`` comes first the finish reason is
    #: "length" and the JSON is incomplete.
    json_schema: Mapping[str, Any] | None = attrs.field(
        default=None, converter=_to_json_schema, validator=_check_json_schema
    )
    #: Constrain the output to match this regular expression (llguidance's syntax).
    regex: str | None = attrs.field(default=None, validator=_check_source)
    #: Constrain the output to this Lark grammar (llguidance's Lark dialect, which
    #: also takes ``%json {schema}`` and regex terminals).
    grammar: str | None = attrs.field(default=None, validator=_check_source)

    def __attrs_post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if self.reasoning_budget is not None and self.reasoning_markers is None:
            raise InvalidRequest(
                "reasoning_budget needs reasoning_markers (the ids that open and close "
                "a reasoning block)",
                param="reasoning_budget",
            )
        given = [
            name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None
        ]
        if len(given) > 1:
            raise InvalidGrammar(
                f"give at most one of json_schema, regex and grammar, not {' and '.join(given)}",
                param=given[1],
            )
        # A finished grammar allows only EOS: holding EOS back, or going on past it,
        # would leave no token to choose.
        for name in ("min_tokens", "ignore_eos"):
            if given and getattr(self, name):
                raise InvalidGrammar(
                    f"{name} cannot be combined with {given[0]} (a complete value ends with EOS)",
                    param=name,
                )
        # A stop string matched inside the value would end it unfinished with "stop",
        # and after the value only EOS is allowed: no place where a stop could apply.
        if given and self.stop:
            raise InvalidGrammar(
                f"stop sequences cannot be combined with {given[0]}: one could cut the "
                "value short, and a constrained value ends by itself (send no stop)",
                param="stop",
            )

    @property
    def constrained(self) -> bool:
        """Whether decoding follows a JSON schema, regex or grammar."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None


@attrs.frozen
class TokenLogprob:
    """The log-probability of one generated token and, if asked, its best alternatives."""

    token_id: int
    logprob: float
    #: (token id, log-probability) of the most likely tokens at this position, best first.
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Delta:
    """A piece of a streamed completion: new text and the tokens that made it.

    ``text`` may lag ``token_ids`` by a few tokens while a multi-byte
    character or a possible stop sequence is incomplete.
    """

    text: str
    token_ids: tuple[int, ...]
    #: One entry per token id when the request asked for logprobs.
    logprobs: tuple[TokenLogprob, ...] | None = None


@attrs.frozen
class GenerationResult:
    """How a completion ended, with usage and timings."""

    #: "stop" (EOS or a stop sequence), "length" (max_tokens) or "cancelled".
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens served from the prompt cache, not recomputed.
    cached_tokens: int
    #: "batch" or "serial".
    lane: str
    #: Seconds from submission to the first token, and to the end.
    time_to_first_token: float | None
    duration: float
    #: The max_tokens the request ran with: lower than asked when the prompt
    #: left less room in the model's context (None: not recorded).
    max_tokens: int | None = None


@attrs.frozen
class Embeddings:
    """What :meth:`Engine.embed` returns: one unit-length vector per input, in input order."""

    vectors: tuple[tuple[float, ...], ...]
    #: Each input's tokens.
    token_counts: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        """The inputs' tokens in all (OpenAI's ``usage.prompt_tokens``)."""
        return sum(self.token_counts)


@attrs.frozen
class Completion:
    """A whole completion, as :meth:`Engine.complete` returns it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None
    result: GenerationResult
