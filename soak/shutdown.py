"""Shutdown: SIGTERM while requests are in flight.

Short requests must finish whole within the grace period; long ones must end
(a clean error, or the connection closed at the deadline) -- none may hang;
new connections are refused; the process exits 0 within the grace period
plus a margin.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

from soak._answers import Spec, check
from soak._server import ServerProcess

_MARGIN = 10.0
#: The context of the model the long requests run on: more tokens than any machine
#: decodes for one row within a grace period (a fast box makes ~250 tokens/s a row
#: with the bundled model, and reached its 2,048-token context inside a 10 s grace).
LONG_CONTEXT = 1_000_000


def long_context_model(directory: Path) -> Path:
    """The bundled model, its context raised to ``LONG_CONTEXT``, written under ``directory``.

    The same weights and tokenizer (the weights linked, not copied), so the server runs
    at the bundled model's pace; but a long request can only end at the graceful
    deadline, never at the context's end, however fast the machine decodes.
    """
    from trio_mlx import default_model_path
    from trio_mlx.testing import with_context

    source = default_model_path()
    return with_context(source, Path(directory) / f"{source.name}-long-context", LONG_CONTEXT)


async def _one(http: httpx.AsyncClient, spec: Spec, deadline: float) -> str:
    try:
        with trio.fail_after(deadline):
            reply = await http.post(spec.path, json=spec.body())
    except trio.TooSlowError:
        return "hung"
    except httpx.ConnectError:
        return "refused"
    except httpx.HTTPError:
        return "cut"  # the connection closed at the graceful deadline
    answer = check(spec, reply.status_code, reply.content)
    if answer.kind == "ok":
        return "ok"
    if answer.status == 503 or (answer.status == 200 and answer.kind == "error"):
        return "clean_error"
    return f"bad:{answer.status}:{answer.detail[:80]}"


def _specs(short: int, long: int, short_tokens: int = 48) -> dict[str, list[Spec]]:
    return {
        "short": [
            Spec(chat=i % 2 == 0, stream=i % 3 == 0, max_tokens=short_tokens, no_eos=True)
            for i in range(short)
        ],
        "long": [
            Spec(chat=i % 2 == 0, stream=i % 2 == 1, max_tokens=100_000, no_eos=True)
            for i in range(long)
        ],
    }


async def short_requests_seconds(
    server: ServerProcess, *, short: int, long: int, short_tokens: int = 48
) -> float:
    """Seconds ``short`` requests take beside ``long`` ones on this server, now.

    The machine's pace: a grace period that must fit the short requests is a
    multiple of this, so the shutdown check holds on a busy machine too.
    """
    specs = _specs(short, long, short_tokens)
    limits = httpx.Limits(max_connections=short + long + 8)
    async with (
        httpx.AsyncClient(base_url=server.url, limits=limits, timeout=None) as http,
        trio.open_nursery() as nursery,
    ):
        for spec in specs["long"]:  # cancelled below: the client goes away
            nursery.start_soon(_one, http, spec, 600.0)
        start = time.perf_counter()
        async with trio.open_nursery() as shorts:
            for spec in specs["short"]:
                shorts.start_soon(_one, http, spec, 600.0)
        took = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return took


async def _requests_seen(http: httpx.AsyncClient) -> int:
    """Requests the engine has taken so far: those running, queued or parked, and
    those it has ended (``/metrics``)."""
    seen = 0
    for line in (await http.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("trio_mlx_engine_requests_total{") or name in (
            "trio_mlx_running_rows",
            "trio_mlx_queued_rows",
            "trio_mlx_parked_rows",
        ):
            seen += int(float(value))
    return seen


async def _signal_seen(server: ServerProcess, limit: float) -> None:
    """Wait until the server logs that it took the signal (it stops accepting then)."""
    with trio.move_on_after(limit):
        while "no new requests" not in server.log:  # noqa: ASYNC110 - another thread fills the log
            await trio.sleep(0.02)


async def _late_requests(server: ServerProcess, outcomes: Counter[str], limit: float) -> None:
    """Send requests on new connections until one is refused; count each outcome.

    The server closes its listener just after it logs the signal; on a busy
    machine that can take a moment, so a request may still get in first: it
    must then end cleanly (served, or a 503), never hang.
    """
    with trio.move_on_after(limit):
        while True:
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as late:
                outcome = await _one(late, Spec(chat=False, stream=False, max_tokens=2), _MARGIN)
            outcomes[outcome] += 1
            if outcome not in ("ok", "clean_error"):
                return
            await trio.sleep(0.05)


async def run_shutdown(
    server: ServerProcess, *, short: int, long: int, grace: float, short_tokens: int = 48
) -> dict[str, Any]:
    """``short`` requests that fit in the grace period, ``long`` ones that do not; then SIGTERM.

    A short request asks for ``short_tokens`` tokens, a long one for 100,000: it runs
    until the deadline, unless the model's context ends it first (serve
    ``long_context_model`` so that it cannot: a context-limited ``length`` counts as a
    bad answer here).
    """
    specs = _specs(short, long, short_tokens)
    outcomes: dict[str, Counter[str]] = {"short": Counter(), "long": Counter(), "late": Counter()}
    limits = httpx.Limits(max_connections=short + long + 8)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=None) as http:

        async def run(kind: str, spec: Spec) -> None:
            outcomes[kind][await _one(http, spec, grace + _MARGIN)] += 1

        async with trio.open_nursery() as nursery:
            for kind, group in specs.items():
                for spec in group:
                    nursery.start_soon(run, kind, spec)
            # Every request must have reached the engine before the signal: one
            # still in flight on the network when the server stops accepting is
            # a late request (refused, or its connection closed unread), not one
            # the grace period owes an answer.
            with trio.fail_after(60):
                while await _requests_seen(http) < short + long:  # noqa: ASYNC110 - polls the server
                    await trio.sleep(0.02)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.perf_counter()
            # After the server has taken the signal (a busy machine may take a while).
            await _signal_seen(server, grace)
            await _late_requests(server, outcomes["late"], grace)
        ended = time.perf_counter() - signalled
    try:
        code = await trio.to_thread.run_sync(lambda: server.process.wait(grace + _MARGIN))
    except Exception:
        server.process.kill()
        code = None
    exited = time.perf_counter() - signalled
    return {
        "grace_s": grace,
        "outcomes": {kind: dict(c) for kind, c in outcomes.items()},
        "short_all_ok": outcomes["short"]["ok"] == short,
        # Refused in the end, and whatever got in before that ended cleanly.
        "late_refused": outcomes["late"]["refused"] == 1
        and set(outcomes["late"]) <= {"refused", "ok", "clean_error"},
        "hung": sum(c["hung"] for c in outcomes.values()),
        "requests_ended_s": round(ended, 2),
        "exit_code": code,
        "exit_s": round(exited, 2),
    }
