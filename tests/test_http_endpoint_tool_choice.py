"""A forced tool choice on ``/v1/responses`` and ``/v1/messages``: the answer is a valid call.

The model is the tiny one as it is (its own output is free text), its tokenizer
naming mlx-lm's ``json_tools`` parser: only the enforced grammar makes it call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from http_helpers import LiveServer, live_server

pytestmark = pytest.mark.model

MODEL = "tiny-tools"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}


@pytest.fixture
async def server(json_tools_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(json_tools_model_path, grammar_timeout=60) as live:
        yield live


def _check(name: str, arguments: Any, allowed: set[str]) -> None:
    assert name in allowed, name
    jsonschema.validate(arguments, SCHEMAS[name])


async def test_responses_required_and_named_tool_choice_yield_valid_calls(
    server: LiveServer,
) -> None:
    tools: Any = [
        {"type": "function", "name": name, "parameters": schema} for name, schema in SCHEMAS.items()
    ]
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0
    ) as client:
        free = await client.responses.create(
            model=MODEL, input="Weather?", max_output_tokens=30, tools=tools
        )
        required = await client.responses.create(
            model=MODEL,
            input="Weather?",
            max_output_tokens=120,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        named = await client.responses.create(
            model=MODEL,
            input="Weather?",
            max_output_tokens=120,
            temperature=1.0,
            tools=tools,
            tool_choice={"type": "function", "name": "get_time"},
        )
    # Unforced, the tiny model writes text; forced, it calls.
    assert [item.type for item in free.output] == ["message"], free.output
    calls = [item for item in required.output if item.type == "function_call"]
    assert len(calls) == 1, required.output
    _check(calls[0].name, json.loads(calls[0].arguments), set(SCHEMAS))
    named_calls = [item for item in named.output if item.type == "function_call"]
    assert named_calls, named.output
    for call in named_calls:
        _check(call.name, json.loads(call.arguments), {"get_time"})
    assert required.tool_choice == "required"


async def test_messages_any_and_named_tool_choice_yield_valid_tool_use(server: LiveServer) -> None:
    tools: Any = [
        {"name": name, "description": name, "input_schema": schema}
        for name, schema in SCHEMAS.items()
    ]
    messages: Any = [{"role": "user", "content": "Weather?"}]
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0
    ) as client:
        forced = await client.messages.create(
            model=MODEL,
            max_tokens=120,
            messages=messages,
            tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )
        async with client.messages.stream(
            model=MODEL,
            max_tokens=120,
            messages=messages,
            tools=tools,
            tool_choice={"type": "tool", "name": "get_weather"},
        ) as stream:
            named = await stream.get_final_message()
    uses = [block for block in forced.content if block.type == "tool_use"]
    assert (len(uses), forced.stop_reason) == (1, "tool_use"), forced.content
    _check(uses[0].name, uses[0].input, set(SCHEMAS))
    named_uses = [block for block in named.content if block.type == "tool_use"]
    assert (bool(named_uses), named.stop_reason) == (True, "tool_use"), named.content
    for block in named_uses:
        _check(block.name, block.input, {"get_weather"})
