"""The continuous-traffic part: streams that come and go, as real clients do.

* closed loop: C streaming clients, each sending its next request when the last
  ends, for ``duration`` s, through every server;
* long arrivals: C - 1 closed-loop streams while long prompts arrive one at a
  time; the streams' inter-token latency while each is prefilled, against
  their median;
* open loop: Poisson arrivals at fractions of trio-mlx's measured capacity,
  prompt lengths drawn log-uniformly from a spread plus a few long prompts;
  inter-token latency of the running streams while a long prompt arrives;
* bare references in the same run: a bare ``BatchGenerator`` closed loop of C
  rows inserted (and finishing) together, and one whose rows finish staggered
  and are replaced at once.

Reported: tok/s (tokens whose chunk arrived inside the timed window), TTFT and
inter-token latency (ITL: the gap between a stream's consecutive content chunks,
divided by the tokens they carry) p50/p99, GPU busy % (``nvidia-smi``
sampled every 100 ms, where there is one), GPU memory (the server process's at
the end of the block, and the whole GPU's peak during it) and, for trio-mlx, the
MLX worker's busy fraction (``/metrics``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.suite.loadgen import run_clients, split_streams
from bench.suite.servers import Server
from bench.suite.timing import percentile


class GpuSampler:
    """``nvidia-smi`` utilization and memory samples while the block runs (None without a GPU)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.memory_mib: list[float] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        exe = shutil.which("nvidia-smi")
        if exe is not None:
            self._proc = subprocess.Popen(
                [
                    exe,
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "100",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with contextlib.suppress(ValueError, IndexError):
                busy, memory = (float(x) for x in line.split(",")[:2])
                self.samples.append(busy)
                self.memory_mib.append(memory)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def busy(self) -> float | None:
        """Mean utilization in percent."""
        return sum(self.samples) / len(self.samples) if self.samples else None

    @property
    def memory_peak_gib(self) -> float | None:
        """The most memory in use on the GPU (every process) in any sample, GiB."""
        return max(self.memory_mib) / 1024 if self.memory_mib else None


def process_gpu_gib(pid: int) -> float | None:
    """GPU memory ``pid`` holds now (``nvidia-smi``'s compute apps), GiB; None if not listed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    held = [
        float(used) for app, _, used in (line.partition(",") for line in text.splitlines())
        if app.strip() == str(pid) and used.strip().replace(".", "", 1).isdigit()
    ]  # fmt: skip
    return sum(held) / 1024 if held else None


def _metric(server: Server, name: str) -> float | None:
    import httpx

    try:
        text = httpx.get(server.url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    match = re.search(rf"^{name}(?:_total)?\s+([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def summarize(records: Sequence[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Rates and latencies of ``records``; tokens count when their chunk arrived in [t0, t1]."""
    ok = [r for r in records if r.get("status") == 200 and "error" not in r]
    ttft = [r["first"] - r["start"] for r in ok if r.get("first")]
    itl: list[float] = []
    tokens = 0.0
    for r in ok:
        times = r.get("times") or []
        per_chunk = (r.get("tokens") or 0) / len(times) if times else 0.0
        tokens += per_chunk * sum(1 for t in times if t0 <= t <= t1)
        itl.extend((b - a) / per_chunk for a, b in itertools.pairwise(times) if per_chunk)
    bad = sorted({str(r.get("error") or r.get("status"))[:200] for r in records if r not in ok})
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": bad[:5],
        "tok_s": tokens / (t1 - t0) if t1 > t0 else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
    }


def _measure(
    server: Server, specs: list[dict[str, Any]], window: tuple[float, float]
) -> dict[str, Any]:
    """Run the client specs against ``server``; tokens count inside ``window`` (s after GO)."""
    busy0, steps0 = (
        _metric(server, "trio_mlx_worker_busy_seconds"),
        _metric(server, "trio_mlx_steps"),
    )
    adm0 = _metric(server, "trio_mlx_admissions")
    with GpuSampler() as gpu:
        results = run_clients(specs)
    records = [r for result in results for r in result["records"]]
    go = results[0]["go"]
    wall = max(result["wall_s"] for result in results)
    out = summarize(records, go + window[0], go + min(window[1], wall))
    out["gpu_busy_pct"] = gpu.busy
    out["gpu_memory_peak_gib"] = gpu.memory_peak_gib
    out["server_gpu_gib"] = process_gpu_gib(server.process.pid)
    busy1 = _metric(server, "trio_mlx_worker_busy_seconds")
    if busy0 is not None and busy1 is not None:
        out["worker_busy"] = (busy1 - busy0) / wall
        steps1, adm1 = _metric(server, "trio_mlx_steps"), _metric(server, "trio_mlx_admissions")
        out["steps"] = steps1 - steps0 if steps1 is not None and steps0 is not None else None
        out["admissions"] = adm1 - adm0 if adm1 is not None and adm0 is not None else None
    out["_records"] = records
    out["_go"] = go
    return out


def closed(server: Server, p: dict[str, Any], c: int, *, mixed: bool = False) -> dict[str, Any]:
    """C closed-loop streaming clients for ``duration`` s; the first ``warm`` s are not timed.

    ``mixed``: prompt lengths from the open loop's spread (its capacity), else ``prompt_words``.
    """
    t = p["traffic"]
    specs = [
        {"url": server.url, "model": server.model, "logit_bias": p.get("logit_bias"),
         "prompt_words": p["prompt_words"], "mode": "closed", "streams": n,
         "duration": t["duration"], "max_tokens": t["max_tokens"], "seed": c * 100 + i,
         "record_times": True,
         "prompt_words_spread": t["prompt_words_spread"] if mixed else None}
        for i, n in enumerate(split_streams(c, p["client_processes"]))
    ]  # fmt: skip
    out = _measure(server, specs, (t["warm"], t["duration"]))
    records = out.pop("_records")
    out.pop("_go")
    out["exact_tokens"] = all(
        r.get("tokens") == t["max_tokens"] for r in records if r.get("status") == 200
    )
    out["concurrency"] = c
    # Requests completed per second: with ``mixed``, the open loop's capacity.
    done = [r for r in records if r.get("status") == 200 and "error" not in r]
    span = max(r["end"] for r in done) - min(r["start"] for r in done) if done else 0.0
    out["req_s"] = len(done) / span if span > 0 else None
    return out


def schedule(p: dict[str, Any], rate: float, seed: int) -> list[list[Any]]:
    """Poisson arrivals at ``rate``/s for ``duration`` s: [offset, prompt words, max_tokens]."""
    t = p["traffic"]
    rng = random.Random(seed)
    lo, hi = t["prompt_words_spread"]
    items, at = [], 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= t["open_duration"]:
            break
        words = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        items.append([round(at, 4), words, t["max_tokens"]])
    # A few long prompts, spread over the middle of the run.
    for k in range(t["long_prompts"]):
        at = t["open_duration"] * (k + 1) / (t["long_prompts"] + 1)
        items.append([round(at, 4), t["long_words"], t["max_tokens"]])
    return sorted(items)


def open_loop(server: Server, p: dict[str, Any], rate: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals; also the ITL of other streams while each long prompt is prefilled."""
    t = p["traffic"]
    items = schedule(p, rate, seed)
    procs = max(1, min(p["client_processes"], len(items)))
    specs = [
        {"url": server.url, "model": server.model, "logit_bias": p.get("logit_bias"),
         "mode": "schedule", "schedule": items[i::procs], "seed": seed + i, "record_times": True,
         "timeout": 300.0}
        for i in range(procs)
    ]  # fmt: skip
    out = _measure(server, specs, (0.0, t["open_duration"]))
    records = out.pop("_records")
    out.pop("_go")
    long = [r for r in records if r.get("words") == t["long_words"] and r.get("first")]
    during = _during(records, long)
    out["itl_during_long_p50_s"] = percentile(during, 50)
    out["itl_during_long_p99_s"] = percentile(during, 99)
    out["long_ttft_s"] = [lr["first"] - lr["start"] for lr in long]
    out["rate"] = rate
    out["arrivals"] = len(items)
    out["exact_tokens"] = all(
        r.get("tokens") == t["max_tokens"] for r in records if r.get("status") == 200
    )
    return out


def _during(records: Sequence[dict[str, Any]], long: Sequence[dict[str, Any]]) -> list[float]:
    """Per-token gaps of the other streams that overlap a long prompt's wait for its first token."""
    during: list[float] = []
    for lr in long:
        for r in records:
            if r is lr or not r.get("times"):
                continue
            per_chunk = (r.get("tokens") or 0) / len(r["times"])
            during.extend(
                (b - a) / per_chunk
                for a, b in itertools.pairwise(r["times"])
                if per_chunk and b > lr["start"] and a < lr["first"]
            )
    return during


def long_arrival(server: Server, p: dict[str, Any], c: int) -> dict[str, Any]:
    """C - 1 closed-loop streams, and ``long_prompts`` long prompts arriving one at a time.

    The latency goal: the running streams' inter-token latency p99
    while a long prompt is prefilled (from its arrival to its first token)
    at most 3x their median over the whole window.
    """
    t = p["traffic"]
    n, start, end = t["long_prompts"], t["warm"], t["duration"]
    offsets = [round(start + (end - start) * k / (n + 1), 3) for k in range(1, n + 1)]
    specs = [
        {"url": server.url, "model": server.model, "logit_bias": p.get("logit_bias"),
         "prompt_words": p["prompt_words"], "mode": "closed", "streams": k,
         "duration": end, "max_tokens": t["max_tokens"], "seed": 7000 + i, "record_times": True}
        for i, k in enumerate(split_streams(max(1, c - 1), max(1, p["client_processes"] - 1)))
    ]  # fmt: skip
    specs.append(
        {"url": server.url, "model": server.model, "logit_bias": p.get("logit_bias"),
         "mode": "schedule", "schedule": [[at, t["long_words"], t["max_tokens"]] for at in offsets],
         "seed": 7999, "record_times": True, "timeout": 300.0}
    )  # fmt: skip
    mark = server.log_size()
    out = _measure(server, specs, (start, end))
    # trio-mlx logs each decode step, or removal and admission, of 0.5 s or more with
    # what it carried (at most one line per 10 s): what a long prompt's worst stall
    # was, when it had one.
    out["slow_steps"] = [
        line[line.index(kind) :]
        for line in server.log_lines(mark, "trio_mlx")
        for kind in ("slow decode step: ", "slow admission: ")
        if kind in line
    ]
    records = out.pop("_records")
    out.pop("_go")
    long = [r for r in records if r.get("words") == t["long_words"] and r.get("first")]
    during = _during(records, long)
    out["itl_during_long_p50_s"] = percentile(during, 50)
    out["itl_during_long_p99_s"] = percentile(during, 99)
    base = out["itl_p50_s"]
    p99 = out["itl_during_long_p99_s"]
    out["during_p99_over_p50"] = p99 / base if p99 is not None and base else None
    out["long_ttft_s"] = [lr["first"] - lr["start"] for lr in long]
    out["long_arrivals"] = len(offsets)
    out["concurrency"] = c
    return out


def bare(job: dict[str, Any], env: dict[str, str], log: Any) -> dict[str, Any]:
    """The bare closed-loop references (``inproc`` job ``closed``), GPU sampled per run."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "bench.suite.inproc", json.dumps(job)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    assert proc.stdout is not None
    out: dict[str, Any] = {}
    sampler: GpuSampler | None = None
    busy: dict[str, float | None] = {}
    for line in proc.stdout:
        if line.startswith("SAMPLE start"):
            sampler = GpuSampler().__enter__()
        elif line.startswith("SAMPLE stop") and sampler is not None:
            sampler.__exit__()
            _, _, kind, b = line.split()
            busy[f"{kind}:{b}"] = sampler.busy
            sampler = None
        elif line.startswith("RESULT "):
            record = json.loads(line[7:])
            b = record["batch"]
            for kind in ("together", "staggered"):
                record[kind]["gpu_busy_pct"] = busy.get(f"{kind}:{b}")
            out[str(b)] = record
            log(f"  bare C={b}: together {record['together']['tok_s']:,.0f} tok/s, "
                f"staggered {record['staggered']['tok_s']:,.0f} tok/s")  # fmt: skip
    proc.wait()
    return out
