"""Shutdown (fast subset of ``nox -s soak``): SIGTERM under load ends everything, exit 0."""

from __future__ import annotations

import pytest
from soak._server import serve
from soak.shutdown import run_shutdown

pytestmark = pytest.mark.model


async def test_sigterm_under_load_finishes_short_requests_and_exits_0_within_grace() -> None:
    with serve("--graceful-timeout", "3") as server:
        report = await run_shutdown(server, short=8, long=2, grace=3.0)
    assert report["short_all_ok"], report["outcomes"]
    assert report["hung"] == 0
    assert set(report["outcomes"]["long"]) <= {"ok", "clean_error", "cut"}
    assert report["outcomes"]["late"] == {"refused": 1}
    assert report["exit_code"] == 0
    assert report["exit_s"] < 3.0 + 5.0
