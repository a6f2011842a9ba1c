"""Clients that stop reading: the write timeout, the unread bound, and shutdown around them."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest
import trio
from soak._server import serve

from http_helpers import NO_EOS, live_server
from trio_mlx_http._server.serve import ConnectionLimits

pytestmark = pytest.mark.model


def _stream_request(port: int, max_tokens: int, **extra: object) -> bytes:
    body = {"prompt": "Hello", "max_tokens": max_tokens, "stream": True, "logit_bias": NO_EOS}
    body.update(extra)
    data = json.dumps(body).encode()
    head = (
        # HTTP/1.0: the body is the event stream itself, not chunked.
        f"POST /v1/completions HTTP/1.0\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def _stalled_reader(port: int, request: bytes) -> trio.SocketStream:
    """A connection that sends ``request`` and then reads nothing (a small receive buffer)."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(request)
    return stream


async def _until(predicate: object, limit: float = 60) -> None:
    with trio.fail_after(limit):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 - polling snapshots
            await trio.sleep(0.02)


async def test_a_stalled_reader_is_cut_at_the_write_timeout_and_its_row_freed(
    tiny_model_path: Path,
) -> None:
    limits = ConnectionLimits(write_timeout=0.5)
    async with live_server(tiny_model_path, limits=limits, max_unread_tokens=None) as server:
        port = int(server.url.rsplit(":", 1)[1])
        request = _stream_request(port, 1900, logprobs=5)
        readers = [await _stalled_reader(port, request) for _ in range(3)]
        await _until(lambda: server.guard.statistics().write_timeouts == 3)
        await _until(lambda: server.engine.statistics().running_rows == 0)
        assert server.engine.statistics().requests["batch:cancelled"] == 3
        # The connection's own bookkeeping ends after its row is freed: wait for it.
        await _until(lambda: server.guard.statistics().open == 0)
        for reader in readers:
            await reader.aclose()


async def test_a_reader_past_the_unread_bound_gets_its_request_cancelled(
    tiny_model_path: Path,
) -> None:
    limits = ConnectionLimits(write_timeout=600)  # not what ends it
    async with live_server(tiny_model_path, limits=limits, max_unread_tokens=64) as server:
        port = int(server.url.rsplit(":", 1)[1])
        reader = await _stalled_reader(port, _stream_request(port, 1900, logprobs=5))
        await _until(lambda: server.engine.statistics().requests["batch:cancelled"] == 1)
        # Far fewer tokens than max_tokens were decoded for it, though it never read.
        assert server.engine.statistics().generated_tokens < 1900
        received = b""
        with trio.fail_after(30):
            while chunk := await reader.receive_some(65536):
                received += chunk
        events = _sse_events(received.split(b"\r\n\r\n", 1)[1])
        assert events[-1] == b"data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "reader_stalled"
        await reader.aclose()


def _sse_events(received: bytes) -> list[bytes]:
    return [line for line in received.split(b"\n\n") if line.startswith(b"data: ")]


async def _sigterm_with_stalled_readers(second_signal: bool) -> tuple[int, float, str, list[bytes]]:
    """A server with 4 stalled readers and 2 readers that read; SIGTERM (twice?), then wait."""
    with serve("--graceful-timeout", "2", "--write-timeout", "600") as server:
        port = int(server.url.rsplit(":", 1)[1])
        request = _stream_request(port, 1900, logprobs=5)
        stalled = [await _stalled_reader(port, request) for _ in range(4)]
        readers = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        received = [b"", b""]
        for reader in readers:
            await reader.send_all(request)

        async def read(index: int) -> None:
            while chunk := await readers[index].receive_some(65536):
                received[index] += chunk

        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(read, index)
            await _until(lambda: all(b"data: " in r for r in received))
            await trio.sleep(1.0)  # the stalled readers' buffers fill up
            start = trio.current_time()
            server.process.send_signal(signal.SIGTERM)
            if second_signal:
                # Once the first is taken: two signals before the server reads any
                # arrive as one (a loaded machine may be that slow).
                await _until(lambda: "no new requests" in server.log)
                server.process.send_signal(signal.SIGTERM)
            status = await trio.to_thread.run_sync(server.process.wait, 60)
            elapsed = trio.current_time() - start
        for stream in stalled + readers:
            await stream.aclose()
        return status, elapsed, server.log, [_sse_events(r)[-2] for r in received]


async def test_sigterm_exits_0_within_grace_whatever_stalled_readers_do() -> None:
    status, elapsed, log, _ = await _sigterm_with_stalled_readers(second_signal=False)
    assert status == 0, log[-3000:]
    # Grace 2 s; the margin is for a loaded machine. A stalled reader could hold the
    # server for the write timeout (600 s) if shutdown waited on it.
    assert elapsed < 2 + 30, elapsed
    assert "Traceback" not in log


async def test_a_second_signal_still_ends_streams_with_an_error_event_and_done() -> None:
    status, elapsed, log, last = await _sigterm_with_stalled_readers(second_signal=True)
    assert elapsed < 2 + 30, elapsed
    assert status == 0, log[-3000:]
    assert "Traceback" not in log
    for event in last:
        assert json.loads(event.removeprefix(b"data: "))["error"]["code"] == "engine_closed"
