"""A live server under load and at its edges in time: disconnects, concurrency, shutdown."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import trio_mlx
from http_helpers import NO_EOS, live_server, sse_events
from trio_mlx_http._server.app import create_app

pytestmark = pytest.mark.model


#: A deadline that only catches a hang; a loaded machine must never reach it.
HANG = 60.0


async def _until(predicate: Callable[[], bool]) -> None:
    """Poll the engine's statistics (they have no wake-up) until ``predicate`` holds."""
    with trio.fail_after(HANG):
        while True:
            if predicate():
                return
            await trio.sleep(0.005)


async def _wait_for_no_rows(engine: trio_mlx.Engine) -> int:
    """Wait until no row runs; return how many decode steps that took."""
    start = engine.statistics().steps
    await _until(
        lambda: not engine.statistics().running_rows and not engine.statistics().queued_rows
    )
    return engine.statistics().steps - start


async def test_disconnect_mid_stream_frees_the_row(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=HANG) as http,
    ):
        body = {"prompt": "Hello", "max_tokens": 1500, "stream": True, "logit_bias": NO_EOS}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            assert server.engine.statistics().running_rows == 1
        # Leaving the block closed the connection mid-stream.
        assert await _wait_for_no_rows(server.engine) <= 5
        assert server.engine.statistics().generated_tokens < 200
        assert (await http.get("/health")).status_code == 200


async def test_disconnect_mid_non_streaming_request_frees_the_row(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=HANG) as http,
    ):
        body = {"prompt": "Hello", "max_tokens": 1500, "logit_bias": NO_EOS}

        async def post() -> None:
            await http.post("/v1/completions", json=body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post)
            # Hang up once the row runs (after a fixed time it might still be queued).
            await _until(lambda: server.engine.statistics().running_rows == 1)
            nursery.cancel_scope.cancel()
        assert await _wait_for_no_rows(server.engine) <= 5
        assert server.engine.statistics().generated_tokens < 1000


