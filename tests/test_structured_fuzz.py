"""The schema compiler under generated and adversarial schemas: a result or InvalidGrammar.

Every schema a client can send either compiles (and survives the first tokens of
generation) or is refused with :class:`~trio_mlx.InvalidGrammar` carrying
llguidance's reason: never another exception type, which the server would
answer with a 500. Bounded: a few dozen examples per run whatever the profile
(each compile takes milliseconds to a second), more under ``heavy``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_mlx import InvalidGrammar, InvalidRequest, SamplingParams

pytestmark = pytest.mark.model

_EXAMPLES = 400 if os.environ.get("HYPOTHESIS_PROFILE") == "heavy" else 30
_FUZZ = settings(
    max_examples=_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_SCALAR_TYPES = ["string", "integer", "number", "boolean", "null"]
#: Patterns that backtracking engines take exponential time on, and odd ones.
_PATTERNS = [
    "(a+)+$", "(a|aa)+$", "(a|a?)+$", "^(([a-z])+.)+[A-Z]([a-z])+$", "(x+x+)+y",
    "a{1000}", "[", "(", "\\", "(?=a)", "(?<!a)b", "\\p{L}+", ".*.*.*=.*", "[^\\x00-\\x7f]*",
]  # fmt: skip


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.sampled_from(_SCALAR_TYPES).map(lambda t: {"type": t}),
        st.builds(
            lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
            st.integers(-(10**20), 10**20),
            st.integers(-(10**20), 10**20),
        ),
        st.builds(
            lambda p, n: {"type": "string", "pattern": p, "maxLength": n},
            st.sampled_from(_PATTERNS),
            st.integers(0, 50),
        ),
        st.lists(st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=6).map(
            lambda values: {"enum": values}
        ),
        st.sampled_from(
            [
                {"$ref": "#"},
                {"$ref": "#/nope"},
                {"$ref": "http://x/y"},
                {"format": "date-time"},
                {"type": "string", "format": "email"},
                {"not": {}},
                {},
                {"type": []},
                {"type": "object", "minProperties": 5, "maxProperties": 1},
                {"uniqueItems": True, "type": "array"},
                {"type": "strange"},
            ]
        ),
    )


def _schema() -> st.SearchStrategy[dict[str, Any]]:
    def extend(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        names = st.text(min_size=1, max_size=6)
        return st.one_of(
            st.builds(
                lambda props, required, extra: {
                    "type": "object",
                    "properties": props,
                    "required": [n for n in props if n in required],
                    "additionalProperties": extra,
                },
                st.dictionaries(names, inner, max_size=5),
                st.sets(names, max_size=5),
                st.booleans(),
            ),
            st.builds(
                lambda items, lo, hi: {
                    "type": "array",
                    "items": items,
                    "minItems": lo,
                    "maxItems": hi,
                },
                inner,
                st.integers(0, 5),
                st.integers(0, 5),
            ),
            st.lists(inner, min_size=1, max_size=4).map(lambda xs: {"anyOf": xs}),
            st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"allOf": xs}),
            st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"oneOf": xs}),
        )

    return st.recursive(_leaf(), extend, max_leaves=12)


def _nested(depth: int, key: str) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema} if key == "items" else {
            "type": "object", "properties": {"a": schema}, "required": ["a"]
        }  # fmt: skip
    return schema


#: Schemas built to hurt: deep nesting, wide objects, huge enums, recursive $refs.
ADVERSARIAL: list[Any] = [
    _nested(60, "items"),
    _nested(60, "properties"),
    _nested(3000, "items"),  # deeper than Python's own recursion limit
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(501)}},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}},
    {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
    {"type": "object", "properties": {"child": {"$ref": "#"}}},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {
        "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}},
        "$ref": "#/$defs/a",
    },
    {"enum": list(range(20_000))},
    {"enum": [f"value-{i}" * 3 for i in range(5_000)]},
    {"type": "string", "pattern": "(a+)+$" * 20},
    {"type": "string", "pattern": "[a-z]{1,1000}[0-9]{1,1000}"},
    {"type": "string", "pattern": "(" * 500 + ")" * 500},
    {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "string"}}} for i in range(300)
        ]
    },
    {"type": "array", "items": {"type": "string"}, "minItems": 100_000},
    {"type": "integer", "minimum": 10**40, "maximum": -(10**40)},
    {"type": "number", "multipleOf": 1e-300},
]


@pytest.fixture(scope="module")
def compiler(tiny_model: Any) -> Any:
    from trio_mlx._lanes.structured import GrammarCompiler

    _model, tokenizer = tiny_model
    return GrammarCompiler(tokenizer)


def check_compiles_or_is_refused(compiler: Any, schema: Any) -> None:
    try:
        params = SamplingParams(json_schema=schema)
    except InvalidRequest:
        return  # refused at construction: fine
    refused: InvalidGrammar | None = None
    try:
        compiler.compile(params)
    except InvalidGrammar as error:
        refused = error
    if refused is not None:
        assert refused.status_code == 400
        assert refused.message


@_FUZZ
@given(schema=_schema())
def test_generated_schemas_compile_or_are_refused_as_invalid_grammar(
    compiler: Any, schema: dict[str, Any]
) -> None:
    check_compiles_or_is_refused(compiler, schema)


@pytest.mark.parametrize("index", range(len(ADVERSARIAL)))
def test_adversarial_schemas_compile_or_are_refused_as_invalid_grammar(
    compiler: Any, index: int
) -> None:
    check_compiles_or_is_refused(compiler, ADVERSARIAL[index])


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (ADVERSARIAL[3], "max is 2000"),  # 501 optional properties
        (ADVERSARIAL[5], "Too many items"),  # a required self-reference: no finite value
    ],
)
def test_schemas_past_llguidance_limits_are_refused_at_compile_with_its_reason(
    compiler: Any, schema: Any, reason: str
) -> None:
    with pytest.raises(InvalidGrammar) as refused:
        compiler.compile(SamplingParams(json_schema=schema))
    assert refused.value.code == "grammar_too_complex"
    assert refused.value.param == "json_schema"
    assert reason in refused.value.message
    assert "<state>" not in refused.value.message
