"""What agent clients send: Claude Code, Codex CLI, opencode/Cline and aider, each a 200.

``tests/fixtures/agents/*.json`` hold the requests these agents send (from their
public sources and documentation: headers, query, body). Each is sent with the
official client of its API (``anthropic`` for Messages, ``openai`` for Responses
and chat), whole and streamed, to a real server whose ``--served-model-name``
patterns take the agents' model names; a request with tools goes to the
tool-format model (``tests/tool_model.py``), the others to the bundled model.
Also here: keep-alives while a stream waits in the queue, the doubled ``/v1``
prefix, and model-name patterns.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from http_helpers import LiveServer, live_server
from trio_mlx_http._settings import Settings

pytestmark = pytest.mark.model

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "agents").glob("*.json"))
#: The names the agents in the fixtures ask for (Claude Code's are patterns).
NAMES = ("pydoc-llama", "claude-*", "gpt-5-codex", "qwen2.5-coder")


def _load(path: Path) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads(path.read_text())
    return fixture


@pytest.fixture(scope="module")
def tool_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tool_model import make_tool_model

    return make_tool_model(tiny_model_path, tmp_path_factory.mktemp("models") / "agent-tools")


@pytest.fixture
async def servers(tool_model: Path) -> AsyncIterator[dict[bool, LiveServer]]:
    settings = Settings(served_model_names=NAMES)
    async with live_server(None, settings) as plain, live_server(tool_model, settings) as tools:
        yield {False: plain, True: tools}


def _typed(method: Any, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as keyword arguments of the client's ``method``: the fields it has no
    parameter for (anthropic 2.x dropped ``temperature``) go in ``extra_body``, as sent."""
    known = inspect.signature(method).parameters
    typed = {k: v for k, v in body.items() if k in known and k != "stream"}
    extra = {k: v for k, v in body.items() if k not in known and k != "stream"}
    return {**typed, "extra_body": extra} if extra else typed


async def _messages(server: LiveServer, fixture: dict[str, Any], stream: bool) -> dict[str, Any]:
    body = _typed(anthropic.resources.messages.AsyncMessages.create, fixture["body"])
    options: dict[str, Any] = {
        "extra_headers": fixture.get("headers"),
        "extra_query": fixture.get("query"),
        # Given a timeout, the client sends a large max_tokens without streaming too.
        "timeout": 120,
    }
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="-", max_retries=0) as c:
        if not stream:
            message = await c.messages.create(**body, **options)
            return message.model_dump()
        async with c.messages.stream(**body, **options) as events:
            kinds = [event.type async for event in events]
            message = await events.get_final_message()
    assert (kinds[0], kinds[-1]) == ("message_start", "message_stop"), kinds
    return message.model_dump()


async def _responses(server: LiveServer, fixture: dict[str, Any], stream: bool) -> dict[str, Any]:
    body = {k: v for k, v in fixture["body"].items() if k != "stream"}
    headers = fixture.get("headers")
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        if not stream:
            reply = await c.responses.create(**body, extra_headers=headers)
            return reply.model_dump()
        async with c.responses.stream(**body, extra_headers=headers) as events:
            kinds = [event.type async for event in events]
            reply = await events.get_final_response()
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    return reply.model_dump()


async def _chat(server: LiveServer, fixture: dict[str, Any], stream: bool) -> dict[str, Any]:
    body = {k: v for k, v in fixture["body"].items() if k not in ("stream", "stream_options")}
    headers = fixture.get("headers")
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        if not stream:
            reply = await c.chat.completions.create(**body, extra_headers=headers)
            return reply.model_dump()
        chunks = await c.chat.completions.create(
            **body,
            stream=True,
            stream_options=fixture["body"].get("stream_options"),
            extra_headers=headers,
        )
        finishes, usage = [], None
        async for chunk in chunks:
            finishes += [choice.finish_reason for choice in chunk.choices if choice.finish_reason]
            usage = chunk.usage or usage
    assert len(finishes) == 1, finishes
    if fixture["body"].get("stream_options", {}).get("include_usage"):
        assert usage is not None
        assert usage.prompt_tokens_details is not None
    return {"finish_reason": finishes[0]}


def check_answer(api: str, answer: dict[str, Any]) -> None:
    """Well-formed in the API's own terms (the clients' types parsed it already)."""
    if api == "messages":
        assert answer["stop_reason"] in ("end_turn", "max_tokens", "tool_use"), answer
        assert answer["content"], answer
        usage = answer["usage"]
        assert usage["cache_creation_input_tokens"] == 0
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    elif api == "responses":
        assert answer["status"] in ("completed", "incomplete"), answer
        assert answer["output"], answer
        assert answer["usage"]["input_tokens_details"]["cached_tokens"] >= 0
    else:
        finish = answer.get("finish_reason") or answer["choices"][0]["finish_reason"]
        assert finish in ("stop", "length", "tool_calls"), answer


SEND = {"messages": _messages, "responses": _responses, "chat": _chat}


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
async def test_an_agent_request_gets_a_well_formed_answer(
    path: Path, servers: dict[bool, LiveServer]
) -> None:
    fixture = _load(path)
    server = servers[bool(fixture["body"].get("tools"))]
    for stream in (False, True):
        answer = await SEND[fixture["api"]](server, fixture, stream)
        check_answer(fixture["api"], answer)


