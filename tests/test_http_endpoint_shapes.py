"""Every body and stream event of the two APIs validates against the official clients' types.

The clients build their models without validation (a missing required field
parses silently), so here each raw JSON body and each SSE payload is
validated strictly with the clients' pydantic types, which are generated from
OpenAI's and Anthropic's API specifications: text, tool calls, reasoning,
streamed and whole, and errors mid-stream.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import anthropic.types
import httpx
import openai.types.responses
import pytest
from pydantic import TypeAdapter, ValidationError

from http_helpers import live_server
from scripted_model import call_text, make_scripted_model

pytestmark = pytest.mark.model

RESPONSE = TypeAdapter(openai.types.responses.Response)


def _by_type(union: Any) -> dict[str, TypeAdapter[Any]]:
    """The members of an SDK event union by their ``type`` literal (the discriminator)."""
    members = typing.get_args(typing.get_args(union)[0])
    return {
        typing.get_args(cls.model_fields["type"].annotation)[0]: TypeAdapter(cls) for cls in members
    }


RESPONSE_EVENTS = _by_type(openai.types.responses.ResponseStreamEvent)
MESSAGE = TypeAdapter(anthropic.types.Message)
MESSAGE_EVENT: TypeAdapter[Any] = TypeAdapter(anthropic.types.RawMessageStreamEvent)
TOKEN_COUNT = TypeAdapter(anthropic.types.MessageTokensCount)

SCRIPT = [
    "<think>",
    "Plan.",
    "</think>",
    "Answer:",
    *call_text("json_tools", "get_weather", "Oslo"),
]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_model(
        tmp_path_factory.mktemp("models") / "shapes",
        SCRIPT,
        tokenizer_config={"tool_parser_type": "json_tools"},
    )


#: The one field the server leaves out on purpose: newer clients require
#: ``usage.input_tokens_details.cache_write_tokens``, and the engine does not report
#: how many prompt tokens its prompt cache kept (a made-up number would be a lie).
_LEFT_OUT = ("usage", "input_tokens_details", "cache_write_tokens")


def _validate(adapter: TypeAdapter[Any], payload: dict[str, Any]) -> None:
    """Strict validation; only a missing ``cache_write_tokens`` is allowed."""
    try:
        adapter.validate_python(payload, strict=True)
    except ValidationError as error:
        wrong = [
            e
            for e in error.errors()
            if not (e["type"] == "missing" and tuple(e["loc"][-3:]) == _LEFT_OUT)
        ]
        assert not wrong, wrong


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


def _bodies(tools: list[Any], key: str, length: str) -> list[tuple[str, dict[str, Any]]]:
    """(label, extra body fields) for: text cut by the length limit, then reasoning + text + call."""
    return [("length", {key: 3}), ("whole turn", {key: 60, "tools": tools}), (length, {key: 60})]


async def test_responses_bodies_and_events_validate(thinking_model: Path) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    async with (
        live_server(thinking_model) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        for label, extra in _bodies(tools, "max_output_tokens", "no tools"):
            body = {"input": "Weather?", "instructions": "Be brief.", **extra}
            whole = (await http.post("/v1/responses", json=body)).json()
            _validate(RESPONSE, whole)
            streamed = await http.post("/v1/responses", json={**body, "stream": True})
            events = _events(streamed.content)
            for name, payload in events:
                assert payload["type"] == name, label
                _validate(RESPONSE_EVENTS[name], payload)
            assert events[-1][0] in ("response.completed", "response.incomplete"), label
        stored = (await http.get(f"/v1/responses/{whole['id']}")).json()
    _validate(RESPONSE, stored)


async def test_messages_bodies_and_events_validate(thinking_model: Path) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    async with (
        live_server(thinking_model) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        for label, extra in _bodies(tools, "max_tokens", "stop sequence"):
            body: dict[str, Any] = {
                "system": "Be brief.",
                "messages": [{"role": "user", "content": "Weather?"}],
                **extra,
            }
            if label == "stop sequence":
                body["stop_sequences"] = ["Answer"]
            whole = (await http.post("/v1/messages", json=body)).json()
            MESSAGE.validate_python(whole, strict=True)
            streamed = await http.post("/v1/messages", json={**body, "stream": True})
            events = _events(streamed.content)
            for name, payload in events:
                assert payload["type"] == name, label
                MESSAGE_EVENT.validate_python(payload, strict=True)
            assert [name for name, _ in events[-2:]] == ["message_delta", "message_stop"], label
        counted = await http.post(
            "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "Hi"}]}
        )
    TOKEN_COUNT.validate_python(counted.json(), strict=True)
    assert whole["stop_reason"] == "stop_sequence"
