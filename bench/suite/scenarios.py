"""The HTTP benchmarks, run against one server at a time.

Each function takes a running :class:`~bench.suite.servers.Server` and the
profile, drives load through :func:`~bench.suite.loadgen.run_clients`, and
returns a JSON-able summary. Every summary says how many requests failed and
whether every request produced exactly ``max_tokens`` tokens (from ``usage``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from bench.suite.loadgen import WORDS, run_clients, split_streams
from bench.suite.servers import Server
from bench.suite.timing import percentile


def _spec(server: Server, profile: dict[str, Any], **fields: Any) -> dict[str, Any]:
    spec = {
        "url": server.url,
        "model": server.model,
        "logit_bias": profile.get("logit_bias"),
        "prompt_words": profile["prompt_words"],
    }
    spec.update(fields)
    return spec


def _stats(records: Sequence[dict[str, Any]], max_tokens: int | None) -> dict[str, Any]:
    ok = [r for r in records if r.get("status") == 200 and "error" not in r]
    ttft = [r["first"] - r["start"] for r in ok if r.get("first")]
    latency = [r["end"] - r["start"] for r in ok]
    tokens = [r.get("tokens") or 0 for r in ok]
    out: dict[str, Any] = {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "tokens": sum(tokens),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
    }
    if max_tokens is not None:
        out["exact_tokens"] = bool(ok) and all(t == max_tokens for t in tokens)
    errors = sorted({str(r.get("error") or r.get("status")) for r in records if r not in ok})
    if errors:
        out["errors"] = errors[:5]
    out["retries"] = sum(r.get("retries", 0) for r in records)
    return out


def throughput(server: Server, profile: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """Closed-loop streaming chat at ``concurrency``: tok/s, TTFT and latency percentiles."""
    max_tokens = profile["max_tokens"]
    specs = [
        _spec(server, profile, mode="closed", streams=n, requests=profile["requests_per_stream"],
              max_tokens=max_tokens, seed=concurrency * 100 + i)
        for i, n in enumerate(split_streams(concurrency, profile["client_processes"]))
    ]  # fmt: skip
    cpu_before = server.cpu_seconds()
    results = run_clients(specs)
    server_cpu = server.cpu_seconds() - cpu_before
    records = [r for result in results for r in result["records"]]
    start = min(r["start"] for r in records)
    end = max(r["end"] for r in records)
    stats = _stats(records, max_tokens)
    wall = end - start
    stats.update(
        concurrency=concurrency,
        seconds=wall,
        tok_s=stats["tokens"] / wall,
        client_processes=len(specs),
        # Busiest client process's CPU use: near 1.0 would mean the clients limit the rate.
        client_cpu_max=max(r["cpu_s"] / r["wall_s"] for r in results),
        client_cpu_total=sum(r["cpu_s"] for r in results) / wall,
        server_cpu=server_cpu / wall,
    )
    return stats


def fairness(server: Server, profile: dict[str, Any]) -> dict[str, Any]:
    """Sustained batch rows plus a seeded (serial) request every few seconds, and the reverse."""
    f = profile["fairness"]
    batch = _spec(
        server,
        profile,
        role="batch",
        mode="closed",
        streams=f["batch_rows"],
        max_tokens=f["batch_max_tokens"],
        duration=f["duration"],
        seed=1,
    )
    serial = _spec(
        server,
        profile,
        role="serial",
        mode="periodic",
        interval=f["interval"],
        delay=f["interval"],
        duration=f["duration"],
        max_tokens=f["serial_max_tokens"],
        with_seed=True,
        seed=2,
    )
    forward = run_clients([batch, serial])
    # The reverse: a flood of serial jobs, and batch rows arriving now and then.
    flood = _spec(
        server,
        profile,
        role="serial",
        mode="closed",
        streams=f["flood_streams"],
        max_tokens=f["serial_max_tokens"],
        duration=f["duration"],
        with_seed=True,
        seed=3,
    )
    rows = _spec(
        server,
        profile,
        role="batch",
        mode="periodic",
        interval=f["interval"],
        delay=f["interval"],
        duration=f["duration"],
        max_tokens=f["serial_max_tokens"],
        seed=4,
    )
    reverse = run_clients([flood, rows])
    return {
        "serial_wait": _stats(forward[1]["records"], f["serial_max_tokens"]),
        "batch_during_serial_probe": _stats(forward[0]["records"], f["batch_max_tokens"]),
        "batch_wait_under_serial_flood": _stats(reverse[1]["records"], f["serial_max_tokens"]),
        "serial_flood": _stats(reverse[0]["records"], f["serial_max_tokens"]),
    }  # fmt: skip


def responsiveness(server: Server, profile: dict[str, Any]) -> dict[str, Any]:
    """``GET /health`` latency while idle, then under ``rows`` closed-loop streams."""
    r = profile["responsiveness"]
    probe = {"url": server.url, "mode": "probe", "interval": r["interval"]}
    idle = run_clients([{**probe, "duration": r["idle_duration"]}])[0]["records"]
    load = _spec(
        server,
        profile,
        role="load",
        mode="closed",
        streams=r["rows"],
        max_tokens=r["max_tokens"],
        # Rows are resubmitted until the probe ends, so it never sees an idle server.
        duration=r["delay"] + r["busy_duration"],
        seed=5,
    )
    busy_probe = {**probe, "duration": r["busy_duration"], "delay": r["delay"]}
    loaded = run_clients([load, busy_probe])
    busy = loaded[1]["records"]

    def latencies(records: list[dict[str, Any]]) -> dict[str, Any]:
        values = [x["end"] - x["start"] for x in records if x["status"] == 200]
        return {
            "probes": len(records),
            "failed": len(records) - len(values),
            "p50_s": percentile(values, 50),
            "p99_s": percentile(values, 99),
            "max_s": max(values, default=None),
        }

    return {"rows": r["rows"], "idle": latencies(idle), "busy": latencies(busy)}


def prompt_cache(server: Server, profile: dict[str, Any]) -> dict[str, Any]:
    """TTFT of a request sharing a long prefix with the one before it, vs a fresh prefix."""
    p = profile["prompt_cache"]
    out: dict[str, Any] = {"prefix_words": p["prefix_words"]}
    for lane, with_seed in (("batch", False), ("serial", True)):
        ttft: dict[str, list[float]] = {"cold": [], "warm": []}
        errors: set[str] = set()
        for trial in range(p["trials"]):
            # Plain words (one or two tokens each), led by a tag no other prefix shares.
            rng = random.Random(f"{lane}-{trial}")
            words = (rng.choice(WORDS) for _ in range(p["prefix_words"]))
            prefix = f"{lane} trial {trial}: " + " ".join(words) + "\n"
            for kind in ("cold", "warm"):
                spec = _spec(server, profile, mode="closed", streams=1, requests=1,
                             max_tokens=4, prefix=prefix, with_seed=with_seed,
                             seed=trial * 10 + (kind == "warm"))  # fmt: skip
                record = run_clients([spec])[0]["records"][0]
                if record.get("first"):
                    ttft[kind].append(record["first"] - record["start"])
                else:
                    errors.add(str(record.get("error") or record.get("status"))[:160])
        out[lane] = {
            "cold_ttft_p50_s": percentile(ttft["cold"], 50),
            "warm_ttft_p50_s": percentile(ttft["warm"], 50),
            "errors": sorted(errors),
        }
    return out
