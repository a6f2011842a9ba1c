"""Reliability under faults (fast subset of ``nox -s soak``).

A model that fails on random prefills and decode steps: the requests it hits
end with a clean error, the others succeed, the engine keeps serving. Then the
worker thread dies: ``/health`` is 503 and every pending request ends with 503.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from soak.faults import run_faults

pytestmark = pytest.mark.model


async def test_random_model_failures_end_only_their_requests_and_a_dead_worker_ends_all(
    tiny_model_path: Path,
) -> None:
    report = await run_faults(tiny_model_path, requests=40, pending=10, seed=6)
    flaky, death = report["flaky"], report["worker_death"]
    assert flaky["unclean"] == []
    assert flaky["outcomes"].get("ok", 0) > 0
    assert sum(flaky["injected"].values()) > 0
    assert flaky["serving_after"]
    assert flaky["health_after"] == 200
    assert flaky["worker_alive"]
    assert death["death_raised"] == ["EngineClosed"]
    assert death["all_ended_503"], death["outcomes"]
    assert sum(death["outcomes"].values()) == 10
    assert death["health_after_death"] == 503
    assert death["request_after_death"] == "503"
