"""Security: the API key guards everything but /health, adapter paths stay in their folder,
the default bind is loopback, and an oversized body gets 413 before it is read whole."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

#: Every route, with a body that would succeed given the key.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/x", None),
    ("GET", "/v1/adapters", None),
    ("POST", "/v1/adapters", {"name": "shout", "path": "shout"}),
    ("DELETE", "/v1/adapters/shout", None),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/detokenize", {"tokens": [5]}),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/nowhere", None),
]  # fmt: skip


def check_api_key(url: str, key: str) -> dict[str, Any]:
    """Without the key (or with a wrong one) every route but /health answers 401.

    A fresh connection per request: the keep-alive hang is :func:`check_early_answers`'s.
    """
    leaks: list[str] = []
    hung: list[str] = []
    fresh = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=url, timeout=10, limits=fresh) as http:
        for method, path, body in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                try:
                    reply = http.request(method, path, json=body, headers=headers)
                except httpx.TimeoutException:
                    hung.append(f"{method} {path} {headers}")
                    continue
                if reply.status_code != 401:
                    leaks.append(f"{method} {path} {headers}: {reply.status_code}")
        health = http.get("/health").status_code
        authorized = http.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        ).status_code
    return {
        "routes_checked": len(ROUTES) * 3,
        "leaks": leaks,
        "hung": hung,
        "health_without_key": health,
        "with_key": authorized,
    }


def check_early_answers(url: str, requests: int, deadline: float = 2.0) -> dict[str, Any]:
    """POSTs answered before their body is read (401: no key), one keep-alive connection.

    Each must be answered within ``deadline`` s; a hang here stalls the client's connection.
    """
    hung: list[int] = []
    sent = 0
    stop = time.monotonic() + 60  # bounded in time as well as count
    with httpx.Client(base_url=url, timeout=deadline) as http:
        for index in range(requests):
            if len(hung) >= 5 or time.monotonic() > stop:
                break
            sent += 1
            try:
                http.post("/v1/adapters", json={"name": "shout", "path": "shout"})
            except httpx.TimeoutException:
                hung.append(index)
    return {"requests": sent, "hung": len(hung), "first_hung": hung}


def make_escapes(adapter_dir: Path, outside: Path) -> None:
    """Links inside ``adapter_dir`` that lead out of it (a folder, and a parent link)."""
    os.symlink(outside, adapter_dir / "escape", target_is_directory=True)
    os.symlink("..", adapter_dir / "up", target_is_directory=True)


def check_adapter_paths(url: str, outside: Path) -> dict[str, Any]:
    """No path that leaves ``--adapter-dir`` mounts: ``..``, absolute, symlinks out."""
    attempts = [
        "../shout", "shout/../../shout", "..", "/", str(outside), str(outside / "shout"),
        "escape", "escape/shout", "up/outside/shout", "up", "./../", "shout/..", "%2e%2e/shout",
    ]  # fmt: skip
    mounted: list[str] = []
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=30) as http:
        for index, path in enumerate(attempts):
            reply = http.post("/v1/adapters", json={"name": f"evil{index}", "path": path})
            statuses[path] = reply.status_code
            if reply.status_code < 400:
                mounted.append(path)
        names = [card["id"] for card in http.get("/v1/adapters").json()["data"]]
        legit = http.post("/v1/adapters", json={"name": "shout", "path": "shout"}).status_code
    return {
        "attempts": len(attempts),
        "statuses": statuses,
        "escaped": mounted + [n for n in names if n.startswith("evil")],
        "legit_mount": legit,
    }


def check_body_limit(url: str, limit: int) -> dict[str, Any]:
    """Announce a body 64 times the limit, send a little more than the limit, then wait.

    A server that answers 413 while most of the body is unsent did not read it whole.
    """
    parts = urlsplit(url)
    declared = 64 * limit
    sent = 0
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {declared}\r\n\r\n".encode()
        )
        chunk = b" " * 65536
        status = None
        deadline = time.monotonic() + 10
        sock.settimeout(0.05)
        while time.monotonic() < deadline and status is None:
            if sent < 2 * limit:
                with contextlib.suppress(OSError):
                    sent += sock.send(chunk)
            try:
                head = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else -1
    announced = _announced_413(url, declared)
    return {
        "limit": limit,
        "declared": declared,
        "sent_before_answer": sent,
        "status": status,
        "read_whole": sent >= declared,
        "content_length_only": announced,
    }


def _announced_413(url: str, declared: int) -> int:
    """Only the headers, announcing too much: the answer must come without any body."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {declared}\r\n\r\n".encode()
        )
        head = sock.recv(4096)
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else -1


def default_bind() -> dict[str, Any]:
    """The ``serve`` parser's default host."""
    from trio_mlx_http._cli import build_parser

    return {"default_host": build_parser().parse_args(["serve"]).host}


def prepare_adapter_dir(root: Path, adapter: Path) -> tuple[Path, Path]:
    """``root/adapters`` holding a copy of ``adapter``, and ``root/outside`` holding another,
    with links from the first that lead into the second."""
    import shutil

    inside, outside = root / "adapters", root / "outside"
    shutil.copytree(adapter, inside / adapter.name)
    shutil.copytree(adapter, outside / adapter.name)
    make_escapes(inside, outside)
    return inside, outside
