"""A hostile world: connections that never close, readers that stop, stalls, hostile adapters.

Each scenario talks to a ``trio-mlx serve`` subprocess over 127.0.0.1 only and
reports figures (no verdicts): connections held vs served, RSS under stalled
readers, ``/health`` p99 while each runs, the exit time after SIGTERM with
stalled readers, and whether the base model still answers as the base after
adapter churn with hostile configs. They use nothing but HTTP, so they also
measure an older server (the "before" figures).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from soak._server import ServerProcess
from trio_mlx_http.testing import NO_EOS

_HEALTH = b"GET /health HTTP/1.1\r\nhost: soak\r\n\r\n"


def raise_own_fd_limit() -> int:
    """This process's soft fd limit raised to its hard limit (the clients need fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1)


async def _probe_health(url: str, stop: trio.Event, out: dict[str, Any]) -> None:
    """``GET /health`` every 20 ms on one kept-alive connection until ``stop``: the loop's latency."""
    latencies: list[float] = []
    failures = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        await http.get("/health")  # the connection is open before the scenario starts
        while not stop.is_set():
            start = time.perf_counter()
            try:
                await http.get("/health")
                latencies.append(time.perf_counter() - start)
            except httpx.HTTPError:
                failures += 1
            await trio.sleep(0.02)
    out.update(health_p99_ms=_p99(latencies), health_max_ms=_p99([max(latencies, default=0)]))
    out["health_probes"], out["health_failures"] = len(latencies), failures


async def _with_health(
    url: str, scenario: Callable[[], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    probe: dict[str, Any] = {}
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe_health, url, stop, probe)
        await trio.sleep(0.1)
        try:
            result = await scenario()
        finally:
            stop.set()
    return {**result, **probe}


async def _one_request(port: int, raw: bytes, limit: float) -> tuple[str, trio.SocketStream | None]:
    """Send ``raw`` on a new connection; the status (or how it failed) and the open stream."""
    try:
        with trio.fail_after(limit):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(raw)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    await stream.aclose()
                    return "closed", None
                data += chunk
            return data[9:12].decode(), stream
    except trio.TooSlowError:
        return "timeout", None
    except OSError:
        return "error", None
    except trio.BrokenResourceError:
        return "reset", None


async def _count_closed(streams: list[trio.SocketStream], within: float) -> int:
    """How many of ``streams`` the server closes within ``within`` seconds."""
    closed = 0

    async def watch(stream: trio.SocketStream) -> None:
        nonlocal closed
        try:
            while await stream.receive_some(65536):
                pass
            closed += 1
        except trio.BrokenResourceError:
            closed += 1

    with trio.move_on_after(within):
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(watch, stream)
    for stream in streams:
        await stream.aclose()
    return closed


async def idle_flood(server: ServerProcess, connections: int) -> dict[str, Any]:
    """``connections`` clients each send one ``GET /health`` and stay connected, idle."""
    port = _port(server.url)
    held: list[trio.SocketStream] = []
    statuses: Counter[str] = Counter()
    fds_before = _fds(server.process.pid)

    async def flood() -> dict[str, Any]:
        limiter = trio.CapacityLimiter(64)

        async def client() -> None:
            async with limiter:
                status, stream = await _one_request(port, _HEALTH, 10)
            statuses[status] += 1
            if stream is not None and status == "200":
                held.append(stream)
            elif stream is not None:
                await stream.aclose()

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(connections):
                nursery.start_soon(client)
        return {"flood_s": round(time.perf_counter() - start, 1)}

    report = await _with_health(server.url, flood)
    report.update(
        connections=connections,
        statuses=dict(statuses),
        server_fds_held=_fds(server.process.pid) - fds_before,
    )
    # Past the keep-alive timeout (5 s) every idle connection should be closed.
    report["closed_by_server_in_10s"] = await _count_closed(held, 10.0)
    report["still_held_after_10s"] = len(held) - report["closed_by_server_in_10s"]
    report["server_fds_after"] = _fds(server.process.pid) - fds_before
    status, stream = await _one_request(port, _HEALTH, 10)
    report["new_connection_after"] = status
    if stream is not None:
        await stream.aclose()
    return report


async def early_404_silent(server: ServerProcess, connections: int) -> dict[str, Any]:
    """Clients POST a body to an unknown path, read the 404 (``connection: close``), stay."""
    body = b"x" * 1024
    raw = b"POST /v1/nowhere HTTP/1.1\r\nhost: soak\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    port = _port(server.url)
    streams: list[trio.SocketStream] = []
    statuses: Counter[str] = Counter()
    for _ in range(connections):
        status, stream = await _one_request(port, raw, 10)
        statuses[status] += 1
        if stream is not None:
            streams.append(stream)
    return {
        "connections": connections,
        "statuses": dict(statuses),
        "closed_by_server_in_3s": await _count_closed(streams, 3.0),
    }


def _stalled_socket(port: int, request: bytes) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def stalled_readers(
    server: ServerProcess, readers: int, *, n: int, max_tokens: int, watch_s: float
) -> dict[str, Any]:
    """``readers`` streams (n choices, top 20 logprobs) whose clients never read; then SIGTERM."""
    body = json.dumps(
        {
            "prompt": "Hello",
            "max_tokens": max_tokens,
            "n": n,
            "stream": True,
            "logprobs": 20,
            "logit_bias": NO_EOS,
        }
    ).encode()
    port = _port(server.url)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    baseline = server.rss_bytes()
    socks = [_stalled_socket(port, request) for _ in range(readers)]
    peak = baseline
    rows_free_at: float | None = None
    health: list[float] = []
    start = time.perf_counter()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while time.perf_counter() - start < watch_s:
            began = time.perf_counter()
            reply = http.get("/health").json()
            health.append(time.perf_counter() - began)
            peak = max(peak, server.rss_bytes())
            if rows_free_at is None and not reply["running_rows"] and not reply["queued_rows"]:
                rows_free_at = time.perf_counter() - start
            time.sleep(0.1)
    report: dict[str, Any] = {
        "readers": readers,
        "choices_each": n,
        "rss_growth_mb": round((peak - baseline) / 2**20, 1),
        "rows_freed_after_s": None if rows_free_at is None else round(rows_free_at, 1),
        "health_p99_ms": _p99(health),
        "watched_s": watch_s,
    }
    # SIGTERM with the stalled readers still connected.
    sent = time.perf_counter()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(30)
        report["exit_after_sigterm_s"] = round(time.perf_counter() - sent, 1)
        report["exit_code"] = code
    except Exception:  # still running 30 s later: the "before" figure
        report["exit_after_sigterm_s"] = None
        report["exit_code"] = "running after 30 s"
        server.process.kill()
        server.process.wait()
    time.sleep(0.2)
    report["tracebacks_in_log"] = server.log.count("Traceback")
    for sock in socks:
        sock.close()
    return report


def _worst_bodies() -> dict[str, tuple[str, bytes]]:
    """The costliest bodies under the default 4 MiB body cap, by endpoint."""
    text = "a " * 1_950_000
    chat = [{"role": "user", "content": ""} for _ in range(120_000)]
    return {
        "tokenize_3.9MB_text": ("/tokenize", json.dumps({"prompt": text}).encode()),
        # The most tokens still tokenized on the bundled model: ~216 KB of 4-byte
        # characters, a token per byte (more is refused from its size).
        "tokenize_216k_tokens": (
            "/tokenize",
            json.dumps({"prompt": "\U0001f600" * 54_000}).encode(),
        ),
        "tokenize_120k_empty_messages": ("/tokenize", json.dumps({"messages": chat}).encode()),
        "detokenize_1.3M_ids": ("/detokenize", json.dumps({"tokens": [5] * 1_300_000}).encode()),
        "completion_3.9MB_text": (
            "/v1/completions",
            json.dumps({"prompt": text, "max_tokens": 1}).encode(),
        ),
        # Tool calls count toward the prompt's size: refused before the template renders.
        "chat_40k_tool_calls": ("/v1/chat/completions", json.dumps(_tool_calls(40_000)).encode()),
    }


def _tool_calls(count: int) -> dict[str, Any]:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in range(count)
    ]
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    return {"messages": chat, "max_tokens": 1}


