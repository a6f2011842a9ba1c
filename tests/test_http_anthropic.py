"""``POST /v1/messages`` with the official ``anthropic`` client against a live server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from http_helpers import LiveServer, live_server
from tool_model import CALL_ARGUMENTS, CALL_NAME, CALL_TEXT
from trio_mlx_http._settings import Settings

pytestmark = pytest.mark.model

TOOLS: list[Any] = [
    {
        "name": CALL_NAME,
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": CALL_NAME,
            "description": "The weather in a city.",
            "parameters": TOOLS[0]["input_schema"],
        },
    }
]


@pytest.fixture
async def server(tiny_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tiny_model_path) as live:
        yield live


@pytest.fixture
async def tool_server(tool_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tool_model_path) as live:
        yield live


def _prompt_tokens(usage: Any) -> int:
    """The whole prompt: Anthropic counts cache reads and writes apart from input_tokens."""
    return int(
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )


def _client(server: LiveServer, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=key, max_retries=0)


def _text(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def test_text_message_matches_chat_completion_and_counts_usage(server: LiveServer) -> None:
    model = server.engine.model_id
    async with _client(server) as client:
        reply = await client.messages.create(
            model=model,
            max_tokens=8,
            system="Be brief.",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Say something."}]}],
            extra_body={"temperature": 0.0, "top_p": 1.0, "top_k": 0},
        )
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0
    ) as chat_client:
        chat = await chat_client.chat.completions.create(
            model=model,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say something."},
            ],
            max_tokens=8,
        )
    assert reply.type == "message"
    assert reply.role == "assistant"
    assert reply.id.startswith("msg_")
    assert _text(reply) == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert reply.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    assert reply.stop_sequence is None
    assert chat.usage is not None
    assert _prompt_tokens(reply.usage) == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens


async def test_stop_sequence_ends_the_message_and_is_named(server: LiveServer) -> None:
    model = server.engine.model_id
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    async with _client(server) as client:
        free = _text(await client.messages.create(model=model, max_tokens=40, messages=messages))
        # A stop sequence the free answer holds: two ASCII letters after the first few characters.
        at = next(
            i
            for i in range(3, len(free) - 1)
            if free[i : i + 2].isascii() and free[i : i + 2].isalpha()
        )
        stop = free[at : at + 2]
        reply = await client.messages.create(
            model=model, max_tokens=40, messages=messages, stop_sequences=[stop, "\x00never"]
        )
    assert reply.stop_reason == "stop_sequence"
    assert reply.stop_sequence == stop
    assert _text(reply) == free[: free.find(stop)]


async def test_eos_is_end_turn(tool_server: LiveServer) -> None:
    # Without tools, the tool model's call is plain text, then EOS.
    async with _client(tool_server) as client:
        reply = await client.messages.create(
            model=tool_server.engine.model_id,
            max_tokens=10,
            messages=[{"role": "user", "content": "Hi"}],
            stop_sequences=["zzz"],
        )
    assert reply.stop_reason == "end_turn"
    assert reply.stop_sequence is None
    assert _text(reply) == CALL_TEXT


async def test_tool_use_block_and_tool_result_round_trip(tool_server: LiveServer) -> None:
    engine = tool_server.engine
    question: Any = {"role": "user", "content": "Weather in Paris?"}
    async with _client(tool_server) as client:
        first = await client.messages.create(
            model=engine.model_id, max_tokens=10, messages=[question], tools=TOOLS
        )
        assert first.stop_reason == "tool_use"
        [call] = first.content
        assert call.type == "tool_use"
        assert (call.name, call.input) == (CALL_NAME, CALL_ARGUMENTS)
        second = await client.messages.create(
            model=engine.model_id,
            max_tokens=10,
            tools=TOOLS,
            messages=[
                question,
                {"role": "assistant", "content": [call.model_dump()]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
        )
    expected = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": CALL_NAME, "arguments": CALL_ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        {"role": "user", "content": "Thanks."},
    ]
    assert _prompt_tokens(second.usage) == len(engine.encode(expected, tools=CHAT_TOOLS))


async def test_text_stream_sends_anthropics_event_sequence(server: LiveServer) -> None:
    model = server.engine.model_id
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    async with _client(server) as client:
        whole = await client.messages.create(model=model, max_tokens=6, messages=messages)
        stream = await client.messages.create(
            model=model, max_tokens=6, messages=messages, stream=True
        )
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(d.delta.text for d in deltas) == _text(whole)  # type: ignore[union-attr]
    start, end = events[0], events[-2]
    # message_start counts the whole prompt: the cache's part is known at the end.
    assert start.message.usage.input_tokens == _prompt_tokens(whole.usage)  # type: ignore[union-attr]
    assert _prompt_tokens(end.usage) == _prompt_tokens(whole.usage)  # type: ignore[union-attr]
    assert end.delta.stop_reason == whole.stop_reason  # type: ignore[union-attr]
    assert end.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


async def test_streamed_tool_use_with_input_json_delta(tool_server: LiveServer) -> None:
    async with (
        _client(tool_server) as client,
        client.messages.stream(
            model=tool_server.engine.model_id,
            max_tokens=10,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=TOOLS,
        ) as stream,
    ):
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert "input_json" in kinds
    assert final.stop_reason == "tool_use"
    [call] = final.content
    assert call.type == "tool_use"
    assert call.input == CALL_ARGUMENTS


#: (body, a fragment of the error message): requests every one of which is a 400.
BAD: list[tuple[dict[str, Any], str]] = [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens is required"),
    ({"max_tokens": 2, "messages": []}, "messages"),
    (
        {"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        "messages[0].content[0]",
    ),
    ({"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}, "role"),
    (
        {"max_tokens": 2, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
        "temperature",
    ),
    (
        {
            "max_tokens": 2,
            "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "x"}],
        },
        "tool_choice",
    ),
    (
        {
            "max_tokens": 2,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "x"}],
        },
        "thinking",
    ),
    (
        {
            "max_tokens": 2,
            "tools": [{"type": "web_search_20250305", "name": "s"}],
            "messages": [{"role": "user", "content": "x"}],
        },
        "tools[0]",
    ),
    (
        {
            "max_tokens": 2,
            "stop_sequences": [3],
            "messages": [{"role": "user", "content": "x"}],
        },
        "stop_sequences",
    ),
]


USER = [{"role": "user", "content": "x"}]
# OpenAI's fields, a typo, and answer-changing fields this server lacks: each a 400 naming it.
BAD += [
    ({"max_tokens": 2, "messages": USER, name: value}, name)
    for name, value in (
        ("stop", ["."]),
        ("seed", 1),
        ("n", 2),
        ("logit_bias", {"5": 1}),
        ("presence_penalty", 1.0),
        ("frequency_penalty", 1.0),
        ("response_format", {"type": "json_object"}),
        ("max_completion_tokens", 5),
        ("temprature", 0.5),
        ("context_management", {"edits": []}),
    )
]
BAD += [
    ({"max_tokens": 2, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"max_tokens": 2, "messages": USER, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"max_tokens": 2, "messages": USER, "output_config": {"format": {}}}, "output_config"),
    ({"max_tokens": 2, "messages": USER, "output_config": {"effort": "huge"}}, "effort"),
]


async def test_bad_requests_are_anthropic_shaped_400s(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        for body, needle in BAD:
            reply = await http.post("/v1/messages", json=body)
            assert reply.status_code == 400, (body, reply.text)
            payload = reply.json()
            assert payload["type"] == "error", payload
            assert payload["error"]["type"] == "invalid_request_error", payload
            assert needle in payload["error"]["message"], payload


async def test_agent_fields_are_accepted_and_top_k_honoured(server: LiveServer) -> None:
    user: Any = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    system: Any = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    async with _client(server) as client:
        plain = await client.messages.create(
            model=server.engine.model_id, max_tokens=6, messages=user, system=system
        )
        marked = await client.messages.create(
            model=server.engine.model_id,
            max_tokens=6,
            messages=user,
            system=system,
            metadata={"user_id": "user_1"},
            service_tier="auto",
            thinking={"type": "adaptive"},
            output_config={"effort": "high"},
            extra_headers={
                "anthropic-beta": "claude-code-20250219",
                "anthropic-version": "2023-06-01",
            },
        )
        sampled = [
            await client.messages.create(
                model=server.engine.model_id,
                max_tokens=6,
                messages=user,
                system=system,
                extra_body={"temperature": 1.0, "top_k": 1},
            )
            for _ in range(2)
        ]
    # No thinking switch in this model's template: the answer is the same.
    assert _text(marked) == _text(plain)
    # top_k 1 is greedy, whatever the temperature.
    assert _text(sampled[0]) == _text(sampled[1]) == _text(plain)


async def test_client_raises_on_an_unknown_model_with_anthropics_error(server: LiveServer) -> None:
    async with _client(server) as client:
        with pytest.raises(anthropic.NotFoundError) as caught:
            await client.messages.create(
                model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
            )
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": caught.value.body["error"]["message"]},  # type: ignore[index]
    }


async def test_api_key_is_accepted_as_x_api_key_or_bearer(tiny_model_path: Path) -> None:
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    async with live_server(tiny_model_path, Settings(api_key="sekrit")) as server:
        async with _client(server, key="sekrit") as client:
            reply = await client.messages.create(model=server.engine.model_id, **body)  # type: ignore[arg-type]
            assert reply.usage.output_tokens >= 1
        async with _client(server, key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                await client.messages.create(model=server.engine.model_id, **body)  # type: ignore[arg-type]
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        async with httpx.AsyncClient(base_url=server.url) as http:
            bearer = await http.post(
                "/v1/messages", json=body, headers={"Authorization": "Bearer sekrit"}
            )
            openai_shape = await http.post("/v1/chat/completions", json={})
        assert bearer.status_code == 200
        assert openai_shape.status_code == 401
        assert openai_shape.json()["error"]["code"] == "invalid_api_key"


async def test_count_tokens_counts_the_prompt_a_message_would_use(tool_server: LiveServer) -> None:
    engine = tool_server.engine
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    async with _client(tool_server) as client:
        counted = await client.messages.count_tokens(
            model=engine.model_id, system="Be brief.", messages=messages, tools=TOOLS
        )
        reply = await client.messages.create(
            model=engine.model_id,
            max_tokens=4,
            system="Be brief.",
            messages=messages,
            tools=TOOLS,
        )
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.count_tokens(model=engine.model_id, messages=[])
    assert counted.input_tokens == _prompt_tokens(reply.usage)
    expected = [{"role": "system", "content": "Be brief."}, *messages]
    assert counted.input_tokens == len(engine.encode(expected, tools=CHAT_TOOLS))


async def test_text_then_tool_use_are_two_blocks(text_call_model_path: Path) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather?"}]
    async with live_server(text_call_model_path) as server, _client(server) as client:
        model = server.engine.model_id
        whole = await client.messages.create(
            model=model, max_tokens=10, messages=messages, tools=TOOLS
        )
        stream = await client.messages.create(
            model=model, max_tokens=10, messages=messages, tools=TOOLS, stream=True
        )
        events = [event async for event in stream]
    assert [block.type for block in whole.content] == ["text", "tool_use"]
    assert whole.stop_reason == "tool_use"
    assert _text(whole) == "a"
    assert [(e.type, getattr(e, "index", None)) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[-2].delta.stop_reason == "tool_use"  # type: ignore[union-attr]


async def test_a_final_assistant_message_is_continued(server: LiveServer) -> None:
    engine = server.engine
    messages: list[Any] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Lists are"},
    ]
    async with _client(server) as client:
        reply = await client.messages.create(model=engine.model_id, max_tokens=4, messages=messages)
        counted = await client.messages.count_tokens(model=engine.model_id, messages=messages)
    # The prompt stops inside the assistant's turn (ChatML: no <|im_end|> after the prefill).
    open_turn = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nLists are"
    expected = len(engine.tokenizer.encode(open_turn, add_special_tokens=False))
    assert _prompt_tokens(reply.usage) == counted.input_tokens == expected
    closed = len(engine.encode(messages))
    assert expected < closed
