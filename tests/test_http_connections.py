"""Connections end when they should: keep-alive timeout, ``Connection: close``, the cap."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

from http_helpers import live_server
from trio_mlx_http._server.serve import ConnectionGuard, ConnectionLimits, raise_fd_limit

pytestmark = pytest.mark.model


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _request(port: int, raw: bytes) -> tuple[trio.SocketStream, bytes]:
    """Send ``raw`` on a new connection; return it and the response head (and what followed)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(raw)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    return stream, data


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    """Read until the server closes (True) or sends more data than one response tail."""
    received = 0
    while chunk := await stream.receive_some(65536):
        received += len(chunk)
        if received > 65536:
            return False
    return True


async def _until_no_connection(guard: ConnectionGuard) -> None:
    while guard.statistics().open:  # noqa: ASYNC110 - polling a snapshot on purpose
        await trio.sleep(0.01)


_HEALTH = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"


async def test_idle_keep_alive_connection_is_closed_after_its_timeout(
    tiny_model_path: Path,
) -> None:
    limits = ConnectionLimits(keep_alive_timeout=0.5)
    async with live_server(tiny_model_path, limits=limits) as server:
        stream, head = await _request(_port(server.url), _HEALTH)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"connection: close" not in head.lower()
        with trio.fail_after(30):  # the timeout is 0.5 s; a loaded machine may be slow
            assert await _closed_by_server(stream)
            await _until_no_connection(server.guard)


async def test_response_saying_connection_close_closes_the_connection(
    tiny_model_path: Path,
) -> None:
    # An early 404 with an unread body says "connection: close" (its body is on the wire).
    body = b"x" * 4096
    raw = b"POST /v1/nowhere HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(body)
    # A keep-alive timeout far past the deadline below: it is not what closes them.
    limits = ConnectionLimits(keep_alive_timeout=600.0)
    async with live_server(tiny_model_path, limits=limits) as server:
        streams = []
        for _ in range(20):
            stream, head = await _request(_port(server.url), raw + body)
            assert head.startswith(b"HTTP/1.1 404")
            assert b"connection: close" in head.lower()
            streams.append(stream)
        with trio.fail_after(60):
            for stream in streams:
                assert await _closed_by_server(stream)


async def _until_accepted(guard: ConnectionGuard) -> None:
    while not guard.statistics().open:  # noqa: ASYNC110 - polling a snapshot on purpose
        await trio.sleep(0.01)


async def _listener_closed(port: int) -> None:
    """Return once a new connection is refused (the shutdown has begun)."""
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return
        await stream.aclose()
        await trio.sleep(0.01)


async def test_a_request_racing_the_shutdown_on_an_accepted_connection_is_served(
    tiny_model_path: Path,
) -> None:
    """Connected before the shutdown, request sent after it: answered, then closed."""
    limits = ConnectionLimits(keep_alive_timeout=600.0)
    async with live_server(tiny_model_path, limits=limits, graceful_timeout=600) as server:
        port = _port(server.url)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(60):
            await _until_accepted(server.guard)
            server.shutdown.set()
            await _listener_closed(port)
            # Every task is blocked: the shutdown has closed whatever it closes at once.
            await wait_all_tasks_blocked()
            await stream.send_all(_HEALTH)
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
            await server.stopped.wait()
        assert data.startswith(b"HTTP/1.1 200")
        assert b"connection: close" in data.lower()


async def test_a_silent_connection_holds_the_shutdown_only_for_its_keep_alive_timeout(
    tiny_model_path: Path,
) -> None:
    limits = ConnectionLimits(keep_alive_timeout=1.0)
    async with live_server(tiny_model_path, limits=limits, graceful_timeout=600) as server:
        stream = await trio.open_tcp_stream("127.0.0.1", _port(server.url))
        with trio.fail_after(60):  # the timeout is 1 s; the graceful deadline 600 s
            await _until_accepted(server.guard)
            server.shutdown.set()
            assert await _closed_by_server(stream)
            await server.stopped.wait()


