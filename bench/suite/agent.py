"""Part 10: what an agent's user waits for, turn after turn.

An agent session (:mod:`bench.suite.agent_trace`) is replayed against a server,
one streaming chat request per turn, each waiting for the last: per turn, the
time to the first token (from the request's start to the first delta that
carries text, reasoning or a tool call), the prompt's tokens, the tokens the
server says it served from its prompt cache, and so the tokens it prefilled.

Cached tokens come from the answer's ``usage.prompt_tokens_details.cached_tokens``
(both servers send it with ``stream_options.include_usage``); where a server leaves
it out, from the growth of a prompt-cache hit counter on its ``/metrics``; else
they are recorded as null, never guessed.

:func:`summarize` sets the numbers against the goals: every turn after the first
finds at least 0.95 of the turn before's prompt in the cache, and trio-mlx's TTFT
summed over turns 2.. is no worse than ``mlx_lm.server``'s. :func:`restart_summary`
the disk tier's: after a restart on the same ``--prompt-cache-dir``, the last
turn's first token comes at least 5x sooner than a cold prefill's.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.suite.agent_trace import AgentSize, Session, build_session
from bench.suite.models import Model
from bench.suite.servers import Server, mlx_lm_server, trio_mlx_server

__all__ = [
    "CACHED_GOAL",
    "RESTART_GOAL",
    "replay",
    "restart_summary",
    "run_model",
    "send_turn",
    "summarize",
    "warm",
]

#: Each turn after the first must find this share of the previous turn's prompt cached.
CACHED_GOAL = 0.95
#: After a restart, the last turn from the disk tier must be this much faster than cold.
RESTART_GOAL = 5.0

#: ``/metrics`` counters of prompt tokens served from the prompt cache (any tier).
_HIT_COUNTER = re.compile(
    r"^trio_mlx_prompt_cache_\w*(?:hit|cached|reused)\w*tokens\w*(?:\{[^}]*\})?\s+([0-9.eE+-]+)$",
    re.MULTILINE,
)


def _delta_has_output(delta: dict[str, Any]) -> bool:
    return any(
        delta.get(key) for key in ("content", "reasoning_content", "reasoning", "tool_calls")
    )


def send_turn(
    url: str,
    messages: Sequence[dict[str, Any]],
    *,
    model: str | None,
    max_tokens: int,
    logit_bias: dict[str, float] | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """One streaming chat request; its TTFT, latency, usage and the text generated."""
    import httpx

    body: dict[str, Any] = {
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if logit_bias:
        body["logit_bias"] = logit_bias
    record: dict[str, Any] = {"ttft_s": None, "usage": None, "text": ""}
    start = time.perf_counter()
    with (
        httpx.Client(timeout=timeout) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as response,
    ):
        if response.status_code != 200:
            detail = response.read().decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                record["usage"] = data["usage"]
            for choice in data.get("choices") or ():
                delta = choice.get("delta") or {}
                if record["ttft_s"] is None and _delta_has_output(delta):
                    record["ttft_s"] = time.perf_counter() - start
                record["text"] += delta.get("content") or ""
    record["latency_s"] = time.perf_counter() - start
    return record


def cache_hits(url: str) -> float | None:
    """The server's prompt-cache hit tokens so far (``/metrics``), or None if it counts none."""
    import httpx

    try:
        response = httpx.get(url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = [float(v) for v in _HIT_COUNTER.findall(response.text)]
    return sum(values) if values else None


def warm(url: str, *, model: str | None, logit_bias: dict[str, float] | None = None) -> None:
    """One short request unrelated to the session: the first request's one-off costs go here."""
    messages = [{"role": "user", "content": "Warm up: say something short."}]
    send_turn(url, messages, model=model, max_tokens=4, logit_bias=logit_bias)


def _turn_record(
    turn: int, sent: dict[str, Any], hits: tuple[float | None, float | None], previous: int | None
) -> dict[str, Any]:
    usage = sent["usage"] or {}
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    source = "usage" if cached is not None else None
    before, after = hits
    if cached is None and before is not None and after is not None:
        cached, source = int(after - before), "metrics"
    return {
        "turn": turn,
        "ttft_s": sent["ttft_s"],
        "latency_s": sent["latency_s"],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_source": source,
        "prefilled_tokens": prompt - cached if prompt is not None and cached is not None else None,
        "completion_tokens": usage.get("completion_tokens"),
        "previous_prompt_tokens": previous,
        "cached_of_previous": cached / previous if cached is not None and previous else None,
    }


def replay(
    url: str,
    session: Session,
    *,
    model: str | None,
    max_tokens: int,
    logit_bias: dict[str, float] | None = None,
    turns: Sequence[int] | None = None,
    log: Any = None,
) -> list[dict[str, Any]]:
    """Send ``turns`` (default: all, 1-based) of ``session`` in order; one record per turn."""
    records: list[dict[str, Any]] = []
    previous: int | None = None
    for turn in turns or range(1, session.turns + 1):
        before = cache_hits(url)
        sent = send_turn(
            url, session.messages(turn), model=model, max_tokens=max_tokens, logit_bias=logit_bias
        )
        after = cache_hits(url) if before is not None else None
        record = _turn_record(turn, sent, (before, after), previous)
        records.append(record)
        previous = record["prompt_tokens"]
        if log is not None:
            log(
                f"    turn {turn}: TTFT {_ms(record['ttft_s'])} ms, prompt "
                f"{record['prompt_tokens']}, cached {record['cached_tokens']}, prefilled "
                f"{record['prefilled_tokens']}"
            )
    return records


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def summarize(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One server's session: TTFT over turns 2.., the worst cached share, the goal met or not."""
    later = [t for t in turns if t["turn"] > 1]
    ttfts = [t["ttft_s"] for t in later]
    shares = [t["cached_of_previous"] for t in later]
    known = [s for s in shares if s is not None]
    return {
        "turns": len(turns),
        "first_ttft_s": turns[0]["ttft_s"] if turns else None,
        "ttft_sum_later_s": sum(ttfts) if ttfts and None not in ttfts else None,
        "prompt_tokens_last": turns[-1]["prompt_tokens"] if turns else None,
        "prefilled_sum_later": _sum_or_none(t["prefilled_tokens"] for t in later),
        "cached_of_previous_min": min(known) if known and len(known) == len(shares) else None,
        "cached_goal_met": (
            all(s >= CACHED_GOAL for s in known) if known and len(known) == len(shares) else None
        ),
    }


def _sum_or_none(values: Any) -> int | None:
    values = list(values)
    return None if not values or None in values else int(sum(values))


def restart_summary(disk: dict[str, Any] | None, cold: dict[str, Any] | None) -> dict[str, Any]:
    """The last turn after a restart on the disk tier against a cold prefill of it."""
    out: dict[str, Any] = {"disk": disk, "cold": cold, "cold_over_disk": None, "goal_met": None}
    if disk and cold and disk.get("ttft_s") and cold.get("ttft_s"):
        out["cold_over_disk"] = cold["ttft_s"] / disk["ttft_s"]
        out["goal_met"] = out["cold_over_disk"] >= RESTART_GOAL
    return out


#: The server flag of the prompt cache's disk tier.
CACHE_DIR_FLAG = "--prompt-cache-dir"
#: Rows each server decodes together: one session needs one; trio-mlx wants two or more.
_MAX_BATCH = 4


def run_model(
    model: Model,
    size: AgentSize,
    *,
    env: dict[str, str],
    log_dir: Path,
    log: Callable[[str], None],
    disk_tier: bool,
    mlx_lm: bool = True,
) -> dict[str, Any]:
    """The session on ``model``: trio-mlx, the restart on its disk tier, then ``mlx_lm.server``.

    Each server runs alone (one up at a time). trio-mlx runs with a fresh
    ``--prompt-cache-dir`` when ``disk_tier`` (the flag exists), so the restart
    finds what the session stored; the cold reference is a server without one.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    session = build_session(load_tokenizer(model.path), size)
    bias = {str(k): v for k, v in (model.logit_bias or {}).items()} or None
    out: dict[str, Any] = {"servers": {}, "restart": None, "errors": []}

    def session_on(name: str, server: Server) -> None:
        log(f"  {name}: {session.turns} turns")
        warm(server.url, model=server.model, logit_bias=bias)
        turns = replay(server.url, session, model=server.model, max_tokens=size.max_tokens,
                       logit_bias=bias, log=log)  # fmt: skip
        out["servers"][name] = {"turns": turns, "summary": summarize(turns)}

    store = Path(tempfile.mkdtemp(prefix="trio-mlx-agent-pcache-"))
    try:
        disk = [CACHE_DIR_FLAG, str(store)] if disk_tier else []
        starters: list[tuple[str, Callable[[], Any]]] = [
            ("trio-mlx", lambda: trio_mlx_server(model.path, max_batch=_MAX_BATCH, env=env,
                                                 log_dir=log_dir, extra=disk)),
        ]  # fmt: skip
        if mlx_lm:
            starters.append(("mlx_lm.server", lambda: mlx_lm_server(
                model.path, max_batch=_MAX_BATCH, env=env, log_dir=log_dir)))  # fmt: skip
        for name, start in starters:
            try:
                with start() as server:
                    session_on(name, server)
            except Exception as exc:  # one server failing must not lose the other
                out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                log(f"  not run: {name} on {model.name}: {type(exc).__name__}: {exc}")
            if name == "trio-mlx" and disk_tier and name in out["servers"]:
                out["restart"] = _restart(model, session, size, env, log_dir, log, disk, bias)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return out


def _restart(
    model: Model,
    session: Session,
    size: AgentSize,
    env: dict[str, str],
    log_dir: Path,
    log: Callable[[str], None],
    disk: list[str],
    bias: dict[str, float] | None,
) -> dict[str, Any]:
    """The last turn on a restarted server (same cache dir) and on one without a cache dir."""
    last = [session.turns]
    runs: dict[str, dict[str, Any] | None] = {}
    for kind, extra in (("disk", disk), ("cold", [])):
        log(f"  trio-mlx restarted ({kind}): turn {session.turns}")
        with trio_mlx_server(model.path, max_batch=_MAX_BATCH, env=env,
                             log_dir=log_dir / f"restart-{kind}", extra=extra) as server:  # fmt: skip
            warm(server.url, model=server.model, logit_bias=bias)
            (runs[kind],) = replay(server.url, session, model=server.model,
                                   max_tokens=size.max_tokens, logit_bias=bias, turns=last,
                                   log=log)  # fmt: skip
    return restart_summary(runs["disk"], runs["cold"])
