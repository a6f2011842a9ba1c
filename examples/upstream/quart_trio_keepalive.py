"""Reproduction for upstream: Hypercorn never closes a connection served by Quart-Trio.

Prints "still open after 3 s" for a one-route Quart-Trio app and "closed" for a
plain ASGI app on the same Hypercorn, with a request that says ``connection: close``
(the keep-alive timeout is ignored the same way). Seen with Quart-Trio 0.12.0,
Hypercorn 0.18.0, Trio 0.35. Cause (design/http.md, "Connections"): Hypercorn queues
``http.disconnect`` from inside the app's final ``send``; Quart-Trio's message reader
cancels the request nursery on it, so the rest of that ``send`` (closing the socket,
or re-arming the keep-alive timer) runs cancelled. Run: ``python quart_trio_keepalive.py``.
"""

from __future__ import annotations

import socket
from typing import Any

import hypercorn.trio
import trio
from hypercorn.config import Config
from quart_trio import QuartTrio

quart_app = QuartTrio(__name__)


@quart_app.get("/")
async def index() -> str:
    return "hi"


async def plain_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"hi"})


def probe(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(3)
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        data = b""
        while not data.endswith(b"hi"):
            data += s.recv(4096)
        try:
            return "closed" if s.recv(1) == b"" else "more data"
        except TimeoutError:
            return "still open after 3 s"


async def check(app: Any) -> str:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = 1
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(hypercorn.trio.serve, app, config)
        port = int(binds[0].rsplit(":", 1)[1])
        result = await trio.to_thread.run_sync(probe, port)
        nursery.cancel_scope.cancel()
    return result


async def main() -> None:
    print("quart-trio:", await check(quart_app))
    print("plain ASGI:", await check(plain_app))


if __name__ == "__main__":
    trio.run(main)