async def event_loop_stalls(server: ServerProcess) -> dict[str, Any]:
    """Each worst body alone, ``/health`` probed meanwhile; then 3 large chats and a tiny one."""
    report: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        for name, (path, body) in _worst_bodies().items():
            assert len(body) <= 4 * 1024 * 1024, (name, len(body))
            rss = server.rss_bytes()

            async def one(path: str = path, body: bytes = body) -> dict[str, Any]:
                start = time.perf_counter()
                reply = await http.post(
                    path, content=body, headers={"content-type": "application/json"}
                )
                return {
                    "status": reply.status_code,
                    "answer_s": round(time.perf_counter() - start, 2),
                }

            result = await _with_health(server.url, one)
            await trio.sleep(0.5)
            result["rss_kept_mb"] = round((server.rss_bytes() - rss) / 2**20, 1)
            result["body_mb"] = round(len(body) / 2**20, 2)
            report[name] = result
        report["tiny_chat_behind_3_large"] = await _tiny_behind_large(http)
    return report


async def _tiny_behind_large(http: httpx.AsyncClient) -> dict[str, Any]:
    # Each large chat just under the context in characters would be tokenized whole.
    large = {"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 1}
    tiny = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    alone_start = time.perf_counter()
    await http.post("/v1/chat/completions", json=tiny)
    alone = time.perf_counter() - alone_start
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(partial_post, http, large)
        await trio.sleep(0.3)
        start = time.perf_counter()
        reply = await http.post("/v1/chat/completions", json=tiny)
        out["tiny_s"] = round(time.perf_counter() - start, 2)
        out["tiny_status"] = reply.status_code
    out["tiny_alone_s"] = round(alone, 2)
    return out


async def partial_post(http: httpx.AsyncClient, body: dict[str, Any]) -> None:
    await http.post("/v1/chat/completions", json=body)


def _hostile_adapters(root: Path, shout: Path) -> dict[str, str]:
    """Adapter folders with hostile configs, beside a plain copy of ``shout``."""
    made = {}
    for name, change in [
        ("plain", {}),
        ("dora", {"fine_tune_type": "dora"}),
        ("full", {"fine_tune_type": "full"}),
        ("vanishing", {}),
    ]:
        folder = root / name
        shutil.copytree(shout, folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config.update(change)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        made[name] = name
    # Refused at mount: lora_b without lora_a (mlx-lm would draw lora_a at random at
    # every use), and a scale of 1e30.
    import mlx.core as mx

    lonely = root / "b-only"
    shutil.copytree(shout, lonely)
    weights = dict(mx.load(str(lonely / "adapters.safetensors")))  # type: ignore[arg-type]
    mx.save_safetensors(
        str(lonely / "adapters.safetensors"),
        {k: v for k, v in weights.items() if not k.endswith(".lora_a")},
    )
    made["b-only"] = "b-only"
    huge = root / "huge-scale"
    shutil.copytree(shout, huge)
    config = json.loads((huge / "adapter_config.json").read_text())
    config["lora_parameters"] = {**config["lora_parameters"], "scale": 1e30}
    (huge / "adapter_config.json").write_text(json.dumps(config))
    made["huge-scale"] = "huge-scale"
    return made


def adapter_churn(server: ServerProcess, root: Path, rounds: int) -> dict[str, Any]:
    """Mount, use and unmount hostile adapters; does a plain request still answer as the base?"""
    plain = {"prompt": "The list type", "max_tokens": 24, "temperature": 0}
    statuses: Counter[str] = Counter()
    changed_after: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as http:

        def base_text() -> str:
            reply = http.post("/v1/completions", json=plain)
            return str(reply.json()["choices"][0]["text"]) if reply.status_code == 200 else "?"

        reference = base_text()
        for round_ in range(rounds):
            for name in ("plain", "dora", "full", "vanishing", "b-only", "huge-scale"):
                mounted = http.post("/v1/adapters", json={"name": name, "path": name})
                statuses[f"mount {name}: {mounted.status_code}"] += 1
                if name == "vanishing" and mounted.status_code == 201:
                    weights = root / name / "adapters.safetensors"
                    kept = weights.read_bytes()
                    weights.unlink()
                used = http.post("/v1/completions", json={**plain, "model": name})
                statuses[f"use {name}: {used.status_code}"] += 1
                if name == "vanishing" and mounted.status_code == 201:
                    weights.write_bytes(kept)
                gone = http.delete(f"/v1/adapters/{name}")
                statuses[f"unmount {name}: {gone.status_code}"] += 1
                if base_text() != reference:
                    changed_after.append(f"{name} (round {round_})")
        health = http.get("/health").status_code
    return {
        "rounds": rounds,
        "statuses": dict(sorted(statuses.items())),
        "base_changed_after": changed_after,
        "health_after": health,
    }


def context_overflow(server: ServerProcess) -> dict[str, Any]:
    """A prompt near the context plus ``max_tokens`` 2048: how far does it run?"""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        context = http.get("/v1/models").json()["data"][0].get("context_length")
        prompt = list(range(10, 10 + context - 16))
        reply = http.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 2048, "logit_bias": NO_EOS},
        )
        body = reply.json()
    usage = body.get("usage", {})
    return {
        "context": context,
        "status": reply.status_code,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "finish_reason": (body.get("choices") or [{}])[0].get("finish_reason"),
        "error": body.get("error", {}).get("code"),
        "header": reply.headers.get("x-max-tokens-clamped"),
    }


