"""``POST /v1/responses`` with the official ``openai`` client against a live server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from http_helpers import LiveServer, live_server
from tool_model import CALL_ARGUMENTS, CALL_NAME, CALL_TEXT
from trio_mlx_http._responses.store import ResponseStore, StoredResponse

pytestmark = pytest.mark.model

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": CALL_NAME,
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
#: The same tool as the chat template sees it.
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


@pytest.fixture
async def server(tiny_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tiny_model_path) as live:
        yield live


@pytest.fixture
async def tool_server(tool_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tool_model_path) as live:
        yield live


def _client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


async def test_text_response_matches_chat_completion_and_counts_usage(server: LiveServer) -> None:
    model = server.engine.model_id
    async with _client(server) as client:
        reply = await client.responses.create(
            model=model, instructions="Be brief.", input="Say something.", max_output_tokens=8
        )
        chat = await client.chat.completions.create(
            model=model,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say something."},
            ],
            max_tokens=8,
        )
    assert reply.object == "response"
    assert reply.id.startswith("resp_")
    assert reply.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert reply.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert reply.incomplete_details is not None
        assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None
    assert chat.usage is not None
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert (reply.instructions, reply.max_output_tokens, reply.model) == ("Be brief.", 8, model)


async def test_stream_sends_the_typed_event_sequence(server: LiveServer) -> None:
    model = server.engine.model_id
    async with _client(server) as client:
        whole = await client.responses.create(model=model, input="Hello", max_output_tokens=6)
        stream = await client.responses.create(
            model=model, input="Hello", max_output_tokens=6, stream=True
        )
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text
    assert final.usage is not None
    assert whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_stream_helper_gets_the_completed_response(tool_server: LiveServer) -> None:
    # Without tools, the tool model's call is plain text, then EOS: a completed response.
    async with (
        _client(tool_server) as client,
        client.responses.stream(model=tool_server.engine.model_id, input="Hi") as stream,
    ):
        texts = [
            event.delta async for event in stream if event.type == "response.output_text.delta"
        ]
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert "".join(texts) == final.output_text == CALL_TEXT


async def test_function_call_item_and_its_output_round_trip(tool_server: LiveServer) -> None:
    engine = tool_server.engine
    async with _client(tool_server) as client:
        first = await client.responses.create(
            model=engine.model_id, input="Weather in Paris?", tools=TOOLS
        )
        assert first.status == "completed"
        [call] = first.output
        assert call.type == "function_call"
        assert call.name == CALL_NAME
        assert json.loads(call.arguments) == CALL_ARGUMENTS
        assert first.tools[0].name == CALL_NAME  # type: ignore[union-attr]
        second = await client.responses.create(
            model=engine.model_id,
            tools=TOOLS,
            input=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            ],
        )
        # The agent pattern: only the tool's output, on top of the stored first response.
        chained = await client.responses.create(
            model=engine.model_id,
            tools=TOOLS,
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
    expected = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": CALL_NAME, "arguments": CALL_ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == len(engine.encode(expected, tools=CHAT_TOOLS))
    assert chained.usage is not None
    assert chained.usage.input_tokens == second.usage.input_tokens


async def test_streamed_function_call_events(tool_server: LiveServer) -> None:
    async with (
        _client(tool_server) as client,
        client.responses.stream(
            model=tool_server.engine.model_id, input="Weather?", tools=TOOLS
        ) as stream,
    ):
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    assert call.type == "function_call"
    assert json.loads(call.arguments) == CALL_ARGUMENTS


async def test_previous_response_id_continues_the_stored_conversation(server: LiveServer) -> None:
    engine = server.engine
    async with _client(server) as client:
        first = await client.responses.create(
            model=engine.model_id, instructions="Old rules.", input="Hi", max_output_tokens=4
        )
        second = await client.responses.create(
            model=engine.model_id,
            previous_response_id=first.id,
            input="More",
            max_output_tokens=4,
        )
        fetched = await client.responses.retrieve(second.id)
        forgotten = await client.responses.create(
            model=engine.model_id, input="Hi", max_output_tokens=2, store=False
        )
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(
                model=engine.model_id, previous_response_id=forgotten.id, input="More"
            )
    # Instructions do not carry over; the earlier turn and its output do.
    expected = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == len(engine.encode(expected))
    assert second.previous_response_id == first.id
    assert fetched.id == second.id
    assert fetched.output_text == second.output_text
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == (
        "previous_response_not_found",
        "previous_response_id",
    )


def test_store_forgets_the_least_recently_used_response() -> None:
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse(body={"id": name}, conversation=()))
    assert store.get("a") is not None  # now "b" is the least recently used
    store.put("c", StoredResponse(body={"id": "c"}, conversation=()))
    assert (store.get("a") is not None, store.get("b"), store.get("c") is not None) == (
        True,
        None,
        True,
    )
    assert len(store) == 2
    with pytest.raises(ValueError, match="capacity and max_bytes must be >= 1"):
        ResponseStore(capacity=0)


def test_store_keeps_within_its_byte_budget_counting_the_json_it_holds() -> None:
    def stored(text: str) -> StoredResponse:
        return StoredResponse(body={}, conversation=({"role": "user", "content": text},))

    one = ResponseStore()
    one.put("a", stored("x" * 100))
    size = one.bytes  # the JSON held, and a fixed overhead for the entry
    assert size >= len(json.dumps([{}, [{"role": "user", "content": "x" * 100}]]))
    store = ResponseStore(capacity=100, max_bytes=2 * size + 10)
    store.put("a", stored("x" * 100))
    store.put("b", stored("y" * 100))
    assert store.bytes == 2 * size
    store.put("c", stored("z" * 100))  # over budget: "a", the least recently used, goes
    assert (store.get("a"), store.get("b") is not None, store.get("c") is not None) == (
        None,
        True,
        True,
    )
    assert store.bytes == 2 * size
    store.put("huge", stored("h" * 1000))  # larger than the whole budget: not kept
    assert store.get("huge") is None
    assert store.get("b") is not None
    assert store.delete("b")
    assert not store.delete("b")
    store.put("c", stored("short"))  # replacing an entry recounts it
    assert store.bytes == size - 95
    # Each read is parsed anew: changing what it returned changes nothing kept.
    got = store.get("c")
    assert got is not None
    got.conversation[0]["content"] = "changed"
    again = store.get("c")
    assert again is not None
    assert again.conversation == ({"role": "user", "content": "short"},)
    assert store.body("c") == {}


POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["x", "tag"],
    "additionalProperties": False,
}


async def test_text_format_json_schema_output_validates_whole_and_streamed(
    server: LiveServer,
) -> None:
    text = {"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}}
    async with _client(server) as client:
        reply = await client.responses.create(
            model=server.engine.model_id, input="A point.", max_output_tokens=40, text=text
        )
        async with client.responses.stream(
            model=server.engine.model_id,
            input="A point.",
            max_output_tokens=40,
            temperature=1.0,
            text=text,  # type: ignore[arg-type]
        ) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        loose = await client.responses.create(
            model=server.engine.model_id,
            input="An object.",
            max_output_tokens=40,
            text={"format": {"type": "json_object"}},
        )
    assert reply.status == "completed", reply
    jsonschema.validate(json.loads(reply.output_text), POINT)
    assert final.status == "completed", final
    jsonschema.validate(json.loads("".join(deltas)), POINT)
    assert isinstance(json.loads(loose.output_text), dict), loose.output_text


async def test_text_format_with_a_schema_that_cannot_compile_is_a_400(server: LiveServer) -> None:
    bad = {"type": "json_schema", "name": "bad", "schema": {"type": "no-such-type"}}
    async with httpx.AsyncClient(base_url=server.url) as http:
        reply = await http.post(
            "/v1/responses", json={"input": "Hi", "max_output_tokens": 4, "text": {"format": bad}}
        )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_grammar", "text.format"), error


#: (field, value, the param the 400 names): known fields this server does not support.
UNSUPPORTED: list[tuple[str, Any, str]] = [
    ("background", True, "background"),
    ("reasoning", {"effort": "high", "mode": "x"}, "reasoning.mode"),
    ("include", ["message.output_text.logprobs"], "include"),
    ("top_logprobs", 3, "top_logprobs"),
    ("conversation", "conv_1", "conversation"),
    # Chat completions' fields and typos are unknown here: refused, never ignored.
    ("max_tokens", 5, "max_tokens"),
    ("stop", ["."], "stop"),
    ("seed", 1, "seed"),
    ("n", 2, "n"),
    ("logit_bias", {"5": 10}, "logit_bias"),
    ("top_k", 5, "top_k"),
    ("presence_penalty", 1.0, "presence_penalty"),
    ("frequency_penalty", 1.0, "frequency_penalty"),
    ("response_format", {"type": "json_object"}, "response_format"),
    ("temprature", 0.5, "temprature"),
]

#: (body, the param the 400 names): malformed or out-of-range input.
BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0]",
    ),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "Hi", "temperature": 2.5}, "temperature"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"input": "Hi", "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "Hi", "metadata": {"k": 3}}, "metadata"),
    ({"input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "Hi", "text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"input": "Hi", "truncation": "sometimes"}, "truncation"),
    ({"input": "Hi", "include": ["reasoning.everything"]}, "include"),
    ({"input": "Hi", "reasoning": {"summary": "long"}}, "reasoning.summary"),
]


async def test_unsupported_fields_are_refused_by_name(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        for field, value, param in UNSUPPORTED:
            body = {"input": "Hi", "max_output_tokens": 2, field: value}
            reply = await http.post("/v1/responses", json=body)
            assert reply.status_code == 400, (field, value, reply.text)
            error = reply.json()["error"]
            assert (error["code"], error["param"]) == ("unsupported_parameter", param), error


async def test_bad_input_is_a_400_naming_the_field(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        for body, param in BAD:
            reply = await http.post("/v1/responses", json=body)
            assert reply.status_code == 400, (body, reply.text)
            assert reply.json()["error"]["param"] == param, (body, reply.text)


async def test_harmless_fields_are_accepted_and_metadata_echoed(server: LiveServer) -> None:
    async with _client(server) as client:
        reply = await client.responses.create(
            model=server.engine.model_id,
            input="Hi",
            max_output_tokens=2,
            metadata={"run": "7"},
            user="someone",
            safety_identifier="abc",
            prompt_cache_key="k",
            text={"format": {"type": "text"}},
            tool_choice="auto",
            parallel_tool_calls=True,
            truncation="auto",
            store=False,
            service_tier="auto",
            include=["reasoning.encrypted_content"],
            reasoning={"effort": "high", "summary": "auto"},
        )
        plain = await client.responses.create(
            model=server.engine.model_id, input="Hi", max_output_tokens=2
        )
    assert reply.metadata == {"run": "7"}
    assert reply.truncation == "auto"
    assert reply.reasoning is not None
    assert (reply.reasoning.effort, reply.reasoning.summary) == ("high", "auto")
    # The bundled model has no reasoning switch: the effort changes nothing.
    assert reply.output_text == plain.output_text
    assert reply.usage is not None
    assert reply.usage.output_tokens >= 1


async def test_deleted_response_is_gone(server: LiveServer) -> None:
    async with _client(server) as client:
        reply = await client.responses.create(
            model=server.engine.model_id, input="Hi", max_output_tokens=2
        )
        await client.responses.delete(reply.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(reply.id)


async def test_text_then_call_closes_the_message_before_the_call(
    text_call_model_path: Path,
) -> None:
    async with live_server(text_call_model_path) as server, _client(server) as client:
        model = server.engine.model_id
        whole = await client.responses.create(model=model, input="Weather?", tools=TOOLS)
        async with client.responses.stream(model=model, input="Weather?", tools=TOOLS) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output_text == "a"
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == [0, 1]  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "a"
