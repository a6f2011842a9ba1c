"""Hypercorn's Trio worker with the connection guards this server needs.

``serve(app, config, limits, ...)`` does what ``hypercorn.trio.serve`` does for
plain HTTP binds, with three changes, each for a failure seen under load:

- **Connections close when they should.** Hypercorn closes a connection (after
  ``Connection: close``, or its keep-alive timeout) or re-arms the keep-alive
  timer inside the ASGI app's ``send`` of the last body chunk. Quart-Trio's
  request handler runs that ``send`` in a nursery that its message reader
  cancels as soon as Hypercorn reports the response done, which happens inside
  that same ``send``: the rest of Hypercorn's bookkeeping meets ``Cancelled``,
  and the connection is neither closed nor timed out. It then lives until the
  client leaves. :func:`_close_shim` shields that one ``send``.
- **A cap on connections.** Past ``max_connections`` a new connection gets a
  small 503 and is closed, instead of taking fds until ``accept`` fails with
  EMFILE in a loop. EMFILE itself (another fd consumer) is waited out quietly.
- **A write timeout.** Hypercorn writes to the socket in a shielded scope, so
  a client that stops reading blocks its handler, and the graceful deadline,
  forever. :class:`_GuardedStream` gives each 64 KiB of a write
  ``write_timeout`` seconds, then aborts the connection (the handler sees a
  disconnect, and leaving ``engine.generate`` frees the row); at the graceful
  deadline every pending write is aborted. A write the socket takes at once
  (a streamed token's event, nearly always) cannot stall: it is sent without
  arming a deadline, which was a tenth of the Trio thread's time per token.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import resource
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import attrs
import trio
from hypercorn.config import Config
from hypercorn.events import Event, RawData, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    ConnectionState,
    Scope,
)
from hypercorn.utils import repr_socket_addr, wrap_app

__all__ = ["ConnectionGuard", "ConnectionLimits", "ConnectionStatistics", "raise_fd_limit", "serve"]

logger = logging.getLogger("trio_mlx_http")

#: Bytes written under one write deadline: the timeout bounds a stall, not a long answer.
_WRITE_SLICE = 64 * 1024
#: ``accept`` errors that mean "out of fds or memory for now": wait, do not log a traceback.
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Seconds a connection whose client has gone gets to wind down.
_WIND_DOWN = 1.0
#: Fds kept free for everything but connections (model files, logs, threads' pipes).
FD_RESERVE = 128


def _refusal() -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": "the server holds its maximum number of connections; retry later",
                "type": "service_unavailable",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


_REFUSAL = _refusal()


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return the soft limit now.

    Importing mlx-lm lowers the soft limit to 2,048, fewer than a busy server's
    connections. macOS refuses an unlimited soft limit, so it is capped there.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, min(hard, 10240) if hard != resource.RLIM_INFINITY else 10240):
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        return target
    return soft


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """How many connections, and how long a write may stall."""

    #: Connections held at once; past it a new one gets 503 and is closed.
    max_connections: int = 1024
    #: Seconds one 64 KiB slice of a response may take to leave; then the connection is aborted.
    write_timeout: float = 30.0
    #: Seconds an idle keep-alive connection stays open.
    keep_alive_timeout: float = 5.0

    def __attrs_post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, not {self.max_connections}")
        if not self.write_timeout > 0 or not self.keep_alive_timeout > 0:
            raise ValueError("write_timeout and keep_alive_timeout must be > 0")

    def fitted(self, fd_limit: int) -> ConnectionLimits:
        """These limits with ``max_connections`` lowered to what ``fd_limit`` allows."""
        room = max(1, fd_limit - FD_RESERVE)
        if self.max_connections <= room:
            return self
        logger.warning(
            "max connections %d lowered to %d: the fd limit is %d",
            self.max_connections,
            room,
            fd_limit,
        )
        return attrs.evolve(self, max_connections=room)


@attrs.frozen
class ConnectionStatistics:
    """A snapshot of the guard: connections open now, at most, served, refused, aborted."""

    open: int
    peak: int
    accepted: int
    refused: int
    write_timeouts: int


@attrs.define(eq=False)
class ConnectionGuard:
    """Counts connections, refuses past the cap, and times writes out."""

    limits: ConnectionLimits
    _open: int = attrs.field(init=False, default=0)
    _peak: int = attrs.field(init=False, default=0)
    _accepted: int = attrs.field(init=False, default=0)
    _refused: int = attrs.field(init=False, default=0)
    _write_timeouts: int = attrs.field(init=False, default=0)
    _writes: set[trio.CancelScope] = attrs.field(init=False, factory=set)
    _aborting: bool = attrs.field(init=False, default=False)

    @property
    def aborting(self) -> bool:
        """Whether writes are being aborted (the graceful deadline has passed)."""
        return self._aborting

    def statistics(self) -> ConnectionStatistics:
        """A frozen snapshot (``/metrics`` and the tests read it)."""
        return ConnectionStatistics(
            self._open, self._peak, self._accepted, self._refused, self._write_timeouts
        )

    def abort_writes(self) -> None:
        """Abort every pending and future write (the graceful deadline has passed)."""
        self._aborting = True
        for scope in self._writes:
            scope.cancel()

    @contextmanager
    def _held(self) -> Iterator[None]:
        self._open += 1
        self._accepted += 1
        self._peak = max(self._peak, self._open)
        try:
            yield
        finally:
            self._open -= 1

    async def handle(self, handler: Callable[[Any], Awaitable[None]], stream: Any) -> None:
        """Serve ``stream`` with ``handler``, or refuse it when the cap is reached."""
        if self._open >= self.limits.max_connections or self._aborting:
            self._refused += 1
            await _refuse(stream)
            return
        with self._held(), trio.CancelScope() as scope:
            try:
                await handler(_GuardedStream(stream, self, scope))
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    async def write(self, stream: trio.SocketStream, data: bytes) -> None:
        """``stream.send_all(data)``, each slice within the write timeout, or abort.

        Most writes are one SSE event that fits in the socket's buffer: they are
        sent at once, with no deadline to arm and disarm, and cannot stall. Only
        what the buffer does not take waits, under the write timeout.
        """
        if not self._aborting:
            sent = _send_nowait(stream, data)
            if sent == len(data):
                return
            data = data[sent:]
        view = memoryview(data)
        for start in range(0, max(len(view), 1), _WRITE_SLICE):
            scope = trio.CancelScope(deadline=trio.current_time() + self.limits.write_timeout)
            if self._aborting:
                scope.cancel()
            self._writes.add(scope)
            try:
                with scope:
                    await stream.send_all(view[start : start + _WRITE_SLICE])
            finally:
                self._writes.discard(scope)
            if scope.cancelled_caught:
                if not self._aborting:
                    self._write_timeouts += 1
                    logger.info("write timeout: closing a connection whose client stopped reading")
                # Closing wakes the connection's reader too, so Hypercorn lets it go.
                await stream.aclose()
                raise trio.BrokenResourceError("write timed out")


def _send_nowait(stream: trio.SocketStream, data: bytes) -> int:
    """Bytes of ``data`` the socket took without blocking (0 when it must wait).

    Hypercorn's writes are serialized by its per-connection lock and follow a
    schedule point there, so this send need not be one. Errors are trio's: a
    closed socket is ``ClosedResourceError``, a failed send ``BrokenResourceError``.
    """
    sock = stream.socket
    if sock.did_shutdown_SHUT_WR:
        raise trio.ClosedResourceError("can't send data after sending EOF")
    fd = sock.fileno()
    if fd == -1:
        raise trio.ClosedResourceError("socket was already closed")
    try:
        return os.write(fd, data)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise trio.ClosedResourceError("socket was already closed") from None
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


async def _refuse(stream: trio.SocketStream) -> None:
    """Answer 503 and close, reading what the client sent so the close is not a reset."""
    with trio.move_on_after(1.0):
        try:
            await stream.send_all(_REFUSAL)
            await stream.send_eof()
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    await stream.aclose()


class _GuardedStream(trio.abc.HalfCloseableStream):
    """A socket stream whose writes go through :meth:`ConnectionGuard.write`.

    It has ``socket`` (Hypercorn reads the peer's address from it) and no
    ``do_handshake`` (Hypercorn takes that to mean plain TCP).
    """

    def __init__(
        self, inner: trio.SocketStream, guard: ConnectionGuard, scope: trio.CancelScope
    ) -> None:
        self._inner = inner
        self._guard = guard
        self._scope = scope
        self._sending = False
        self.socket = inner.socket

    def send_nowait(self, data: bytes) -> int:
        """Bytes of ``data`` sent without blocking: 0 when the write must wait its turn."""
        if self._sending or self._guard.aborting:
            return 0
        return _send_nowait(self._inner, data)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        # The guard's first send is not trio's, so its conflict check is made here.
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._sending = True
        try:
            await self._guard.write(self._inner, bytes(data))
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self._inner.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._gone()
            raise
        if not data:
            self._gone()
        return data

    def _gone(self) -> None:
        # Hypercorn treats the client's EOF as a disconnect, but its keep-alive
        # timer task then holds the connection (and its fd) until the timeout:
        # the connection gets one second to wind down, then it is cancelled.
        self._scope.deadline = min(self._scope.deadline, trio.current_time() + _WIND_DOWN)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Connection(TCPServer):
    """Hypercorn's connection, with two changes.

    **Writes skip its lock and shield when they cannot block.** Hypercorn sends
    each body chunk under a per-connection lock and a shielded cancel scope (a
    schedule point and two scope changes per streamed token). A write the
    socket takes at once needs neither: nothing else is sending, and it cannot
    be interrupted. The rest, and any failure, go Hypercorn's way.

    **A connection accepted before the shutdown keeps its first request.**
    Hypercorn closes every idle connection when the shutdown begins, and a
    connection that has not yet sent its first request counts as idle: a
    client that connected just before the signal and was still sending its
    request found the connection closed unread (as the soak's SIGTERM scenario
    did). Such a connection is now held for its keep-alive timeout, as before
    the shutdown, so that request is served (with ``Connection: close``); the
    graceful deadline still bounds it. Connections that have been answered
    close at once, as in Hypercorn.
    """

    #: Whether a request has arrived on this connection (set on its first one).
    _requested = False

    async def _idle_timeout(self) -> None:
        if self._requested:
            await super()._idle_timeout()
            return
        await trio.sleep(self.config.keep_alive_timeout)  # the shutdown does not cut it short
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()

    async def protocol_send(self, event: Event) -> None:
        if type(event) is Updated and not event.idle:
            self._requested = True
        stream: object = self.stream  # Hypercorn types it as a TLS stream
        if (
            type(event) is RawData
            and isinstance(stream, _GuardedStream)
            and not self.send_lock.locked()
        ):
            try:
                sent = stream.send_nowait(event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                sent = 0  # Hypercorn's send meets it again and reports the close
            if sent == len(event.data):
                return
            if sent:
                event = RawData(event.data[sent:], event.address)
        await super().protocol_send(event)


class _Listener(trio.abc.Listener[trio.SocketStream]):
    """A socket listener that waits out fd exhaustion with one log line, not a traceback each."""

    def __init__(self, inner: trio.SocketListener) -> None:
        self._inner = inner
        self._warned_at = -math.inf

    async def accept(self) -> trio.SocketStream:
        while True:
            try:
                return await self._inner.accept()
            except OSError as exc:
                if exc.errno not in _CAPACITY_ERRNOS:
                    raise
                now = trio.current_time()
                if now - self._warned_at > 10.0:
                    self._warned_at = now
                    logger.warning("accept: %s; waiting for connections to close", exc.strerror)
                await trio.sleep(0.1)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _close_shim(app: ASGIFramework) -> ASGIFramework:
    """The app, with the last ``send`` of each HTTP response shielded from cancellation.

    Hypercorn closes the connection or re-arms its keep-alive timer inside that
    ``send``; Quart-Trio cancels the handler's nursery during it (see the
    module's docstring). The write itself is still bounded by the write timeout.
    """

    async def shimmed(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def last_send_shielded(message: ASGISendEvent) -> None:
            fields: Mapping[str, Any] = message
            if not fields.get("more_body", False) and fields["type"] == "http.response.body":
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await app(scope, receive, last_send_shielded)

    return shimmed


async def serve(
    app: ASGIFramework,
    config: Config,
    guard: ConnectionGuard,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config.bind`` until ``shutdown_trigger`` returns, then drain.

    After the trigger: no new connections, idle ones close, in-flight ones get
    ``config.graceful_timeout`` seconds; then their handlers are cancelled and
    their pending writes aborted, whatever the clients do.
    """
    config.keep_alive_timeout = guard.limits.keep_alive_timeout
    wrapped = wrap_app(_close_shim(app), config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            listeners: list[trio.abc.Listener[trio.SocketStream]] = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(
                    _Listener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                )
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            state = ConnectionState(lifespan_state.copy())
            handler = partial(guard.handle, partial(_Connection, wrapped, config, context, state))
            task_status.started(binds)
            async with trio.open_nursery() as accepting:
                accepting.start_soon(
                    partial(
                        trio.serve_listeners, handler, listeners, handler_nursery=server_nursery
                    )
                )
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            await context.terminated.set()
            deadline = trio.current_time() + config.graceful_timeout
            server_nursery.cancel_scope.deadline = deadline
            # Outside the server nursery: its deadline must not cancel this.
            lifespan_nursery.start_soon(_abort_writes_at, guard, deadline)
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _abort_writes_at(guard: ConnectionGuard, deadline: float) -> None:
    # Hypercorn's writes are shielded: the nursery's deadline alone does not end them.
    await trio.sleep_until(deadline)
    guard.abort_writes()