async def test_connections_past_the_cap_are_refused_and_idle_ones_released(
    tiny_model_path: Path,
) -> None:
    """2,500 clients each send one request and stay: 1,000 are served, the rest get 503."""
    clients, cap = 2500, 1000
    # The clients and the server share this process's fds (mlx-lm lowered the limit).
    fds = raise_fd_limit()
    if fds < clients + cap + 300:
        pytest.skip(f"needs {clients + cap + 300} fds, the hard limit allows {fds}")
    # Held until the clients close (the keep-alive close has its own test): on a loaded
    # machine the flood may outlast a short keep-alive, and the cap would not be reached.
    limits = ConnectionLimits(max_connections=cap, keep_alive_timeout=600.0)
    statuses: dict[bytes, int] = {}
    held: list[trio.SocketStream] = []
    async with live_server(tiny_model_path, limits=limits) as server:
        port = _port(server.url)

        async def client() -> None:
            stream, head = await _request(port, _HEALTH)
            status = head[9:12]
            statuses[status] = statuses.get(status, 0) + 1
            if status == b"200":
                held.append(stream)
            else:
                await stream.aclose()

        limiter = trio.CapacityLimiter(64)

        async def bounded() -> None:
            async with limiter:
                await client()

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(bounded)
        stats = server.guard.statistics()
        # Refused ones got a clean 503; none hung or was reset.
        assert set(statuses) <= {b"200", b"503"}, statuses
        assert sum(statuses.values()) == clients
        assert statuses.get(b"503", 0) == stats.refused > 0
        assert stats.peak <= cap
        assert stats.open == len(held) == statuses[b"200"]
        # When the clients leave, the server lets their connections go and serves again.
        for stream in held:
            await stream.aclose()
        with trio.fail_after(60):
            await _until_no_connection(server.guard)
        stream, head = await _request(port, _HEALTH)
        assert head.startswith(b"HTTP/1.1 200")
        await stream.aclose()
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == fds


async def test_accept_waits_out_fd_exhaustion_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fault injection: ``accept`` fails with EMFILE three times, then succeeds."""
    import errno

    from trio_mlx_http._server.serve import _Listener

    class Exhausted:
        failures = 3

        async def accept(self) -> str:
            await trio.lowlevel.checkpoint()
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return "a connection"

    listener = _Listener(Exhausted())  # type: ignore[arg-type]
    with trio.fail_after(30):
        assert await listener.accept() == "a connection"  # type: ignore[comparison-overlap]
    warnings = [r for r in caplog.records if "waiting for connections to close" in r.message]
    assert len(warnings) == 1
    assert all(r.exc_info is None for r in caplog.records)


async def _socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), trio.SocketStream(right)


async def test_guard_write_sends_at_once_and_fails_as_trio_streams_do() -> None:
    guard = ConnectionGuard(ConnectionLimits(write_timeout=600))
    ours, theirs = await _socket_pair()
    await guard.write(ours, b"data: 1\n\n")
    assert await theirs.receive_some(100) == b"data: 1\n\n"
    await theirs.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await guard.write(ours, b"data: 2\n\n")  # a Unix socket's closed peer: EPIPE at once
    await ours.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await guard.write(ours, b"data: 3\n\n")
    assert guard.statistics().write_timeouts == 0


async def test_guard_write_that_cannot_leave_times_out_and_closes(
    autojump_clock: MockClock,
) -> None:
    guard = ConnectionGuard(ConnectionLimits(write_timeout=5))
    ours, theirs = await _socket_pair()
    with pytest.raises(trio.BrokenResourceError, match=r"^write timed out$"):
        await guard.write(ours, b"x" * (64 << 20))  # far more than the socket buffers hold
    assert guard.statistics().write_timeouts == 1
    assert ours.socket.fileno() == -1
    await theirs.aclose()
