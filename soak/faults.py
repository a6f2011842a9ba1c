"""Faults: a model that fails on random prefills and decode steps, then a worker thread that dies.

The failure is injected the way the engine's own fault tests do it: a
test-only wrapper around the first decoder layer, installed through
``engine.run_exclusive``. A forward over more than one position is a prefill,
over one position a decode step.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from soak._answers import Answer, Spec, random_spec
from soak.load import send
from trio_mlx_http.testing import live_server


class Flaky:
    """Wraps a decoder layer; each forward fails with a probability, by kind."""

    def __init__(self, layer: Any, prefill: float, decode: float, seed: int) -> None:
        self.layer = layer
        self.rates = {"prefill": prefill, "decode": decode}
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        kind = "prefill" if x.shape[1] > 1 else "decode"
        if self.rng.random() < self.rates[kind]:
            self.injected[kind] += 1
            raise RuntimeError(f"injected {kind} failure")
        return self.layer(x, *args, **kwargs)


def _install(prefill: float, decode: float, seed: int) -> Any:
    def install(model: Any, tokenizer: Any) -> Flaky:
        flaky = Flaky(model.model.layers[0], prefill, decode, seed)
        model.model.layers[0] = flaky
        return flaky

    return install


def _remove(model: Any, tokenizer: Any) -> None:
    layer = model.model.layers[0]
    if isinstance(layer, Flaky):
        model.model.layers[0] = layer.layer


def _clean_failure(answer: Answer) -> bool:
    """A 500 in OpenAI's shape, or a stream that ended with a server_error event."""
    return answer.kind == "error" and (
        (answer.status == 500 and answer.detail.startswith("server_error/"))
        or (answer.status == 200 and answer.detail.startswith("stream error server_error"))
    )


async def _flaky_phase(url: str, engine: Any, requests: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    probe = Spec(chat=False, stream=False, max_tokens=8, no_eos=True)
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http:
        before = await send(http, probe, 60)
        flaky = await engine.run_exclusive(_install(prefill=0.1, decode=0.02, seed=seed))
        # Distinct prompts: a prompt-cache hit would leave nothing to prefill.
        specs = [
            attrs.evolve(random_spec(rng), prompt=f"Request {index}: {rng.random()}")
            for index in range(requests)
        ]
        answers: list[Answer | None] = [None] * requests

        async def one(index: int, limiter: trio.CapacityLimiter) -> None:
            async with limiter:
                answers[index] = await send(http, specs[index], 60)

        limiter = trio.CapacityLimiter(16)
        async with trio.open_nursery() as nursery:
            for index in range(requests):
                nursery.start_soon(one, index, limiter)
        await engine.run_exclusive(_remove)
        after = await send(http, probe, 60)
        health = (await http.get("/health")).status_code
    kinds = Counter(
        "ok" if a and a.kind == "ok" else "clean_error" if a and _clean_failure(a) else "other"
        for a in answers
    )
    return {
        "requests": requests,
        "injected": dict(flaky.injected),
        "outcomes": dict(kinds),
        "unclean": [
            f"{spec.path} {spec.body()} -> {a.kind} {a.status} {a.detail}"
            for spec, a in zip(specs, answers, strict=True)
            if a and not (a.kind == "ok" or _clean_failure(a))
        ][:10]
        + ["missing" for a in answers if a is None],
        "serving_after": before.kind == after.kind == "ok",
        "health_after": health,
        "worker_alive": engine.statistics().worker_alive,
    }


async def _pending(http: httpx.AsyncClient, spec: Spec, deadline: float) -> str:
    answer = await send(http, spec, deadline)
    if answer.status == 503 and "service_unavailable" in answer.detail:
        return "503"
    if answer.status == 200 and answer.kind == "error":
        return "stream_error:" + answer.detail.removeprefix("stream error ")
    return f"{answer.kind}:{answer.status}:{answer.detail[:80]}"


async def _death_phase(url: str, engine: Any, pending: int, deadline: float) -> dict[str, Any]:
    def die(model: Any, tokenizer: Any) -> None:
        raise SystemExit("injected worker death")

    limits = httpx.Limits(max_connections=pending + 8)
    outcomes: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=deadline) as http:
        long = [
            Spec(chat=i % 2 == 0, stream=i % 3 == 0, max_tokens=1500, no_eos=True)
            for i in range(pending)
        ]

        async def one(spec: Spec) -> None:
            outcomes[await _pending(http, spec, deadline)] += 1

        death: list[str] = []

        async def kill() -> None:
            try:
                await engine.run_exclusive(die)
            except Exception as error:
                death.append(type(error).__name__)

        with trio.fail_after(deadline):
            async with trio.open_nursery() as nursery:
                for spec in long:
                    nursery.start_soon(one, spec)
                while not engine.statistics().running_rows:  # noqa: ASYNC110 - a snapshot
                    await trio.sleep(0.01)
                await trio.sleep(0.2)
                nursery.start_soon(kill)
            health = (await http.get("/health")).status_code
            late = await _pending(http, Spec(chat=True, stream=False, max_tokens=3), deadline)
    return {
        "pending": pending,
        "outcomes": dict(outcomes),
        "all_ended_503": all(
            o == "503" or o.startswith("stream_error:service_unavailable/") for o in outcomes
        ),
        "death_raised": death,
        "health_after_death": health,
        "request_after_death": late,
    }


async def run_faults(
    model: Path | None, *, requests: int, pending: int, seed: int = 0
) -> dict[str, Any]:
    """Both phases on one in-process server; the report of each."""
    async with live_server(model, max_batch=8) as server:
        flaky = await _flaky_phase(server.url, server.engine, requests, seed)
        death = await _death_phase(server.url, server.engine, pending, deadline=30)
    return {"flaky": flaky, "worker_death": death}
