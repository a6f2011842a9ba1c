"""``/v1/responses`` and ``/v1/messages`` on the engine's lanes: disconnects, a full queue, metrics.

Neither API has ``logit_bias``, so rows that must keep running use the
endless model (tests/tool_model.py), which answers "a" forever.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import trio_mlx
from engine_helpers import wait_until
from http_helpers import live_server

pytestmark = pytest.mark.model

LONG: dict[str, dict[str, Any]] = {
    "/v1/messages": {
        "max_tokens": 1500,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
    },
    "/v1/responses": {"max_output_tokens": 1500, "stream": True, "input": "Hello"},
}


async def _close_after_deltas(
    response: httpx.Response, engine: trio_mlx.Engine, count: int
) -> AsyncIterator[str]:
    """The stream's lines; the engine closed (as at the graceful deadline) after ``count`` deltas."""
    deltas = 0
    async for line in response.aiter_lines():
        deltas += '"delta"' in line
        if deltas == count:
            engine.close()
        yield line


CHAT_STREAM = {"max_tokens": 1500, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("path", [*sorted(LONG), "/v1/chat/completions"])
async def test_a_stream_cut_by_the_engine_closing_is_logged_as_the_200_it_sent(
    endless_model_path: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_mlx_http.access")
    async with (
        live_server(endless_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        body = LONG.get(path, CHAT_STREAM)
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in _close_after_deltas(response, server.engine, 5)]
        last = [line for line in lines if line][-1]
        assert '"error"' in last or last == "data: [DONE]", last
    logged = [r.getMessage() for r in caplog.records if r.name == "trio_mlx_http.access"]
    line = next(entry for entry in logged if entry.startswith(f"POST {path} "))
    found = re.fullmatch(rf"POST {path} 200 tokens=(\d+) \S+s cut=shutdown", line)
    assert found is not None, line
    assert int(found.group(1)) >= 4, line


@pytest.mark.parametrize("path", sorted(LONG))
async def test_disconnect_mid_stream_frees_the_row(endless_model_path: Path, path: str) -> None:
    async with (
        live_server(endless_model_path) as server,
        httpx.AsyncClient(base_url=server.url) as http,
    ):
        engine = server.engine
        async with http.stream("POST", path, json=LONG[path]) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 6:
                    break
            assert engine.statistics().running_rows == 1
        # Leaving the block closed the connection mid-stream.
        with trio.fail_after(60):
            await wait_until(lambda: engine.statistics().running_rows == 0)
        assert engine.statistics().generated_tokens < 1000
        metrics = (await http.get("/metrics")).text
    assert f'trio_mlx_http_requests_total{{endpoint="{path}",status="499"}} 1.0' in metrics
    assert (
        f'trio_mlx_http_generations_total{{endpoint="{path}",lane="none",outcome="disconnected"}} 1.0'
        in metrics
    )


async def test_a_full_queue_is_an_anthropic_shaped_429(endless_model_path: Path) -> None:
    async with (
        live_server(endless_model_path, max_batch=1, max_queue=1) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        contextlib.AsyncExitStack() as streams,
    ):
        statuses = []
        for _ in range(4):
            response = await streams.enter_async_context(
                http.stream("POST", "/v1/messages", json=LONG["/v1/messages"])
            )
            statuses.append(response.status_code)
            if response.status_code == 429:
                break
        assert statuses[0] == 200
        assert statuses[-1] == 429
        body = (await response.aread()).decode()
        assert response.headers["content-type"].startswith("application/json")
        assert '"type": "rate_limit_error"' in body
        assert body.startswith('{"type": "error"')
        assert int(response.headers["retry-after"]) >= 1


async def test_metrics_count_both_endpoints_by_name_and_lane(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        messages = {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
        assert (await http.post("/v1/messages", json=messages)).status_code == 200
        assert (
            await http.post("/v1/messages", json={**messages, "stream": True})
        ).status_code == 200
        responses = {"max_output_tokens": 3, "input": "Hi"}
        assert (await http.post("/v1/responses", json=responses)).status_code == 200
        assert (await http.post("/v1/responses", json={"input": []})).status_code == 400
        metrics = (await http.get("/metrics")).text
    lines = metrics.splitlines()

    def value(prefix: str) -> float:
        [line] = [line for line in lines if line.startswith(prefix)]
        return float(line.rsplit(" ", 1)[1])

    assert value('trio_mlx_http_requests_total{endpoint="/v1/messages",status="200"}') == 2
    assert value('trio_mlx_http_requests_total{endpoint="/v1/responses",status="200"}') == 1
    assert value('trio_mlx_http_requests_total{endpoint="/v1/responses",status="400"}') == 1
    finished = [
        line
        for line in lines
        if line.startswith("trio_mlx_http_generations_total{")
        and 'lane="batch"' in line
        and ('"/v1/messages"' in line or '"/v1/responses"' in line)
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in finished) == 3
    assert value('trio_mlx_request_duration_seconds_count{endpoint="/v1/messages"}') == 2


def _named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, payload) for each ``event:``/``data:`` block of an SSE body."""
    out = []
    for block in raw.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


@pytest.mark.parametrize("path", sorted(LONG))
async def test_failure_mid_stream_ends_with_the_apis_error_event(
    endless_model_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    import trio_mlx._lanes.processors as processors  # fault injection only

    real = processors.make_processors

    def failing_later(params: trio_mlx.SamplingParams) -> list[Any]:
        calls = 0

        def explode(tokens: Any, logits: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 4:
                raise ValueError("processor exploded")
            return logits

        return [*real(params), explode]

    monkeypatch.setattr(processors, "make_processors", failing_later)
    async with (
        live_server(endless_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        # Each API's own name for the length (Responses refuses chat's max_tokens).
        length = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        response = await http.post(path, json={**LONG[path], length: 50})
        assert response.status_code == 200
        events = _named_events(response.content)
        metrics = (await http.get("/metrics")).text
    name, payload = events[-1]
    if path == "/v1/messages":
        assert [n for n, _ in events[:2]] == ["message_start", "content_block_start"]
        assert (name, payload["type"], payload["error"]["type"]) == ("error", "error", "api_error")
    else:
        assert [n for n, _ in events[:2]] == ["response.created", "response.in_progress"]
        assert name == "response.failed"
        assert payload["response"]["status"] == "failed"
        assert payload["response"]["error"]["code"] == "server_error"
        assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    assert any("delta" in n for n, _ in events)
    assert f'trio_mlx_http_requests_total{{endpoint="{path}",status="500"}} 1.0' in metrics


async def test_both_apis_and_chat_decode_in_one_batch(endless_model_path: Path) -> None:
    chat = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 1500,
        "stream": True,
    }
    async with (
        live_server(endless_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        contextlib.AsyncExitStack() as streams,
    ):
        engine = server.engine
        for path, body in [*LONG.items(), ("/v1/chat/completions", chat)]:
            response = await streams.enter_async_context(http.stream("POST", path, json=body))
            assert response.status_code == 200
        with trio.fail_after(60):
            await wait_until(lambda: engine.statistics().running_rows == 3)
        assert engine.statistics().queued_rows == 0


@pytest.mark.parametrize("path", sorted(LONG))
async def test_a_queued_stream_opens_before_its_first_token(
    endless_model_path: Path, path: str
) -> None:
    async with (
        live_server(endless_model_path, max_batch=2, max_queue=2) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        contextlib.AsyncExitStack() as streams,
    ):
        engine = server.engine
        for _ in range(2):  # endless rows fill the batch
            busy = await streams.enter_async_context(
                http.stream("POST", "/v1/chat/completions", json=LONG["/v1/messages"])
            )
            assert busy.status_code == 200
        with trio.fail_after(60):
            await wait_until(lambda: engine.statistics().running_rows == 2)
        waiting = await streams.enter_async_context(http.stream("POST", path, json=LONG[path]))
        lines = waiting.aiter_lines()
        first = await anext(line async for line in lines if line.startswith("event: "))
        # The batch holds only the endless chats: this request is still queued, tokenless.
        assert (engine.statistics().running_rows, engine.statistics().queued_rows) == (2, 1)
    assert first in ("event: message_start", "event: response.created")