async def test_served_names_are_listed_and_patterns_answer(tiny_model_path: Path) -> None:
    settings = Settings(served_model_names=("first", "claude-*", "second"))
    async with (
        live_server(tiny_model_path, settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        listed = [card["id"] for card in (await http.get("/v1/models")).json()["data"]]
        body = {"max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
        for name in ("claude-opus-4-1", "claude-haiku-4-5-20251001", "second"):
            reply = await http.post("/v1/messages", json={**body, "model": name})
            assert reply.status_code == 200, reply.text
        unknown = await http.post("/v1/messages", json={**body, "model": "gpt-4o"})
        card = await http.get("/v1/models/claude-sonnet-4-5")
    # Every served name is listed after the model's own; a pattern is not a name.
    assert listed == [server.engine.model_id, "first", "second"]
    assert unknown.status_code == 404
    assert card.json()["id"] == "claude-sonnet-4-5"


async def test_a_doubled_v1_prefix_names_the_right_base_url(server: LiveServer) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=f"{server.url}/v1", api_key="-", max_retries=0
    ) as client:
        with pytest.raises(anthropic.NotFoundError) as caught:
            await client.messages.create(
                model="x", max_tokens=1, messages=[{"role": "user", "content": "Hi"}]
            )
    message = str(caught.value)
    assert "/v1 twice" in message, message
    assert f"give it {server.url}" in message, message


@pytest.fixture
async def server(tiny_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tiny_model_path) as live:
        yield live


#: Seconds of silence before a keep-alive, small so a test sees several.
KEEPALIVE = 0.05
#: Each route's streamed request, where its keep-alive appears, and where tokens do.
ROUTES: list[tuple[str, dict[str, Any], bytes, bytes]] = [
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
        b": keep-alive\n\n",
        rb'"content":"[^"]',  # the opening chunk's content is empty
    ),
    (
        "/v1/responses",
        {"input": "Hi", "max_output_tokens": 4, "stream": True},
        b": keep-alive\n\n",
        rb"response\.output_text\.delta",
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
        b'event: ping\ndata: {"type":"ping"}\n\n',
        rb"content_block_delta",
    ),
]


class _Blocker:
    """An exclusive engine job that holds the MLX thread until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def job(self, _model: Any, _tokenizer: Any) -> None:
        self.entered.set()
        self.release.wait(timeout=60)  # bounded: a failing test does not hang the run

    async def started(self, server: LiveServer, nursery: trio.Nursery) -> None:
        nursery.start_soon(server.engine.run_exclusive, self.job)
        await trio.to_thread.run_sync(self.entered.wait, 60)


async def test_a_queued_stream_sends_keep_alives_before_its_first_token(
    tiny_model_path: Path,
) -> None:
    settings = Settings(sse_keepalive=KEEPALIVE)
    async with (
        live_server(tiny_model_path, settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        for path, body, keepalive, token in ROUTES:
            blocker = _Blocker()
            async with trio.open_nursery() as nursery:
                await blocker.started(server, nursery)
                raw = b""
                async with http.stream("POST", path, json=body) as reply:
                    assert reply.status_code == 200
                    async for piece in reply.aiter_bytes():
                        raw += piece
                        if raw.count(keepalive) >= 3:
                            blocker.release.set()
                blocker.release.set()
            assert raw.count(keepalive) >= 3, (path, raw[:300])
            first = re.search(token, raw)
            assert first is not None, (path, raw[:300])
            assert raw.index(keepalive) < first.start(), (path, raw[:300])


async def test_the_official_clients_parse_a_stream_with_keep_alives(
    tiny_model_path: Path,
) -> None:
    settings = Settings(sse_keepalive=KEEPALIVE)
    user: Any = [{"role": "user", "content": "Hi"}]
    async with (
        live_server(tiny_model_path, settings) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as oai,
        anthropic.AsyncAnthropic(base_url=server.url, api_key="-", max_retries=0) as claude,
    ):
        model = server.engine.model_id
        texts: dict[str, str] = {}

        async def chat() -> None:
            chunks = await oai.chat.completions.create(
                model=model, messages=user, max_tokens=4, stream=True
            )
            texts["chat"] = "".join([c.choices[0].delta.content or "" async for c in chunks])

        async def responses() -> None:
            async with oai.responses.stream(model=model, input=user, max_output_tokens=4) as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                texts["responses"] = "".join(deltas)

        async def messages() -> None:
            async with claude.messages.stream(model=model, max_tokens=4, messages=user) as stream:
                texts["messages"] = await stream.get_final_text()

        blocker = _Blocker()
        async with trio.open_nursery() as nursery:
            await blocker.started(server, nursery)
            for each in (chat, responses, messages):
                nursery.start_soon(each)
            # Long enough for several keep-alives on each stream (the raw test counts them).
            await trio.sleep(20 * KEEPALIVE)
            blocker.release.set()
    assert set(texts) == {"chat", "responses", "messages"}
    assert texts["chat"] == texts["responses"] == texts["messages"], texts
