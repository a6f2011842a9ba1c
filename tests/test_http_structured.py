"""``response_format`` and enforced ``tool_choice`` through a live server and the ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from http_helpers import live_server
from trio_mlx import InvalidGrammar, InvalidRequest
from trio_mlx_http._common import structured as _structured

pytestmark = pytest.mark.model

#: The served model id: the model directory's name.
MODEL = "tiny-tools"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _response_format(schema: dict[str, Any]) -> Any:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


@pytest.fixture
async def client(json_tools_model_path: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with (
        live_server(json_tools_model_path, grammar_timeout=60) as live,
        openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield client


async def test_json_schema_response_validates_whole_and_streamed(
    client: openai.AsyncOpenAI,
) -> None:
    whole = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=120, response_format=_response_format(PERSON), n=2
    )
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=120,
        temperature=1.0,
        response_format=_response_format(PERSON),
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_json_object_and_text_formats(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, response_format={"type": "json_object"}
    )
    content = reply.choices[0].message.content
    assert content is not None
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # max_tokens cut the object short: it is still the start of one
        assert reply.choices[0].finish_reason == "length"
        assert content.startswith("{")
    plain = await client.chat.completions.create(model=MODEL, messages=USER, max_tokens=10)
    text = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=10, response_format={"type": "text"}
    )
    assert text.choices[0].message.content == plain.choices[0].message.content


async def test_legacy_completions_take_response_format_too(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(
        model=MODEL,
        prompt="A person:",
        max_tokens=120,
        extra_body={"response_format": _response_format(PERSON)},
    )
    assert reply.choices[0].finish_reason == "stop", reply
    jsonschema.validate(json.loads(reply.choices[0].text), PERSON)


async def test_bad_response_formats_are_400_before_anything_is_generated(
    client: openai.AsyncOpenAI,
) -> None:
    cases: list[tuple[Any, str, str | None]] = [
        (_response_format({"type": "frobnicate"}), "Invalid type: frobnicate", "invalid_grammar"),
        (
            _response_format({"type": "string", "pattern": "(unclosed"}),
            "response_format",
            "invalid_grammar",
        ),
        ({"type": "yaml"}, "response_format.type", None),
        ({"type": "json_schema"}, "must be an object with a name", None),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
            "must be a JSON schema object",
            "invalid_grammar",
        ),
    ]
    for response_format, message, code in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match=message) as caught:
                await client.chat.completions.create(
                    model=MODEL,
                    messages=USER,
                    max_tokens=10,
                    response_format=response_format,
                    stream=stream,
                )
            assert caught.value.type == "invalid_request_error"
            assert caught.value.code == code
            assert str(caught.value.param).startswith("response_format")


async def test_huge_schema_past_the_bound_is_a_400(json_tools_model_path: Path) -> None:
    huge = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)},
    }
    async with (
        live_server(json_tools_model_path, grammar_timeout=0.01) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        reply = await http.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 5, "response_format": _response_format(huge)},
        )
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["code"] == "grammar_too_complex"
        assert error["param"] == "response_format"
        assert "did not compile within" in error["message"]
        ok = await http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3})
        assert ok.status_code == 200


async def test_schemas_past_llguidance_limits_are_a_400_with_its_reason(
    json_tools_model_path: Path,
) -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(501)}}
    endless = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    async with (
        live_server(json_tools_model_path) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        for schema, reason in ((wide, "max is 2000"), (endless, "Too many items")):
            for stream in (False, True):
                body = {
                    "messages": USER,
                    "max_tokens": 5,
                    "stream": stream,
                    "response_format": _response_format(schema),
                }
                reply = await http.post("/v1/chat/completions", json=body)
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["code"] == "grammar_too_complex"
                assert error["param"] == "response_format"
                assert reason in error["message"]


async def test_a_stop_string_with_a_constraint_is_a_400_not_a_cut_value(
    json_tools_model_path: Path,
) -> None:
    tool = {"name": WEATHER["function"]["name"], "input_schema": PARAMETERS["get_weather"]}
    bodies = [
        ("/v1/chat/completions", {"response_format": _response_format(PERSON), "stop": ["}"]}),
        ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "stop": "}"}),
        (
            "/v1/chat/completions",
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "stop": ["}"],
            },
        ),
        ("/v1/completions", {"response_format": _response_format(PERSON), "stop": ["}"]}),
        (
            "/v1/messages",
            {"tools": [tool], "tool_choice": {"type": "any"}, "stop_sequences": ["}"]},
        ),
    ]
    async with (
        live_server(json_tools_model_path) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        model = live.engine.model_id
        for path, extra in bodies:
            for stream in (False, True):
                base: dict[str, Any] = {"model": model, "max_tokens": 30, "stream": stream}
                base["prompt" if path == "/v1/completions" else "messages"] = (
                    "Describe a person." if path == "/v1/completions" else USER
                )
                reply = await http.post(path, json={**base, **extra})
                assert reply.status_code == 400, (path, extra, reply.text)
                error = reply.json()["error"]
                assert "stop sequences cannot be combined with" in error["message"]
                if path != "/v1/messages":
                    assert error["param"] == "stop"
        # Without the stop string the same value completes and validates.
        body = {"model": model, "messages": USER, "max_tokens": 200}
        body["response_format"] = _response_format(PERSON)
        whole = await http.post("/v1/chat/completions", json=body)
        choice = whole.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def _check_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


async def test_tool_choice_required_yields_valid_tool_calls(client: openai.AsyncOpenAI) -> None:
    # Sampled, the random model may chain parallel calls until max_tokens ends
    # one mid-object (finish "length", as it should); one call always fits.
    for temperature, parallel in ((0.0, True), (1.0, False)):
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=150,
            temperature=temperature,
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=150,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    chunks = [chunk async for chunk in stream]
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert len(streamed) == 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    _check_calls(streamed, {"get_weather", "get_time"})


async def test_named_tool_choice_calls_that_function_and_none_calls_nothing(
    client: openai.AsyncOpenAI,
) -> None:
    for name in ("get_time", "get_weather"):
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=150,
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": name}},
        )
        _check_calls(reply.choices[0].message.tool_calls, {name})
    none = await client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=20,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="none",
    )
    assert none.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        await client.chat.completions.create(model=MODEL, messages=USER, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            response_format={"type": "json_object"},
        )


def test_response_format_shapes_become_one_engine_parameter() -> None:
    parse = _structured.parse_response_format
    assert parse({}) == {}
    assert parse({"response_format": {"type": "text"}}) == {}
    assert parse({"response_format": {"type": "json_object"}}) == {
        "json_schema": {"type": "object"}
    }
    assert parse({"response_format": _response_format(PERSON)}) == {"json_schema": PERSON}
    with pytest.raises(InvalidRequest, match="name"):
        parse({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}})
    with pytest.raises(InvalidRequest, match="strict"):
        parse(
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"},
                }
            }
        )
    with pytest.raises(InvalidGrammar):
        parse(
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": 3}}}
        )


def test_tool_choice_shapes() -> None:
    parse = _structured.parse_tool_choice
    assert parse({}) == _structured.ToolChoice("auto")
    assert parse({"tool_choice": "required", "parallel_tool_calls": False}) == (
        _structured.ToolChoice("required", parallel=False)
    )
    named = parse({"tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert (named.mode, named.name, named.enforced) == ("function", "f", True)
    for bad in ("always", {"type": "function"}, 3):
        with pytest.raises(InvalidRequest, match="tool_choice must be"):
            parse({"tool_choice": bad})
    with pytest.raises(InvalidRequest, match="parallel_tool_calls"):
        parse({"parallel_tool_calls": "yes"})


async def test_schema_starts_after_a_reasoning_block_the_prompt_opens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from scripted_model import make_scripted_model
    from trio_mlx.testing import CHAT_TEMPLATE

    # A scripted model that reasons and closes the block; its chat template opens the
    # block (as Qwen3's does with thinking on). Without the reasoning in front of the
    # schema, the JSON would be forced at once and land in reasoning_content.
    path = make_scripted_model(
        tmp_path_factory.mktemp("models") / "reasoner",
        ["Plan: weather.", "</think>", '{"city":"Paris"}'],
        extra_tokens=("<think>",),
    )
    template = CHAT_TEMPLATE.replace("assistant\\n' }}", "assistant\\n<think>\\n' }}")
    assert template != CHAT_TEMPLATE
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    }
    async with (
        live_server(path, chat_template=template) as live,
        openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="-", max_retries=0) as client,
    ):
        reply = await client.chat.completions.create(
            model="reasoner",
            messages=USER,
            max_tokens=30,
            response_format=_response_format(schema),
        )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert (message.model_extra or {}).get("reasoning_content") == "Plan: weather."
    assert message.content is not None
    # The value follows the block (the script's own one-token answer is an added token,
    # which llguidance does not let into JSON text, so the city's letters differ).
    jsonschema.validate(json.loads(message.content), schema)


async def test_required_tool_call_with_one_token_markers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from scripted_model import call_text, make_scripted_model

    # As in Qwen's vocabulary, <tool_call> and </tool_call> are tokens of their own here
    # (the grammar names them by id). The script says something else first; the grammar
    # makes the answer a call at once (its small vocabulary spells JSON a character a token).
    path = make_scripted_model(
        tmp_path_factory.mktemp("models") / "caller",
        ["Let me see.", *call_text("json_tools", "get_weather", "Paris")],
        tokenizer_config={"tool_parser_type": "json_tools"},
    )
    async with (
        live_server(path) as live,
        openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="-", max_retries=0) as client,
    ):
        tokenizer = live.engine.tokenizer
        assert len(tokenizer.encode(tokenizer.tool_call_start, add_special_tokens=False)) == 1
        free = await client.chat.completions.create(
            model="caller",
            messages=USER,
            max_tokens=40,
            tools=[WEATHER],  # type: ignore[list-item]
        )
        forced = await client.chat.completions.create(
            model="caller",
            messages=USER,
            max_tokens=150,
            tools=[WEATHER],  # type: ignore[list-item],
            tool_choice="required",
            parallel_tool_calls=False,
        )
    assert free.choices[0].message.content.startswith("Let me see.")  # type: ignore[union-attr]
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])  # type: ignore[union-attr]
