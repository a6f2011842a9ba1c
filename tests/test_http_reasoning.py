"""Reasoning split out of the content, and fill-in-the-middle (``suffix``), on a scripted model.

The model (``scripted_model.py``) answers any prompt with
``<think>Plan: weather.</think>Answer:<tool_call>{...}</tool_call>``; its
vocabulary holds ``<think>``/``</think>`` (so mlx-lm's tokenizer reports them
as ``think_start``/``think_end``) and Qwen's FIM markers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from http_helpers import LiveServer, live_server
from scripted_model import WEATHER_TOOLS, call_text, make_scripted_model
from trio_mlx.testing import CHAT_TEMPLATE
from trio_mlx_http._settings import Settings

pytestmark = pytest.mark.model

REASONING = "Plan: weather."
CALL = call_text("json_tools", "get_weather", "Paris")
SCRIPT = ["<think>", REASONING, "</think>", "Answer:", *CALL]
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
USER: Any = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_model(
        tmp_path_factory.mktemp("models") / "thinker",
        SCRIPT,
        tokenizer_config={"tool_parser_type": "json_tools"},
        extra_tokens=FIM,
    )


@pytest.fixture
async def server(thinking_model: Path) -> AsyncIterator[LiveServer]:
    async with live_server(thinking_model) as live:
        yield live


def _client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


def _extra(message: Any, name: str) -> Any:
    return (message.model_extra or {}).get(name)


async def test_reasoning_is_split_out_of_the_content(server: LiveServer) -> None:
    assert server.engine.tokenizer.think_start == "<think>"
    async with _client(server) as client:
        reply = await client.chat.completions.create(model="thinker", messages=USER)
    message = reply.choices[0].message
    assert _extra(message, "reasoning_content") == REASONING
    assert _extra(message, "reasoning") == REASONING
    # No tools: the call is plain text after the reasoning.
    assert message.content == "Answer:" + "".join(CALL)


async def test_tool_calls_after_the_reasoning_are_parsed(server: LiveServer) -> None:
    async with _client(server) as client:
        reply = await client.chat.completions.create(
            model="thinker", messages=USER, tools=WEATHER_TOOLS
        )
        stream = await client.chat.completions.create(
            model="thinker", messages=USER, tools=WEATHER_TOOLS, stream=True
        )
        reasoning, content, calls, reasons = "", "", [], []
        async for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                assert "<think>" not in (delta.content or "")
                reasoning += _extra(delta, "reasoning_content") or ""
                content += delta.content or ""
                calls += delta.tool_calls or []
                reasons += [choice.finish_reason] if choice.finish_reason else []
    message = reply.choices[0].message
    assert _extra(message, "reasoning_content") == REASONING
    assert message.content == "Answer:"
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
    ] == [("get_weather", {"city": "Paris"})]
    assert reply.choices[0].finish_reason == "tool_calls"
    assert (reasoning, content, reasons) == (REASONING, "Answer:", ["tool_calls"])
    assert [c.function.name for c in calls if c.function] == ["get_weather"]


async def test_max_tokens_counts_reasoning_tokens(server: LiveServer) -> None:
    async with _client(server) as client:
        reply = await client.chat.completions.create(model="thinker", messages=USER, max_tokens=2)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 2
    assert (_extra(message, "reasoning_content"), message.content) == (REASONING, "")


async def test_a_prompt_that_opens_the_reasoning_starts_inside_it(thinking_model: Path) -> None:
    # Templates such as DeepSeek-R1's end the prompt with <think>: the model writes no opener.
    opening = CHAT_TEMPLATE.replace("assistant\\n' }}", "assistant\\n<think>' }}")
    assert opening != CHAT_TEMPLATE
    async with live_server(thinking_model, chat_template=opening) as server, _client(server) as c:
        reply = await c.chat.completions.create(model="thinker", messages=USER)
    message = reply.choices[0].message
    assert _extra(message, "reasoning_content") == REASONING
    assert message.content == "Answer:" + "".join(CALL)


async def test_reasoning_markers_off_keeps_reasoning_in_the_content(thinking_model: Path) -> None:
    settings = Settings(reasoning_markers=False)
    async with live_server(thinking_model, settings) as server, _client(server) as client:
        reply = await client.chat.completions.create(model="thinker", messages=USER)
    message = reply.choices[0].message
    assert message.content == "".join(SCRIPT)
    assert _extra(message, "reasoning_content") is None


async def test_suffix_fills_in_the_middle_with_the_models_markers(server: LiveServer) -> None:
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    fim_prompt = f"{FIM[0]}{prefix}{FIM[1]}{suffix}{FIM[2]}"
    async with _client(server) as client:
        filled = await client.completions.create(model="thinker", prompt=prefix, suffix=suffix)
        direct = await client.completions.create(model="thinker", prompt=fim_prompt)
        plain = await client.completions.create(model="thinker", prompt=prefix)
    assert filled.usage is not None
    assert direct.usage is not None
    assert plain.usage is not None
    assert filled.usage.prompt_tokens == len(server.engine.encode(fim_prompt))
    assert filled.usage.prompt_tokens == direct.usage.prompt_tokens > plain.usage.prompt_tokens
    assert filled.choices[0].text == direct.choices[0].text
