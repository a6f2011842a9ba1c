"""Load: many generation requests at a fixed concurrency, adapters mounted and unmounted meanwhile."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import trio

from soak._answers import ADAPTER, Answer, Spec, check, random_spec


async def send(http: httpx.AsyncClient, spec: Spec, deadline: float) -> Answer:
    """One request to its end; a transport failure is ``lost``, past ``deadline`` s ``hung``."""
    try:
        with trio.fail_after(deadline):
            response = await http.post(spec.path, json=spec.body())
    except trio.TooSlowError:
        return Answer("hung", 0, detail=f"no answer within {deadline} s")
    except httpx.HTTPError as error:
        return Answer("lost", 0, detail=repr(error))
    return check(spec, response.status_code, response.content)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of ``values``, in milliseconds."""
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "max_ms": at(1.0)}


async def _churn(
    http: httpx.AsyncClient, done: trio.Event, rng: random.Random, statuses: Counter[str]
) -> None:
    """Mount and unmount the adapter until ``done``; every answer must be a success."""
    while not done.is_set():
        reply = await http.post("/v1/adapters", json={"name": ADAPTER, "path": ADAPTER})
        statuses[f"mount:{reply.status_code}"] += 1
        await trio.sleep(rng.uniform(0.2, 0.8))
        reply = await http.delete(f"/v1/adapters/{ADAPTER}")
        statuses[f"unmount:{reply.status_code}"] += 1
        await trio.sleep(rng.uniform(0.05, 0.3))


async def run_load(
    url: str,
    *,
    requests: int,
    concurrency: int,
    seed: int = 0,
    adapters: bool = True,
    deadline: float = 120.0,
    rss: Callable[[], int] | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Send ``requests`` random requests, ``concurrency`` at a time; return the report."""
    rng = random.Random(seed)
    specs = [random_spec(rng, adapter_share=0.15 if adapters else 0.0) for _ in range(requests)]
    answers: list[Answer | None] = [None] * requests
    latencies: list[float] = []
    churn: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    rss_before = rss() if rss else 0
    started = time.perf_counter()
    async with httpx.AsyncClient(
        base_url=url, limits=limits, timeout=deadline, headers=headers
    ) as http:
        send_specs, receive_specs = trio.open_memory_channel[int](requests)
        for index in range(requests):
            send_specs.send_nowait(index)
        send_specs.close()

        async def worker() -> None:
            async for index in receive_specs:
                begin = time.perf_counter()
                answers[index] = await send(http, specs[index], deadline)
                latencies.append(time.perf_counter() - begin)

        done = trio.Event()
        async with trio.open_nursery() as outer:
            if adapters:
                outer.start_soon(_churn, http, done, random.Random(seed + 1), churn)
            async with trio.open_nursery() as workers:
                for _ in range(concurrency):
                    workers.start_soon(worker)
            done.set()
        health = (await http.get("/health")).status_code
    seconds = time.perf_counter() - started
    return _report(specs, answers, latencies, seconds, churn, health, rss_before, rss)


def _report(
    specs: list[Spec],
    answers: list[Answer | None],
    latencies: list[float],
    seconds: float,
    churn: Counter[str],
    health: int,
    rss_before: int,
    rss: Callable[[], int] | None,
) -> dict[str, Any]:
    outcomes = Counter(a.kind if a else "missing" for a in answers)
    ids = Counter(a.id for a in answers if a and a.id)
    duplicated = sum(n - 1 for n in ids.values()) + sum(a.duplicates for a in answers if a)
    tokens = sum(a.tokens for a in answers if a and a.kind == "ok")
    problems = [
        f"{s.path} {s.body()} -> {a.kind} {a.status} {a.detail}"
        for s, a in zip(specs, answers, strict=True)
        if a is None or a.kind not in ("ok", "rejected", "not_mounted")
    ]
    return {
        "requests": len(specs),
        "outcomes": dict(outcomes),
        "lost": outcomes["lost"] + outcomes["hung"] + outcomes["missing"],
        "duplicated": duplicated,
        "failed": outcomes["error"] + outcomes["bad"],
        "eos_counted_in_usage": sum(bool(a and a.eos_counted) for a in answers),
        "streams": sum(s.stream for s in specs),
        "serial": sum(s.seed is not None for s in specs),
        "adapter_requests": sum(s.model == ADAPTER for s in specs),
        "adapter_churn": dict(churn),
        "churn_5xx": sum(n for k, n in churn.items() if int(k.partition(":")[2]) >= 500),
        "seconds": round(seconds, 2),
        "req_per_s": round(len(specs) / seconds, 1),
        "tok_per_s": round(tokens / seconds, 1),
        "completion_tokens": tokens,
        "latency": percentiles(latencies),
        "health_after": health,
        "rss_growth_mb": round(((rss() if rss else 0) - rss_before) / 2**20, 1),
        "problems": problems[:20],
    }
