"""The bundled model calls its one tool, ``lookup(topic)``, and answers from the result.

``tools.json`` (beside the weights) records the tool tuning's score: requests in
phrasings never trained on, with the call the model made to each. Through the real
server and the official client, the engine's greedy calls must score the same, and a
two-turn agent loop (call, result, answer) must work offline.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio

from http_helpers import live_server
from tools.instruct import topics
from tools.instruct_tools import LOOKUP_TOOL, find_topic
from trio_mlx import default_model_path

pytestmark = pytest.mark.model

REPORT = default_model_path() / "tools.json"


def _report() -> dict[str, Any]:
    report: dict[str, Any] = json.loads(REPORT.read_text())
    return report


def _lookup_topic(message: Any) -> str | None:
    """The topic of the message's one call to ``lookup``, else None."""
    calls = message.tool_calls or []
    if len(calls) != 1 or calls[0].function.name != "lookup":
        return None
    arguments = json.loads(calls[0].function.arguments)
    topic = arguments.get("topic") if isinstance(arguments, dict) else None
    return topic if isinstance(topic, str) else None


async def test_lookup_requests_in_new_phrasings_call_the_tool_as_the_report_says() -> None:
    seen = _report()["tools_seen_topics"]
    every = topics()
    asked: dict[str, str | None] = {}
    async with (
        live_server(None) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as client,
    ):

        async def ask(request: str) -> None:
            reply = await client.chat.completions.create(
                model=server.engine.model_id,
                messages=[{"role": "user", "content": request}],
                tools=[LOOKUP_TOOL],  # type: ignore[list-item]
                max_tokens=80,
            )
            choice = reply.choices[0]
            asked[request] = _lookup_topic(choice.message)
            if asked[request] is not None:
                assert choice.finish_reason == "tool_calls"

        async with trio.open_nursery() as nursery:
            for row in seen["rows"]:
                nursery.start_soon(ask, row["request"])
    right = [
        asked[row["request"]] is not None
        and find_topic(every, asked[row["request"]] or "") is not None
        and find_topic(every, asked[row["request"]] or "").key == row["topic"]  # type: ignore[union-attr]
        for row in seen["rows"]
    ]
    assert len(right) == seen["right_topic"]["asked"] == 36
    assert sum(right) == seen["right_topic"]["hits"], asked
    assert seen["right_topic"]["hits"] >= 30  # the bar: 5 in 6 new-phrasing requests


async def test_a_two_turn_agent_loop_calls_lookup_then_answers_from_its_result() -> None:
    every = {t.key: t for t in topics()}
    with_statement = every["with"]
    request = "Could you look up the with statement for me?"
    async with (
        live_server(None) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as client,
    ):
        messages: list[Any] = [{"role": "user", "content": request}]
        first = await client.chat.completions.create(
            model=server.engine.model_id, messages=messages, tools=[LOOKUP_TOOL], max_tokens=80
        )
        call_message = first.choices[0].message
        assert _lookup_topic(call_message) == with_statement.title
        call = (call_message.tool_calls or [])[0]
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": with_statement.answer},
        ]
        second = await client.chat.completions.create(
            model=server.engine.model_id, messages=messages, tools=[LOOKUP_TOOL], max_tokens=160
        )
        # With no tools offered the same request is answered directly, without a call.
        plain = await client.chat.completions.create(
            model=server.engine.model_id,
            messages=[{"role": "user", "content": request}],
            max_tokens=60,
        )
    answer = second.choices[0].message
    assert not answer.tool_calls
    assert (answer.content or "").lstrip().startswith(with_statement.title), answer.content
    assert second.choices[0].finish_reason == "stop"
    assert not plain.choices[0].message.tool_calls
    assert "with" in (plain.choices[0].message.content or "").lower()


async def test_a_forced_lookup_call_names_a_topic_the_tool_knows() -> None:
    # tool_choice forces the call even for a plain question; the grammar keeps the
    # call's JSON valid and the model still fills in the topic asked about.
    async with (
        live_server(None) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as client,
    ):
        reply = await client.chat.completions.create(
            model=server.engine.model_id,
            messages=[{"role": "user", "content": "What is the with statement?"}],
            tools=[LOOKUP_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "lookup"}},
            max_tokens=80,
        )
    topic = _lookup_topic(reply.choices[0].message)
    assert topic is not None
    assert reply.choices[0].finish_reason == "tool_calls"
