"""A thinking model's reasoning on ``/v1/responses`` (reasoning items) and ``/v1/messages`` (thinking blocks).

The scripted model (``scripted_model.py``) answers any prompt with
``<think>Plan: weather.</think>Answer:<tool_call>{...}</tool_call>``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from http_helpers import LiveServer, live_server
from scripted_model import call_text, make_scripted_model
from trio_mlx.testing import CHAT_TEMPLATE

pytestmark = pytest.mark.model

REASONING = "Plan: weather."
SCRIPT = [
    "<think>",
    REASONING,
    "</think>",
    "Answer:",
    *call_text("json_tools", "get_weather", "Paris"),
]
RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
]
ANTHROPIC_TOOLS: list[Any] = [{"name": "get_weather", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_model(
        tmp_path_factory.mktemp("models") / "thinker",
        SCRIPT,
        tokenizer_config={"tool_parser_type": "json_tools"},
    )


@pytest.fixture
async def server(thinking_model: Path) -> AsyncIterator[LiveServer]:
    async with live_server(thinking_model) as live:
        yield live


async def test_responses_put_the_reasoning_in_a_reasoning_item(server: LiveServer) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="-", max_retries=0
    ) as client:
        whole = await client.responses.create(
            model="thinker", input="Weather?", tools=RESPONSES_TOOLS
        )
        async with client.responses.stream(
            model="thinker", input="Weather?", tools=RESPONSES_TOOLS
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        replayed = await client.responses.create(
            model="thinker",
            input=[{"role": "user", "content": "Weather?"}, whole.output[0].model_dump()],  # type: ignore[list-item]
            max_output_tokens=1,
        )
    for reply in (whole, final):
        assert [item.type for item in reply.output] == ["reasoning", "message", "function_call"]
        reasoning = reply.output[0]
        assert reasoning.type == "reasoning"
        assert [c.text for c in reasoning.content or []] == [REASONING]
        assert reply.output_text == "Answer:"
        call = reply.output[2]
        assert call.type == "function_call"
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert reply.usage is not None
        assert 0 < reply.usage.output_tokens_details.reasoning_tokens < reply.usage.output_tokens
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.reasoning_text.delta" in kinds[3:first_text]
    assert kinds[first_text - 4 : first_text - 2] == [
        "response.reasoning_text.done",
        "response.output_item.done",
    ]
    # A replayed reasoning item is accepted and left out of the prompt.
    assert replayed.usage is not None
    assert replayed.usage.input_tokens == len(
        server.engine.encode([{"role": "user", "content": "Weather?"}])
    )


async def test_messages_put_the_reasoning_in_a_thinking_block(server: LiveServer) -> None:
    question: Any = {"role": "user", "content": "Weather?"}
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="-", max_retries=0) as client:
        whole = await client.messages.create(
            model="thinker", max_tokens=30, messages=[question], tools=ANTHROPIC_TOOLS
        )
        async with client.messages.stream(
            model="thinker", max_tokens=30, messages=[question], tools=ANTHROPIC_TOOLS
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        thinking_block = whole.content[0].model_dump()
        with_thinking = await client.messages.count_tokens(
            model="thinker",
            messages=[
                question,
                {"role": "assistant", "content": [thinking_block, {"type": "text", "text": "Hi"}]},
                {"role": "user", "content": "And?"},
            ],
        )
        without = await client.messages.count_tokens(
            model="thinker",
            messages=[
                question,
                {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "user", "content": "And?"},
            ],
        )
    for reply in (whole, final):
        assert [block.type for block in reply.content] == ["thinking", "text", "tool_use"]
        thinking = reply.content[0]
        assert thinking.type == "thinking"
        assert thinking.thinking == REASONING
        assert reply.content[1].type == "text"
        assert reply.content[1].text == "Answer:"
        assert reply.stop_reason == "tool_use"
    assert "thinking" in kinds
    # Earlier turns' thinking is accepted and left out of the context, as Anthropic does.
    assert with_thinking.input_tokens == without.input_tokens


async def test_each_api_s_thinking_switch_reaches_the_chat_template(tmp_path: Path) -> None:
    # The vocabulary holds <think>, so mlx-lm turns thinking on unless told otherwise.
    template = CHAT_TEMPLATE + "{% if enable_thinking %}<think>{% endif %}"
    model = make_scripted_model(
        tmp_path / "switch",
        ["Hi"],
        tokenizer_config={"chat_template": template},
        extra_tokens=["<think>", "</think>"],
    )
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    async with (
        live_server(model) as server,
        anthropic.AsyncAnthropic(base_url=server.url, api_key="-", max_retries=0) as client,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as oai,
    ):
        counts = {
            kind: (
                await client.messages.count_tokens(
                    model="switch", messages=messages, thinking=thinking
                )
            ).input_tokens
            for kind, thinking in (
                ("plain", anthropic.NOT_GIVEN),
                ("disabled", {"type": "disabled"}),
                ("adaptive", {"type": "adaptive"}),
                ("enabled", {"type": "enabled", "budget_tokens": 1024}),
            )
        }
        budgeted = await client.messages.create(
            model="switch",
            max_tokens=2048,
            messages=messages,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            await client.messages.create(
                model="switch",
                max_tokens=100,
                messages=messages,
                thinking={"type": "enabled", "budget_tokens": 100},
            )
        efforts = {}
        for effort in ("none", "minimal", "low", "high"):
            reply = await oai.responses.create(
                model="switch", input="Hi", max_output_tokens=1, reasoning={"effort": effort}
            )
            chat = await oai.chat.completions.create(
                model="switch", messages=messages, max_tokens=1, reasoning_effort=effort
            )
            assert reply.usage is not None
            assert chat.usage is not None
            assert reply.usage.input_tokens == chat.usage.prompt_tokens
            efforts[effort] = chat.usage.prompt_tokens
    off = len(server.engine.encode(messages, chat_template_kwargs={"enable_thinking": False}))
    on = off + 1  # the template's <think>
    assert counts == {"plain": on, "disabled": off, "adaptive": on, "enabled": on}
    assert efforts == {"none": off, "minimal": off, "low": on, "high": on}
    assert budgeted.stop_reason in ("end_turn", "max_tokens")
