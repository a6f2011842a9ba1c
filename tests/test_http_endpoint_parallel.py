"""Parallel tool calls on both APIs, and the switch that allows only one.

The scripted model answers any prompt with two ``json_tools`` calls in a row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from http_helpers import live_server
from scripted_model import call_text, make_scripted_model

pytestmark = pytest.mark.model

SCRIPT = [
    *call_text("json_tools", "get_weather", "Paris"),
    *call_text("json_tools", "get_time", "Oslo"),
]
NAMES = ["get_weather", "get_time"]


@pytest.fixture(scope="module")
def two_calls_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_model(
        tmp_path_factory.mktemp("models") / "two-calls",
        SCRIPT,
        tokenizer_config={"tool_parser_type": "json_tools"},
    )


async def test_parallel_calls_and_parallel_tool_calls_false(two_calls_model: Path) -> None:
    tools: list[Any] = [
        {"type": "function", "name": name, "parameters": {"type": "object"}} for name in NAMES
    ]
    async with (
        live_server(two_calls_model) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client,
    ):
        both = await client.responses.create(model="two-calls", input="?", tools=tools)
        one = await client.responses.create(
            model="two-calls", input="?", tools=tools, parallel_tool_calls=False
        )
    assert [(i.type, getattr(i, "name", None)) for i in both.output] == [
        ("function_call", name) for name in NAMES
    ]
    assert both.parallel_tool_calls is True
    assert [getattr(i, "name", None) for i in one.output] == ["get_weather"]
    assert one.parallel_tool_calls is False
    assert json.loads(one.output[0].arguments) == {"city": "Paris"}  # type: ignore[union-attr]


async def test_parallel_tool_use_and_disable_parallel_tool_use(two_calls_model: Path) -> None:
    tools: list[Any] = [{"name": name, "input_schema": {"type": "object"}} for name in NAMES]
    messages: list[Any] = [{"role": "user", "content": "?"}]
    async with (
        live_server(two_calls_model) as server,
        anthropic.AsyncAnthropic(base_url=server.url, api_key="-", max_retries=0) as client,
    ):
        both = await client.messages.create(
            model="two-calls", max_tokens=60, messages=messages, tools=tools
        )
        one = await client.messages.create(
            model="two-calls",
            max_tokens=60,
            messages=messages,
            tools=tools,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        )
    assert [(b.type, getattr(b, "name", None)) for b in both.content] == [
        ("tool_use", name) for name in NAMES
    ]
    assert [getattr(b, "name", None) for b in one.content] == ["get_weather"]
    assert (both.stop_reason, one.stop_reason) == ("tool_use", "tool_use")