async def _stream_tokens(http: httpx.AsyncClient, index: int, max_tokens: int) -> tuple[int, int]:
    """One streaming chat; (tokens seen in logprobs, completion_tokens in usage)."""
    body = {
        "messages": [{"role": "user", "content": f"Request {index}"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "logit_bias": NO_EOS,
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    seen = sum(
        len(choice["logprobs"]["content"])
        for event in events[:-1]
        for choice in event["choices"]
        if choice["logprobs"]
    )
    return seen, events[-2]["usage"]["completion_tokens"]


async def test_32_concurrent_streams_complete_while_health_answers(tiny_model_path: Path) -> None:
    limits = httpx.Limits(max_connections=64)
    async with (
        live_server(tiny_model_path, max_batch=8) as server,
        httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http,
    ):
        counts: list[tuple[int, int]] = []
        health: list[int] = []

        async def stream(index: int) -> None:
            counts.append(await _stream_tokens(http, index, 24))

        async def probe(done: trio.Event) -> None:
            while not done.is_set():
                health.append((await http.get("/health")).status_code)
                await trio.sleep(0.02)

        done = trio.Event()
        async with trio.open_nursery() as probes:
            probes.start_soon(probe, done)
            async with trio.open_nursery() as streams:
                for index in range(32):
                    streams.start_soon(stream, index)
            done.set()
        assert counts == [(24, 24)] * 32
        assert len(health) >= 3
        assert set(health) == {200}
        assert server.engine.statistics().requests["batch:finished"] == 32


async def test_graceful_shutdown_finishes_requests_in_flight(tiny_model_path: Path) -> None:
    async with live_server(tiny_model_path, graceful_timeout=10) as server:
        replies: list[httpx.Response] = []

        async def request(http: httpx.AsyncClient) -> None:
            body = {"prompt": "Hello", "max_tokens": 60, "logit_bias": NO_EOS}
            replies.append(await http.post("/v1/completions", json=body))

        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(request, http)
                await _until(lambda: server.engine.statistics().running_rows == 3)
                server.shutdown.set()
            with trio.fail_after(HANG):
                await server.stopped.wait()
        assert [r.status_code for r in replies] == [200] * 3
        assert [json.loads(r.content)["usage"]["completion_tokens"] for r in replies] == [60] * 3
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=server.url) as late:
                await late.get("/health")


async def test_graceful_shutdown_cancels_what_outlives_the_deadline(
    long_tiny_model_path: Path,
) -> None:
    # A million-token context: the stream cannot end on its own inside the grace period.
    async with (
        live_server(long_tiny_model_path, graceful_timeout=0.3) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        body = {"prompt": "Hello", "max_tokens": 100_000, "stream": True, "logit_bias": NO_EOS}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            server.shutdown.set()
            with pytest.raises(httpx.RemoteProtocolError):
                async for _ in response.aiter_bytes():
                    pass
        with trio.fail_after(HANG):
            await server.stopped.wait()
        assert await _wait_for_no_rows(server.engine) <= 5


async def test_failure_mid_stream_sends_an_error_event_and_ends_the_stream(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio_mlx._lanes.processors as processors  # fault injection only

    real = processors.make_processors

    def failing_later(params: trio_mlx.SamplingParams) -> list[Any]:
        processors = real(params)
        calls = 0

        def explode(tokens: Any, logits: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 4:
                raise ValueError("processor exploded")
            return logits

        if params.logit_bias and 511 in params.logit_bias:
            processors.append(explode)
        return processors

    monkeypatch.setattr(processors, "make_processors", failing_later)
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=HANG) as http,
    ):
        body = {"prompt": "Hello", "max_tokens": 50, "stream": True}
        body["logit_bias"] = {**NO_EOS, "511": 0}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200
        events = sse_events(response.content)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert (error["type"], error["code"]) == ("server_error", error["code"])
        assert any(e["choices"][0]["text"] for e in events[:-2])
        ok = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert ok.status_code == 200


async def test_a_full_queue_is_429_with_retry_after(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path, max_batch=1, max_queue=1) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
        contextlib.AsyncExitStack() as streams,
    ):
        body = {"prompt": "Hello", "max_tokens": 1500, "stream": True, "logit_bias": NO_EOS}
        statuses = []
        for _ in range(4):
            response = await streams.enter_async_context(
                http.stream("POST", "/v1/completions", json=body)
            )
            statuses.append(response.status_code)
            if response.status_code == 429:
                break
        assert statuses[0] == 200
        assert statuses[-1] == 429
        await response.aread()
        assert json.loads(response.content)["error"]["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1
        assert (await http.get("/health")).status_code == 200


async def test_a_closed_engine_answers_503(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        app = create_app(engine)
    client = app.test_client()
    health = await client.get("/health")
    assert health.status_code == 503
    assert (await health.get_json())["error"]["type"] == "service_unavailable"
    reply = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert reply.status_code == 503


async def _start_cli(model: Path, graceful_timeout: float) -> tuple[trio.Process, bytes, str]:
    """Start ``trio-mlx serve`` on port 0; return it, its log so far and its URL."""
    command = [sys.executable, "-m", "trio_mlx_http", "serve", "--model", str(model)]
    command += ["--port", "0", "--no-fast-blas", "--graceful-timeout", str(graceful_timeout)]
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE)
    assert process.stderr is not None
    log = b""
    try:
        with trio.fail_after(60):
            while b"serving " not in log:
                chunk = await process.stderr.receive_some()
                assert chunk, log.decode()
                log += chunk
    except BaseException:
        process.kill()
        await process.wait()
        raise
    url = re.search(rb"serving \S+ on (http://\S+)", log)
    assert url is not None, log.decode()
    return process, log, url.group(1).decode()


async def test_cli_serves_and_exits_0_on_sigterm(tiny_model_path: Path) -> None:
    process, log, url = await _start_cli(tiny_model_path, graceful_timeout=5)
    assert process.stderr is not None
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            reply = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert reply.json()["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(HANG):
            assert await process.wait() == 0
        while chunk := await process.stderr.receive_some():
            log += chunk
        assert b"POST /v1/completions 200 tokens=3" in log
        assert re.search(rb"MLX on \S+ \[\S+\]: BLAS (reference|openblas|mkl|accelerate)", log)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_disconnect_mid_serial_request_stops_its_job(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=HANG) as http,
    ):
        # A seed sends the request to the serial lane.
        body = {"prompt": "Hello", "max_tokens": 2000, "seed": 1, "logit_bias": NO_EOS}

        async def post() -> None:
            await http.post("/v1/completions", json=body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post)
            # Hang up once the job has made tokens, not at a fixed time.
            stats = server.engine.statistics
            await _until(lambda: stats().running_jobs == 1 and stats().generated_tokens > 0)
            nursery.cancel_scope.cancel()
        await _until(lambda: server.engine.statistics().requests["serial:cancelled"] == 1)
        generated = server.engine.statistics().generated_tokens
        await trio.sleep(0.1)
        assert server.engine.statistics().generated_tokens == generated < 1000
        assert (await http.get("/health")).status_code == 200


async def test_cli_ends_streams_past_the_grace_deadline_with_an_error_event(
    long_tiny_model_path: Path,
) -> None:
    # A million-token context: the stream cannot end on its own inside the grace period
    # (on the tiny model's own 2,048 a fast machine could decode 1,900 tokens in 1 s).
    process, log, url = await _start_cli(long_tiny_model_path, graceful_timeout=1)
    try:
        body = {"prompt": "Hello", "max_tokens": 100_000, "stream": True, "logit_bias": NO_EOS}
        events: list[str] = []
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            with trio.fail_after(HANG):
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        if len(events) == 3:
                            process.send_signal(signal.SIGTERM)
        with trio.fail_after(HANG):
            assert await process.wait() == 0
            assert process.stderr is not None
            while chunk := await process.stderr.receive_some():
                log += chunk
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable"
        assert error["code"] == "engine_closed"
        assert all("error" not in json.loads(event) for event in events[:-2])
        # The access log tells the 200 the client got, what it was sent, and why it ended.
        access = re.search(rb"POST /v1/completions (\d+) tokens=(\d+) \S+s( cut=\w+)?\n", log)
        assert access is not None, log.decode()
        status, tokens, cut = access.groups()
        assert (status, cut) == (b"200", b" cut=shutdown"), log.decode()
        assert int(tokens) >= len(events) - 2, log.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
