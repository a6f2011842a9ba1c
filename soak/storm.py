"""Disconnect storm: streaming clients that hang up at random points; nothing may stay behind.

Each client picks a point -- before its first token, after a few chunks, or
after a random time (which lands while the batch drains for a serial job,
while rows are parked, or while queued) -- and closes its connection there.
Seeded serial requests run alongside so drains and preemptions really happen.
Afterwards ``/metrics`` must show 0 running, queued, parked and waiting.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import trio

from soak._server import metrics
from trio_mlx_http.testing import NO_EOS

#: The gauges that must all read 0 once every client is gone.
ROWS = ("trio_mlx_running_rows", "trio_mlx_queued_rows", "trio_mlx_parked_rows")
IDLE = (*ROWS, "trio_mlx_waiting_jobs")


async def _client(
    http: httpx.AsyncClient, rng: random.Random, states: Counter[str], health: list[str]
) -> str:
    mode = rng.choice(["before_first_token", "mid_stream", "after_time"])
    chat = rng.random() < 0.5
    body: dict[str, Any] = {"max_tokens": 1500, "stream": True, "logit_bias": NO_EOS}
    if chat:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = "Hello"
    chunks = rng.randint(1, 20)
    with trio.move_on_after(rng.uniform(0.0, 2.0) if mode != "mid_stream" else 30):
        async with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions",
                               json=body) as response:  # fmt: skip
            if mode == "before_first_token":
                states[health[0]] += 1
                return mode  # headers only: hang up before reading a token
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if mode == "mid_stream" and seen >= chunks:
                    break
    # The arbiter's state when the client hung up, as /health last showed it.
    states[health[0]] += 1
    return mode


async def _serial(http: httpx.AsyncClient, done: trio.Event, rng: random.Random) -> int:
    """Seeded (serial-lane) requests until ``done``: they drain the batch and park rows."""
    count = 0
    while not done.is_set():
        body = {"prompt": "Hi", "max_tokens": rng.randint(2, 12), "seed": rng.randrange(99)}
        with trio.move_on_after(rng.uniform(0.05, 3.0)):
            await http.post("/v1/completions", json=body)
        count += 1
    return count


async def _poll_health(http: httpx.AsyncClient, done: trio.Event, health: list[str]) -> None:
    while not done.is_set():
        reply = await http.get("/health")
        health[0] = reply.json().get("state", "?") if reply.status_code == 200 else "down"
        await trio.sleep(0.05)


async def run_storm(
    url: str,
    *,
    clients: int,
    concurrency: int,
    seed: int = 0,
    settle_timeout: float = 30.0,
    rss: Callable[[], int] | None = None,
) -> dict[str, Any]:
    """Run ``clients`` disconnecting streams; return the report (rows left, RSS growth)."""
    rng = random.Random(seed)
    modes: Counter[str] = Counter()
    states: Counter[str] = Counter()
    health = ["?"]
    errors: Counter[str] = Counter()
    rss_before = rss() if rss else 0
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        limiter = trio.CapacityLimiter(concurrency)

        async def one(client_rng: random.Random) -> None:
            async with limiter:
                try:
                    modes[await _client(http, client_rng, states, health)] += 1
                except httpx.HTTPError as error:
                    errors[type(error).__name__] += 1

        done = trio.Event()
        serial = [0]
        async with trio.open_nursery() as outer:
            outer.start_soon(_poll_health, http, done, health)

            async def serial_traffic() -> None:
                serial[0] = await _serial(http, done, random.Random(seed + 1))

            outer.start_soon(serial_traffic)
            async with trio.open_nursery() as storm:
                for _ in range(clients):
                    storm.start_soon(one, random.Random(rng.random()))
            done.set()
        storm_seconds = time.perf_counter() - started
        left: dict[str, float] = {}
        with trio.move_on_after(settle_timeout):
            while True:
                left = await trio.to_thread.run_sync(metrics, url)
                if not any(left.get(name, 0) for name in IDLE):
                    break
                await trio.sleep(0.1)
        settled = time.perf_counter() - started - storm_seconds
        health_after = (await http.get("/health")).status_code
    return {
        "clients": clients,
        "modes": dict(modes),
        "states_at_hangup": dict(states),
        "client_errors": dict(errors),
        "serial_requests": serial[0],
        "seconds": round(storm_seconds, 2),
        "settle_seconds": round(settled, 2),
        "left": {name.removeprefix("trio_mlx_"): left.get(name, -1) for name in IDLE},
        "rows_left": sum(int(left.get(name, 0)) for name in IDLE),
        "health_after": health_after,
        "rss_growth_mb": round(((rss() if rss else 0) - rss_before) / 2**20, 1),
    }
