"""``python -m soak``: every scenario, a summary table, a JSON report.

Bounded in count and time: ``--quick`` divides the counts by ten. Exit status
1 when any scenario misses the bar (the table says which), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

import trio_mlx
from soak import hostile, security, world
from soak._server import ServerProcess, serve
from soak.faults import run_faults
from soak.load import run_load
from soak.shutdown import long_context_model, run_shutdown, short_requests_seconds
from soak.storm import run_storm


def _scale(args: argparse.Namespace, full: int) -> int:
    return max(1, full // 10) if args.quick else full


def _mb(value: int) -> float:
    return round(value / 2**20, 1)


def load_and_storm(args: argparse.Namespace, adapters: Path) -> dict[str, Any]:
    """Load, then the disconnect storm, on one server; RSS taken after a warm-up."""
    with serve("--adapter-dir", str(adapters), "--max-queue", "256") as server:
        trio.run(lambda: run_load(server.url, requests=64, concurrency=16, seed=99))
        baseline = server.rss_bytes()
        load = trio.run(
            lambda: run_load(
                server.url,
                requests=_scale(args, 2000),
                concurrency=64,
                seed=args.seed,
                rss=server.rss_bytes,
            )
        )
        storm = trio.run(
            lambda: run_storm(
                server.url,
                clients=_scale(args, 500),
                concurrency=64,
                seed=args.seed,
                rss=server.rss_bytes,
            )
        )
        storm["rss_baseline_mb"] = _mb(baseline)
        storm["rss_growth_since_warmup_mb"] = _mb(server.rss_bytes() - baseline)
    return {"load": load, "storm": storm}


@contextmanager
def _restarting(*flags: str) -> Iterator[Callable[[], ServerProcess]]:
    """A server that comes back after a crash; the callable returns the live one."""
    current: list[Any] = []

    def live() -> ServerProcess:
        if current and current[-1][1].process.poll() is None:
            return current[-1][1]  # type: ignore[no-any-return]
        context = serve(*flags)
        current.append((context, context.__enter__()))
        return current[-1][1]  # type: ignore[no-any-return]

    try:
        yield live
    finally:
        for context, _server in current:
            context.__exit__(None, None, None)


def hostile_input(args: argparse.Namespace) -> dict[str, Any]:
    """Hand-picked cases one by one (a crash is recorded and the server restarted), then fuzzers."""
    report: dict[str, Any] = {}
    crashes: list[str] = []
    with _restarting("--max-tokens", "4") as live:
        picked = hostile.Tally()
        for case in hostile.CASES:
            server = live()
            hostile.run_case(server.url, picked, case)
            time.sleep(0.05)
            if server.process.poll() is not None:
                crashes.append(f"{case[0]}: exit {server.process.returncode}")
        report["hand_picked"] = hostile.summary(picked)
        for name, run in [
            ("hypothesis", lambda url: hostile.run_hypothesis(url, _scale(args, 1000))),
            ("schemathesis", lambda url: hostile.run_schemathesis(url, _scale(args, 50))),
        ]:
            server = live()
            report[name] = hostile.summary(run(server.url))
            if server.process.poll() is not None:
                crashes.append(f"{name}: exit {server.process.returncode}")
        server = live()
        healthy = httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    parts = [report[k] for k in ("hand_picked", "hypothesis", "schemathesis")]
    report.update(
        cases=sum(p["cases"] for p in parts),
        server_errors=sum(p["5xx"] for p in parts),
        transport_errors=sum(p["statuses"].get("transport_error", 0) for p in parts),
        crashes=crashes,
        healthy_after=healthy,
    )
    return report


def security_checks(root: Path) -> dict[str, Any]:
    """API key, adapter paths, body limit, default bind."""
    report: dict[str, Any] = {"bind": security.default_bind()}
    with serve("--api-key", "soak-key") as server:
        report["api_key"] = security.check_api_key(server.url, "soak-key")
        report["early_answers"] = security.check_early_answers(server.url, 2000)
    inside, outside = security.prepare_adapter_dir(root, trio_mlx.default_adapter_path("shout"))
    with serve("--adapter-dir", str(inside), "--max-body-bytes", "100000") as server:
        report["bind"]["served_on"] = server.url
        report["adapter_paths"] = security.check_adapter_paths(server.url, outside)
        report["body_limit"] = security.check_body_limit(server.url, 100_000)
    return report


def shutdown_check(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """SIGTERM under load: 32 requests that fit in the grace period, 4 that cannot.

    The grace is 10 s, or 3x what the 32 take on this machine now when that is
    more (a loaded machine is several times slower; the check is that what fits
    in the grace finishes, not how fast the machine is). The server runs the
    bundled model with its context raised, so the 4 cannot end at the context's
    end before the deadline however fast the machine is.
    """
    short = 16 if args.quick else 32
    model = long_context_model(root)
    with serve(model=model) as probe:
        pace = trio.run(lambda: short_requests_seconds(probe, short=short, long=4))
    grace = round(max(10.0, 3 * pace), 1)
    with serve("--graceful-timeout", str(grace), model=model) as server:
        report = trio.run(lambda: run_shutdown(server, short=short, long=4, grace=grace))
    return {**report, "pace_s": round(pace, 2)}


def verdicts(report: dict[str, Any]) -> dict[str, bool]:
    """Whether each scenario meets the bar."""
    load, storm, faults = report["load"], report["storm"], report["faults"]
    hostile_, sec, down = report["hostile"], report["security"], report["shutdown"]
    return {
        "load": load["lost"] == load["duplicated"] == load["failed"] == load["churn_5xx"] == 0
        and load["health_after"] == 200,
        "storm": storm["rows_left"] == 0 and storm["health_after"] == 200,
        "faults": not faults["flaky"]["unclean"]
        and faults["flaky"]["serving_after"]
        and faults["worker_death"]["all_ended_503"]
        and faults["worker_death"]["health_after_death"] == 503,
        "hostile": hostile_["server_errors"] == 0
        and not hostile_["crashes"]
        and hostile_["transport_errors"] == 0
        and hostile_["healthy_after"],
        "security": not sec["api_key"]["leaks"]
        and not sec["api_key"]["hung"]
        and sec["early_answers"]["hung"] == 0
        and sec["api_key"]["health_without_key"] == 200
        and not sec["adapter_paths"]["escaped"]
        and sec["body_limit"]["status"] == 413
        and not sec["body_limit"]["read_whole"]
        and sec["bind"]["default_host"] == "127.0.0.1",
        "shutdown": down["short_all_ok"]
        and down["late_refused"]
        and down["hung"] == 0
        and down["exit_code"] == 0,
        **world_verdicts(report["world"]),
    }


def world_verdicts(w: dict[str, Any]) -> dict[str, bool]:
    """The hostile-world scenarios' bars."""
    flood, early, readers = w["idle_flood"], w["early_404"], w["stalled_readers"]
    stalls = {k: v for k, v in w["stalls"].items() if "health_p99_ms" in v}
    return {
        "idle connections": set(flood["statuses"]) <= {"200", "503"}
        and flood["still_held_after_10s"] == 0
        and flood["new_connection_after"] == "200",
        "early answers": early["closed_by_server_in_3s"] == early["connections"],
        "event-loop stalls": all(
            v["health_p99_ms"] is not None and v["health_p99_ms"] < 100 for v in stalls.values()
        ),
        "stalled readers": readers["rows_freed_after_s"] is not None
        and readers["exit_code"] == 0
        and readers["tracebacks_in_log"] == 0,
        "adapter churn": not w["adapters"]["base_changed_after"]
        and not any(": 5" in k for k in w["adapters"]["statuses"])
        and not any(
            k.startswith(("mount b-only: 2", "mount huge-scale: 2"))
            for k in w["adapters"]["statuses"]
        ),
        "context overflow": w["context"]["status"] == 200
        and w["context"]["prompt_tokens"] + w["context"]["completion_tokens"]
        <= w["context"]["context"],
    }


