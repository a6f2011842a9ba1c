"""Every tool-call format the installed mlx-lm ships a parser for, end to end.

For each parser: the extractor on the exact text (whole and streamed one
character at a time, with text before and two calls), then a live server on a
scripted model (``scripted_model.py``) whose tokenizer names the parser and
whose greedy output is text, then two calls in that format: non-streamed with
``n=2``, streamed, and with ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any

import mlx_lm.tool_parsers
import openai
import pytest

from http_helpers import live_server
from scripted_model import FORMATS, WEATHER_TOOLS, call_text, make_scripted_model
from trio_mlx_http._common.tools import ToolCallExtractor

PARSERS = sorted(FORMATS)
BEFORE = "Let me look."
CALLS = [("get_weather", "Paris"), ("get_time", "Rome")]
USER: Any = [{"role": "user", "content": "Weather and time in Paris and Rome?"}]


def _script(parser: str) -> list[str]:
    return [BEFORE, *(p for name, city in CALLS for p in call_text(parser, name, city))]


def _extractor(parser: str) -> ToolCallExtractor:
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return ToolCallExtractor(
        start=module.tool_call_start,
        end=module.tool_call_end,
        parser=module.parse_tool_call,
        tools=WEATHER_TOOLS,
    )


def _calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


EXPECTED = [(name, {"city": city}) for name, city in CALLS]


def test_every_installed_parser_has_a_format() -> None:
    installed = {m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    assert installed == set(FORMATS)


@pytest.mark.parametrize("parser", PARSERS)
def test_the_extractor_cuts_every_format_whole_and_streamed(parser: str) -> None:
    text = "".join(_script(parser))
    whole = _extractor(parser)
    shown, calls = whole.feed(text)
    rest, more = whole.finish()
    assert (shown + rest, _calls(calls + more)) == (BEFORE, EXPECTED)

    streamed = _extractor(parser)
    shown, calls = "", []
    for char in text:
        piece, found = streamed.feed(char)
        shown += piece
        calls += found
    piece, found = streamed.finish()
    assert (shown + piece, _calls(calls + found)) == (BEFORE, EXPECTED)


def test_an_empty_end_marker_does_not_end_a_call_at_once() -> None:
    # mistral has no end marker: str.find("") matched at once and leaked the call as text.
    extractor = _extractor("mistral")
    shown, calls = extractor.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "Par')
    assert (shown, calls) == ("", [])
    shown, calls = extractor.feed('is"}')
    rest, more = extractor.finish()
    assert (shown + rest, _calls(calls + more)) == ("", [("get_weather", {"city": "Paris"})])


@pytest.mark.model
@pytest.mark.parametrize("parser", PARSERS)
async def test_a_model_with_each_format_returns_tool_calls(parser: str, tmp_path: Path) -> None:
    model = make_scripted_model(
        tmp_path / parser, _script(parser), tokenizer_config={"tool_parser_type": parser}
    )
    async with (
        live_server(model) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client,
    ):
        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
        assert server.engine.tokenizer.tool_parser is module.parse_tool_call
        reply = await client.chat.completions.create(
            model=server.engine.model_id, messages=USER, tools=WEATHER_TOOLS, n=2
        )
        assert len(reply.choices) == 2
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == BEFORE
            calls = choice.message.tool_calls or []
            assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == (
                EXPECTED
            )
            assert len({c.id for c in calls}) == 2

        stream = await client.chat.completions.create(
            model=server.engine.model_id, messages=USER, tools=WEATHER_TOOLS, stream=True
        )
        content, streamed, reasons = "", {}, []
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    assert call.function is not None
                    streamed[call.index] = (call.function.name, json.loads(call.function.arguments))
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        assert content == BEFORE
        assert [streamed[i] for i in sorted(streamed)] == EXPECTED
        assert reasons == ["tool_calls"]

        single = await client.chat.completions.create(
            model=server.engine.model_id,
            messages=USER,
            tools=WEATHER_TOOLS,
            parallel_tool_calls=False,
        )
        calls = single.choices[0].message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED[:1]

        plain = await client.chat.completions.create(model=server.engine.model_id, messages=USER)
        # Without tools the call is text: nothing is cut out.
        assert plain.choices[0].message.content == "".join(_script(parser))
        assert plain.choices[0].finish_reason == "stop"
