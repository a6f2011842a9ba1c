"""Reliability under load (fast subset of ``nox -s soak``): nothing lost, nothing duplicated.

A real ``trio-mlx serve`` subprocess on the bundled model; the soak harness's
load and disconnect-storm scenarios at small counts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from soak._server import ServerProcess, serve
from soak.load import run_load
from soak.storm import run_storm

import trio_mlx

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    adapters = trio_mlx.default_adapter_path("shout").parent
    with serve("--adapter-dir", str(adapters), "--max-queue", "256") as live:
        yield live


async def test_200_requests_at_concurrency_16_each_get_exactly_one_whole_answer(
    server: ServerProcess,
) -> None:
    report = await run_load(server.url, requests=200, concurrency=16, seed=6, deadline=60)
    assert report["problems"] == []
    assert report["lost"] == 0
    assert report["duplicated"] == 0
    assert report["failed"] == 0
    assert report["churn_5xx"] == 0
    assert report["outcomes"]["ok"] >= 150
    assert report["adapter_churn"].get("mount:201", 0) >= 1
    assert report["health_after"] == 200


async def test_a_storm_of_50_disconnecting_streams_leaves_no_rows(server: ServerProcess) -> None:
    report = await run_storm(server.url, clients=50, concurrency=25, seed=6, settle_timeout=60)
    assert report["left"] == {
        "running_rows": 0,
        "queued_rows": 0,
        "parked_rows": 0,
        "waiting_jobs": 0,
    }
    assert report["client_errors"] == {}
    assert sum(report["modes"].values()) == 50
    assert report["health_after"] == 200
