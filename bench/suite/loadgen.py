"""The load generator: HTTP clients in processes of their own.

The parent (:func:`run_clients`) starts one process per client spec, waits until
every one has imported and connected, starts them together, and collects one
JSON document from each: per-request records and the process's CPU seconds, so
a report can show that the clients were not the bottleneck.

A spec's ``mode``:

* ``closed``: ``streams`` closed-loop streaming chat clients; each sends its next
  request when the last one ends, ``requests`` times or until ``duration`` s;
* ``periodic``: one request every ``interval`` s (not waiting for the last one)
  until ``duration`` s;
* ``probe``: ``GET path`` every ``interval`` s until ``duration`` s;
* ``schedule``: open loop, request ``i`` sent at ``schedule[i][0]`` s with
  ``schedule[i][1]`` prompt words and ``schedule[i][2]`` max_tokens.

With ``record_times`` each record also lists its content chunks' arrival times
(for inter-token latency).

Times are ``time.monotonic()``, which is one clock for every process of a machine.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Words the prompts are made of: plain English, so any BPE tokenizes them.
WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "while",
    "python",
    "threads",
    "wait",
    "for",
    "a",
    "lock",
    "and",
    "the",
    "scheduler",
    "runs",
    "every",
    "task",
    "in",
    "order",
    "until",
    "the",
    "queue",
    "is",
    "empty",
    "again",
)


def chat_body(spec: dict[str, Any], rng: random.Random, seed: int | None) -> dict[str, Any]:
    """A streaming chat request as the spec describes; a fresh random prompt each time."""
    prefix = spec.get("prefix", "")
    count = spec.get("prompt_words", 24)
    if spec.get("prompt_words_spread"):  # log-uniform between the two bounds
        lo, hi = spec["prompt_words_spread"]
        count = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    words = " ".join(rng.choice(WORDS) for _ in range(count))
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prefix + words}],
        "max_tokens": spec["max_tokens"],
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.get("model"):
        body["model"] = spec["model"]
    if spec.get("logit_bias"):
        body["logit_bias"] = spec["logit_bias"]
    if seed is not None:
        body["seed"] = seed
    return body


async def _sse_lines(response: Any) -> Any:
    """The response's lines, split at line feeds only.

    Not ``aiter_lines``: it also splits at U+2028, U+0085 and friends, which a
    server may legally send raw inside a JSON string.
    """
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if buffer:
        yield buffer.decode()


#: Attempts at a request that failed before any response (a refused or reset connection:
#: ``mlx_lm.server``'s listen backlog is 5), as a real client (``openai``) retries it.
ATTEMPTS = 5


async def _chat(client: Any, url: str, body: dict[str, Any], times: bool = False) -> dict[str, Any]:
    record: dict[str, Any] = {"start": time.monotonic(), "first": None, "tokens": None}
    if times:
        record["times"] = []
    record["retries"] = 0
    for attempt in range(ATTEMPTS):
        record.pop("error", None)
        if times:
            record["times"] = []
        try:
            await _stream_chat(client, url, body, record)
            break
        except Exception as exc:  # a failed request is a result, not a crash of the client
            record["error"] = f"{type(exc).__name__}: {exc}"
            if "status" in record or attempt == ATTEMPTS - 1:
                break
            record["retries"] += 1
            await _sleep(0.05 * (attempt + 1))
    record["end"] = time.monotonic()
    return record


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


async def _stream_chat(client: Any, url: str, body: dict[str, Any], record: dict[str, Any]) -> None:
    """Send one streaming chat request; fill in ``record`` as the stream goes."""
    record["chunks"] = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        record["status"] = response.status_code
        if response.status_code != 200:
            record["error"] = (await response.aread()).decode(errors="replace")[:300]
            return
        async for line in _sse_lines(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                record["tokens"] = data["usage"].get("completion_tokens")
            for choice in data.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    record["chunks"] += 1
                    if "times" in record:
                        record["times"].append(round(time.monotonic(), 5))
                    if record["first"] is None:
                        record["first"] = time.monotonic()


async def _closed(client: Any, spec: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    import asyncio

    records: list[dict[str, Any]] = []
    deadline = t0 + spec["duration"] if spec.get("duration") else None

    async def stream(index: int) -> None:
        rng = random.Random(spec.get("seed", 0) * 1000 + index)
        n = 0
        while (spec.get("requests") is None or n < spec["requests"]) and (
            deadline is None or time.monotonic() < deadline
        ):
            seed = n if spec.get("with_seed") else None
            body = chat_body(spec, rng, seed)
            record = await _chat(client, spec["url"], body, bool(spec.get("record_times")))
            record["stream"] = index
            records.append(record)
            n += 1

    await asyncio.gather(*(stream(i) for i in range(spec["streams"])))
    return records


async def _periodic(client: Any, spec: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    import asyncio

    records: list[dict[str, Any]] = []
    rng = random.Random(spec.get("seed", 0))
    tasks = []
    n = 0
    await asyncio.sleep(spec.get("delay", 0.0))
    while time.monotonic() < t0 + spec["duration"]:
        seed = n if spec.get("with_seed") else None
        body = chat_body(spec, rng, seed)

        async def one(body: dict[str, Any] = body) -> None:
            records.append(await _chat(client, spec["url"], body))

        tasks.append(asyncio.ensure_future(one()))
        n += 1
        await asyncio.sleep(spec["interval"])
    await asyncio.gather(*tasks)
    return records


async def _schedule(client: Any, spec: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    import asyncio

    records: list[dict[str, Any]] = []
    rng = random.Random(spec.get("seed", 0))

    async def one(index: int, at: float, words: int, max_tokens: int) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        body = chat_body({**spec, "prompt_words": words, "max_tokens": max_tokens}, rng, None)
        record = await _chat(client, spec["url"], body, bool(spec.get("record_times")))
        record.update(index=index, words=words, max_tokens=max_tokens)
        records.append(record)

    await asyncio.gather(*(one(i, *item) for i, item in enumerate(spec["schedule"])))
    return records


async def _probe(client: Any, spec: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    import asyncio

    records = []
    await asyncio.sleep(spec.get("delay", 0.0))
    while time.monotonic() < t0 + spec["duration"]:
        start = time.monotonic()
        try:
            response = await client.get(spec["url"] + spec.get("path", "/health"))
            status = response.status_code
        except Exception as exc:
            status = f"{type(exc).__name__}"
        records.append({"start": start, "end": time.monotonic(), "status": status})
        await asyncio.sleep(spec["interval"])
    return records


def client_main(spec: dict[str, Any]) -> None:
    """One client process: connect, say READY, wait for GO, run, print the records."""
    import asyncio

    import httpx

    started: list[Any] = []

    async def run() -> list[dict[str, Any]]:
        streams = spec.get("streams") or len(spec.get("schedule", ())) or 1
        limits = httpx.Limits(max_connections=streams + 64)
        timeout = httpx.Timeout(spec.get("timeout", 600.0))
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await client.get(spec["url"] + "/health")
            print("READY", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            t0 = time.monotonic()
            started.extend([t0, resource.getrusage(resource.RUSAGE_SELF)])
            modes = {
                "closed": _closed,
                "periodic": _periodic,
                "probe": _probe,
                "schedule": _schedule,
            }
            mode = modes[spec["mode"]]
            return await mode(client, spec, t0)

    records = asyncio.run(run())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    t0, before = started
    cpu = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
    out = {
        "role": spec.get("role", spec["mode"]),
        "records": records,
        # From GO to the end: the imports and the connection do not count.
        "cpu_s": cpu,
        "wall_s": time.monotonic() - t0,
    }
    print("RESULT " + json.dumps(out), flush=True)


def run_clients(specs: Sequence[dict[str, Any]], timeout: float = 900.0) -> list[dict[str, Any]]:
    """Run every spec in its own process, started together; return their results in order."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # clients load no model
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.suite.loadgen", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for spec in specs
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "READY":
                raise RuntimeError(f"a load client failed to start: {line!r}")
        go = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("GO\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if not lines:
                raise RuntimeError(f"a load client ended without a result (rc {proc.returncode})")
            result = json.loads(lines[-1][7:])
            result["go"] = go
            results.append(result)
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def split_streams(total: int, processes: int) -> list[int]:
    """``total`` streams over at most ``processes`` processes, as evenly as possible."""
    processes = max(1, min(total, processes))
    return [total // processes + (i < total % processes) for i in range(processes)]


if __name__ == "__main__":
    client_main(json.loads(sys.argv[1]))