def world_rows(w: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The hostile-world rows of the table."""
    flood, early, readers, ctx = w["idle_flood"], w["early_404"], w["stalled_readers"], w["context"]
    stalls = {k: v for k, v in w["stalls"].items() if "health_p99_ms" in v}
    churn = w["adapters"]
    return [
        ("idle connections", f"{flood['connections']} conns", _fmt(flood["statuses"]), "-", "-",
         "-", "-", f"server held {flood['server_fds_held']} fds; still open 10 s later "
         f"{flood['still_held_after_10s']}; /health p99 {flood['health_p99_ms']} ms; new "
         f"connection after: {flood['new_connection_after']}"),
        ("early answers", f"{early['connections']} conns", _fmt(early["statuses"]), "-", "-",
         "-", "-", f"closed by the server within 3 s: {early['closed_by_server_in_3s']}"),
        ("event-loop stalls", f"{len(stalls)} bodies <= 4 MiB",
         ", ".join(f"{k} {v['status']} in {v['answer_s']} s" for k, v in stalls.items()),
         "-", "-", "-", f"{max(v['rss_kept_mb'] for v in stalls.values())} MB",
         "/health p99 " + ", ".join(f"{v['health_p99_ms']} ms" for v in stalls.values())),
        ("stalled readers", f"{readers['readers']} x n={readers['choices_each']}", "-", "-",
         "-", "-", f"{readers['rss_growth_mb']} MB",
         f"rows freed after {readers['rows_freed_after_s']} s; /health p99 "
         f"{readers['health_p99_ms']} ms; SIGTERM: exit {readers['exit_code']} after "
         f"{readers['exit_after_sigterm_s']} s, tracebacks {readers['tracebacks_in_log']}"),
        ("adapter churn", f"{churn['rounds']} rounds", _fmt(churn["statuses"]), "-", "-", "-",
         "-", f"base changed after: {', '.join(churn['base_changed_after']) or 'never'}"),
        ("context overflow", "1 req", f"{ctx['status']} {ctx['finish_reason']}", "-", "-", "-",
         "-", f"prompt {ctx['prompt_tokens']} + completion {ctx['completion_tokens']} of "
         f"{ctx['context']}; X-Max-Tokens-Clamped {ctx['header']}"),
    ]  # fmt: skip


def table(report: dict[str, Any]) -> str:
    """The summary table (Markdown)."""
    load, storm, faults = report["load"], report["storm"], report["faults"]
    hostile_, sec, down = report["hostile"], report["security"], report["shutdown"]
    ok = report["verdicts"]
    lat = load["latency"]
    flaky, death = faults["flaky"], faults["worker_death"]

    def mark(name: str) -> str:
        return "PASS" if ok[name] else "**FAIL**"

    rows = [
        ("load", f"{load['requests']} req, c=64", _fmt(load["outcomes"]), load["lost"],
         load["duplicated"], "-", f"{load['rss_growth_mb']} MB",
         f"{load['req_per_s']} req/s, {load['tok_per_s']} tok/s, p50 {lat['p50_ms']} ms, "
         f"p99 {lat['p99_ms']} ms; churn {_fmt(load['adapter_churn'])}"),
        ("disconnect storm", f"{storm['clients']} streams", _fmt(storm["modes"]),
         storm["rows_left"], "-", "-", f"{storm['rss_growth_mb']} MB",
         f"rows left {_fmt(storm['left'])}; settled in {storm['settle_seconds']} s; "
         f"at hang-up {_fmt(storm['states_at_hangup'])}"),
        ("faults", f"{flaky['requests']} req + {death['pending']} pending",
         f"{_fmt(flaky['outcomes'])}; death: {_fmt(death['outcomes'])}",
         len(flaky["unclean"]), "-", "-", "-",
         f"injected {_fmt(flaky['injected'])}; /health after death {death['health_after_death']}"),
        ("hostile input", f"{hostile_['cases']} cases", _fmt(_merge(hostile_)), "-", "-",
         hostile_["server_errors"], "-",
         f"hand-picked {hostile_['hand_picked']['cases']}, Hypothesis "
         f"{hostile_['hypothesis']['cases']}, schemathesis {hostile_['schemathesis']['cases']}; "
         f"crashes: {'; '.join(hostile_['crashes']) or 'none'}"),
        ("security", f"{sec['api_key']['routes_checked'] + sec['early_answers']['requests'] + sec['adapter_paths']['attempts'] + 2} checks",
         f"leaks {len(sec['api_key']['leaks'])}, escapes {len(sec['adapter_paths']['escaped'])}",
         "-", "-", "-", "-",
         f"413 after {sec['body_limit']['sent_before_answer']} of {sec['body_limit']['declared']} "
         f"bytes; bind {sec['bind']['default_host']}; 401s that hung: "
         f"{len(sec['api_key']['hung']) + sec['early_answers']['hung']} of "
         f"{sec['api_key']['routes_checked'] + sec['early_answers']['requests']}"),
        ("shutdown (SIGTERM)", f"{sum(sum(c.values()) for c in down['outcomes'].values())} req",
         "; ".join(f"{k}: {_fmt(v)}" for k, v in down["outcomes"].items()), down["hung"], "-",
         "-", "-", f"exit {down['exit_code']} after {down['exit_s']} s (grace {down['grace_s']} s)"),
    ]  # fmt: skip
    rows += world_rows(report["world"])
    head = ("scenario", "size", "outcomes", "lost", "duplicated", "5xx on bad input", "RSS growth",
            "notes")  # fmt: skip
    lines = ["| verdict | " + " | ".join(head) + " |", "|" + " --- |" * (len(head) + 1)]
    for row in rows:
        lines.append(f"| {mark(_key(row[0]))} | " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def _key(scenario: str) -> str:
    return {"disconnect storm": "storm", "hostile input": "hostile",
            "shutdown (SIGTERM)": "shutdown"}.get(scenario, scenario)  # fmt: skip


def _fmt(counts: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in counts.items()
    )


def _merge(hostile_: dict[str, Any]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for part in ("hand_picked", "hypothesis", "schemathesis"):
        for status, count in hostile_[part]["statuses"].items():
            merged[status] = merged.get(status, 0) + count
    return dict(sorted(merged.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tenth of every count")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--json", type=Path, default=Path(".nox/soak-report.json"))
    args = parser.parse_args(argv)
    # The in-process fault scenario logs every failure it causes: keep only the unexpected.
    logging.basicConfig(level=logging.CRITICAL)
    started = time.perf_counter()
    report: dict[str, Any] = {"quick": args.quick, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="trio-mlx-soak-") as tmp:
        root = Path(tmp)
        adapters = trio_mlx.default_adapter_path("shout").parent
        steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("load+storm", lambda: load_and_storm(args, adapters)),
            ("faults", lambda: {"faults": trio.run(lambda: run_faults(
                None, requests=_scale(args, 300), pending=16, seed=args.seed))}),
            ("hostile", lambda: {"hostile": hostile_input(args)}),
            ("security", lambda: {"security": security_checks(root)}),
            ("shutdown", lambda: {"shutdown": shutdown_check(args, root)}),
            ("world", lambda: {"world": world.run_world(root / "world", quick=args.quick)}),
        ]  # fmt: skip
        for name, step in steps:
            begin = time.perf_counter()
            print(f"soak: {name} ...", file=sys.stderr, flush=True)
            report.update(step())
            print(f"soak: {name} done in {time.perf_counter() - begin:.1f} s", file=sys.stderr)
    report["verdicts"] = verdicts(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    print(f"\n{report['seconds']} s in all; report: {args.json}")
    return 0 if all(report["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