def run_world(root: Path, *, quick: bool, new_flags: bool = True) -> dict[str, Any]:
    """Every scenario above, on two servers; ``new_flags`` False measures an older server."""
    from soak._server import serve

    raise_own_fd_limit()
    shout = _default_adapter()
    adapters = root / "adapters"
    adapters.mkdir(parents=True)
    _hostile_adapters(adapters, shout)
    report: dict[str, Any] = {}
    # Quick runs flood a lower cap than the default 1,024, to reach it with fewer clients.
    flood, cap = (300, ["--max-connections", "200"]) if quick else (2500, [])
    with serve("--adapter-dir", str(adapters), *(cap if new_flags else [])) as server:
        report["stalls"] = trio.run(event_loop_stalls, server)
        report["adapters"] = adapter_churn(server, adapters, rounds=1 if quick else 3)
        report["context"] = context_overflow(server)
        report["early_404"] = trio.run(early_404_silent, server, 50 if quick else 500)
        report["idle_flood"] = trio.run(idle_flood, server, flood)
    with serve() as server:
        # Enough output (top 20 logprobs, ~1.4 kB a token) to fill the socket buffers.
        readers, n = (2, 8) if quick else (4, 16)
        report["stalled_readers"] = stalled_readers(
            server, readers, n=n, max_tokens=512, watch_s=20 if quick else 45
        )
    return report


def _default_adapter() -> Path:
    import trio_mlx

    return trio_mlx.default_adapter_path("shout")
