"""Structured output in the engine: JSON schemas, regexes and grammars on a real tiny model.

Every schema here bounds its strings and arrays, so a value always ends within
``MAX_TOKENS`` and every output must stop, parse and validate.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio

import trio_mlx
from engine_helpers import NO_EOS, PROMPT, wait_until
from trio_mlx import InvalidGrammar, SamplingParams

pytestmark = pytest.mark.model

MAX_TOKENS = 200
_S = {"type": "string", "maxLength": 12}

#: flat, nested, arrays, enums, bounded integers, optional fields, additionalProperties
#: false throughout (and a top-level array).
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "nick": _S},
                "required": ["id", "nick"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},
            "y": {"type": "integer", "minimum": 100, "maximum": 200},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"a": _S, "b": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
        "required": ["ok", "code"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["p", "q"]}, "v": {"type": "integer", "minimum": 0, "maximum": 50}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
]  # fmt: skip


def _valid(completion: trio_mlx.Completion, schema: dict[str, Any]) -> Any:
    assert completion.result.finish_reason == "stop", completion.text
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)
    return value


async def _batch(engine: trio_mlx.Engine, requests: list[tuple[Any, SamplingParams]]) -> list[Any]:
    out: list[Any] = [None] * len(requests)

    async def one(i: int) -> None:
        out[i] = await engine.complete(*requests[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(requests)):
            nursery.start_soon(one, i)
    return out


async def test_greedy_output_validates_for_every_schema_alone_and_all_in_one_batch(
    tiny_model_path: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        for schema in SCHEMAS:
            solo = await engine.complete(
                PROMPT, SamplingParams(max_tokens=MAX_TOKENS, json_schema=schema)
            )
            assert solo.result.lane == "batch"
            _valid(solo, schema)
        together = await _batch(
            engine,
            [(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, json_schema=s)) for s in SCHEMAS],
        )
        assert engine.statistics().requests["batch:finished"] == 2 * len(SCHEMAS)
    for completion, schema in zip(together, SCHEMAS, strict=True):
        _valid(completion, schema)


async def test_sampled_output_validates_for_twenty_seeds_per_schema(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        seen = set()
        for schema in SCHEMAS:
            for seed in range(20):
                params = SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, json_schema=schema
                )
                completion = await engine.complete(PROMPT, params)
                assert completion.result.lane == "serial"
                seen.add(json.dumps(_valid(completion, schema)))
        # Unseeded sampled rows of all eight schemas together in the batch.
        sampled = [
            (PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, json_schema=s))
            for s in SCHEMAS
        ]
        together = await _batch(engine, sampled)
    for completion, schema in zip(together, SCHEMAS, strict=True):
        assert completion.result.lane == "batch"
        _valid(completion, schema)
    # Sampling really varies the values (not one forced answer per schema).
    assert len(seen) > 2 * len(SCHEMAS)


async def test_streamed_constrained_output_joins_to_the_whole_value(tiny_model_path: Path) -> None:
    schema = SCHEMAS[1]
    params = SamplingParams(max_tokens=MAX_TOKENS, json_schema=schema)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        whole = await engine.complete(PROMPT, params)
        pieces = []
        async with engine.generate(PROMPT, params) as stream:
            async for delta in stream:
                pieces.append(delta.text)
        assert stream.result.finish_reason == "stop"
    assert len(pieces) > 1
    assert "".join(pieces) == whole.text
    _valid(whole, schema)


async def test_unconstrained_row_beside_constrained_rows_keeps_its_greedy_tokens(
    tiny_model_path: Path,
) -> None:
    plain = SamplingParams(max_tokens=40, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        solo = await engine.complete(PROMPT, plain)
        mixed = await _batch(
            engine,
            [(PROMPT, plain)]
            + [(PROMPT + " x", SamplingParams(max_tokens=40, json_schema=s)) for s in SCHEMAS[:3]],
        )
    assert mixed[0].result.lane == "batch"
    assert mixed[0].token_ids == solo.token_ids
    for completion, schema in zip(mixed[1:], SCHEMAS[:3], strict=True):
        _valid(completion, schema)


async def test_regex_and_lark_grammar_constrain_the_text(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        by_regex = await engine.complete(
            PROMPT, SamplingParams(max_tokens=30, temperature=1.0, regex=r"[a-c]{3}-[0-9]{2}")
        )
        by_grammar = await engine.complete(
            PROMPT,
            SamplingParams(
                max_tokens=30, temperature=1.0, grammar='start: ("yes" | "no") " " /[0-9]/'
            ),
        )
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", by_regex.text)
    assert by_regex.result.finish_reason == "stop"
    assert re.fullmatch(r"(yes|no) [0-9]", by_grammar.text)
    assert by_grammar.result.finish_reason == "stop"


async def test_max_tokens_before_the_end_of_the_value_finishes_with_length(
    tiny_model_path: Path,
) -> None:
    long = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 50,
    }
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        cut = await engine.complete(PROMPT, SamplingParams(max_tokens=12, json_schema=long))
    assert cut.result.finish_reason == "length"
    assert len(cut.token_ids) == 12
    assert cut.text.startswith("[")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


async def test_constrained_rows_parked_and_resumed_stay_in_their_grammar(
    tiny_model_path: Path,
) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99},
              "minItems": 20, "maxItems": 20}  # fmt: skip
    constrained = SamplingParams(max_tokens=MAX_TOKENS, json_schema=schema)
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, drain_timeout=0.0) as engine:
        results: list[Any] = []

        async def row(i: int) -> None:
            results.append(await engine.complete(PROMPT + " y" * i, constrained))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(row, i)
            await wait_until(lambda: engine.statistics().generated_tokens > 3)
            await engine.complete(PROMPT, seeded)
        assert engine.statistics().preemptions > 0
    assert len(results) == 3
    for completion in results:
        assert len(_valid(completion, schema)) == 20


def test_bad_constraints_are_refused_when_the_params_are_built() -> None:
    with pytest.raises(InvalidGrammar, match="at most one") as caught:
        SamplingParams(json_schema={"type": "object"}, regex="a+")
    assert caught.value.param == "regex"
    with pytest.raises(InvalidGrammar, match="must be a JSON schema object"):
        SamplingParams(json_schema=[1, 2])
    with pytest.raises(InvalidGrammar, match="not valid JSON"):
        SamplingParams(json_schema="{nope")
    with pytest.raises(InvalidGrammar, match="non-empty string"):
        SamplingParams(regex="")
    with pytest.raises(InvalidGrammar, match="does not serialize"):
        SamplingParams(json_schema={"type": object()})
    # A complete value ends with EOS: holding EOS back or ignoring it cannot work.
    with pytest.raises(InvalidGrammar, match="min_tokens cannot be combined") as caught:
        SamplingParams(json_schema={"type": "object"}, min_tokens=3)
    assert caught.value.param == "min_tokens"
    with pytest.raises(InvalidGrammar, match="ignore_eos cannot be combined"):
        SamplingParams(regex="a+", ignore_eos=True)
    assert SamplingParams(json_schema='{"type": "object"}').json_schema == {"type": "object"}
    assert SamplingParams(grammar="start: /a/").constrained
    assert not SamplingParams().constrained


async def test_uncompilable_constraints_are_refused_before_generating(
    tiny_model_path: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        for params, param, reason in [
            (SamplingParams(json_schema={"type": "frobnicate"}), "json_schema", "frobnicate"),
            (SamplingParams(regex="a(b"), "regex", "unclosed group"),
            (SamplingParams(grammar="start: missing_rule"), "grammar", "missing_rule"),
        ]:
            with pytest.raises(InvalidGrammar, match=reason) as caught:
                await engine.complete(PROMPT, params)
            assert caught.value.param == param
            assert caught.value.code == "invalid_grammar"
        stats = engine.statistics()
        assert stats.generated_tokens == 0
        assert sum(stats.requests.values()) == 0
        # The engine serves on.
        after = await engine.complete(PROMPT, SamplingParams(max_tokens=3, logit_bias=NO_EOS))
    assert len(after.token_ids) == 3


def _huge_schema(properties: int = 10_000) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(properties)},
        "required": [f"p{i}" for i in range(properties)],
    }


async def test_huge_schema_past_the_compile_bound_is_refused_while_others_are_served(
    tiny_model_path: Path,
) -> None:
    plain = SamplingParams(max_tokens=20, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, grammar_timeout=0.01) as engine:
        served: list[trio_mlx.Completion] = []
        refused: list[InvalidGrammar] = []

        async def huge() -> None:
            with pytest.raises(InvalidGrammar) as caught:
                await engine.complete(
                    PROMPT, SamplingParams(max_tokens=4, json_schema=_huge_schema())
                )
            refused.append(caught.value)

        async def other() -> None:
            served.append(await engine.complete(PROMPT, plain))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(huge)
            nursery.start_soon(other)
    assert refused[0].code == "grammar_too_complex"
    assert "did not compile within" in refused[0].message
    assert len(served[0].token_ids) == 20


async def test_huge_schema_within_the_bound_compiles_and_generates(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path, grammar_timeout=120) as engine:
        cut = await engine.complete(
            PROMPT, SamplingParams(max_tokens=6, json_schema=_huge_schema())
        )
    assert cut.result.finish_reason == "length"
    assert cut.text.startswith('{"p0":')


def test_a_schema_compiled_again_is_a_fresh_copy_from_the_cache(tiny_model: Any) -> None:
    from trio_mlx._lanes.structured import GrammarCompiler

    _model, tokenizer = tiny_model
    compiler = GrammarCompiler(tokenizer)
    params = SamplingParams(json_schema=SCHEMAS[3])
    first = compiler.compile(params)
    second = compiler.compile(params)
    assert first is not None
    assert second is not None
    assert compiler.hits == 1
    # Feeding one row's matcher leaves the other (and the cached one) at the start.
    assert first.matcher.consume_tokens(tokenizer.encode('{"color":', add_special_tokens=False))
    assert first.matcher.compute_bitmask() != second.matcher.compute_bitmask()
    third = compiler.compile(params)
    assert third is not None
    assert third.matcher.compute_bitmask() == second.matcher.compute_bitmask()
    assert compiler.hits == 2


def _wide_schema(key: str, properties: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"{key}{i}": {"type": "integer"} for i in range(properties)},
        "required": [f"{key}{i}" for i in range(properties)],
    }


def test_the_grammar_cache_is_bounded_by_its_estimated_bytes(tiny_model: Any) -> None:
    from trio_mlx._lanes.structured import GrammarCompiler, estimated_bytes, grammar_source

    _model, tokenizer = tiny_model
    schemas = [_wide_schema(key, 200) for key in "abcdef"]
    sizes = [estimated_bytes(grammar_source(SamplingParams(json_schema=s))[0]) for s in schemas]
    compiler = GrammarCompiler(tokenizer, cache_bytes=3 * max(sizes))
    for schema in schemas:
        compiler.compile(SamplingParams(json_schema=schema))
        assert compiler.cached_bytes <= compiler.cache_bytes
    assert compiler.cached == 3
    assert compiler.cached_bytes == sum(sizes[-3:])
    # The least recently used went first: the last three are served from the cache.
    for schema in schemas[-3:]:
        compiler.compile(SamplingParams(json_schema=schema))
    assert compiler.hits == 3
    compiler.compile(SamplingParams(json_schema=schemas[0]))
    assert compiler.hits == 3
    # A grammar larger than the whole bound compiles and is not kept.
    small = GrammarCompiler(tokenizer, cache_bytes=min(sizes) - 1)
    assert small.compile(SamplingParams(json_schema=schemas[0])) is not None
    assert small.cached == 0
    assert small.cached_bytes == 0


async def test_an_abandoned_compile_gives_its_slot_back_and_abandoned_ones_are_bounded() -> None:
    import threading

    from trio_mlx import EngineOverloaded
    from trio_mlx._core.compile_gate import CompileGate

    gate = CompileGate(slots=1, max_abandoned=2)
    release = threading.Event()
    started = threading.Semaphore(0)

    def stuck() -> str:
        started.release()
        release.wait(timeout=60)  # a compile llguidance cannot stop
        return "late"

    async def abandon_one() -> None:
        # Its caller gives up once the thread runs (as a deadline would, but
        # without racing the thread's start on a loaded machine).
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(gate.run, stuck, seconds=600, param="json_schema"))
                await trio.to_thread.run_sync(started.acquire)
                scope.cancel()

    try:
        await abandon_one()
        stats = gate.statistics()
        assert (stats.abandoned, stats.running) == (1, 0)  # the one slot is free again
        assert await gate.run(lambda: "quick", seconds=600, param="json_schema") == "quick"
        await abandon_one()
        # Two abandoned compiles still run: a third compile is refused, not queued.
        with pytest.raises(EngineOverloaded) as busy:
            await gate.run(lambda: "quick", seconds=600, param="json_schema")
        assert busy.value.code == "grammar_compiles_busy"
        assert gate.statistics().refused == 1
    finally:
        release.set()
    with trio.fail_after(60):
        while gate.statistics().abandoned:  # noqa: ASYNC110 - counted by other threads
            await trio.sleep(0.01)
    assert await gate.run(lambda: "quick", seconds=600, param="json_schema") == "quick"


async def test_one_clients_compiles_hold_one_slot_and_leave_the_other_to_others() -> None:
    import threading

    from trio_mlx._core.compile_gate import CompileGate

    gate = CompileGate(slots=2)
    release = threading.Event()
    order: list[str] = []

    def compile_for(name: str) -> str:
        order.append(name)
        release.wait(timeout=60)
        return name

    results: dict[str, str] = {}

    async def run(name: str, client: str) -> None:
        results[name] = await gate.run(
            partial(compile_for, name), seconds=600, param="json_schema", client=client
        )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a1", "a")
            await wait_until(lambda: order == ["a1"])
            nursery.start_soon(run, "a2", "a")  # waits for a's own slot ...
            await wait_until(lambda: gate._clients["a"][1] == [2])
            nursery.start_soon(run, "b1", "b")  # ... while b takes the other one
            await wait_until(lambda: order == ["a1", "b1"])
            assert gate.statistics().running == 2
            release.set()
    assert order == ["a1", "b1", "a2"]
    assert results == {"a1": "a1", "a2": "a2", "b1": "b1"}
    assert not gate._clients  # no client's slot outlives its compiles


@pytest.mark.parametrize(
    "constraint", [{"json_schema": {"type": "object"}}, {"regex": "a+"}, {"grammar": "start: /a+/"}]
)
def test_stop_sequences_with_a_constraint_are_refused_at_construction(
    constraint: dict[str, Any],
) -> None:
    with pytest.raises(InvalidGrammar) as refused:
        SamplingParams(stop=["}"], **constraint)
    assert refused.value.param == "stop"
    assert f"combined with {next(iter(constraint))}" in refused.value.message
