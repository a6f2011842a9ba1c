"""Shutdown (fast subset of ``nox -s soak``): SIGTERM under load ends everything, exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from soak._server import serve
from soak.shutdown import long_context_model, run_shutdown

pytestmark = pytest.mark.model

SHORT, LONG = 8, 2
#: Tokens per short request: few, so they fit the grace period on a loaded box.
SHORT_TOKENS = 16
#: The grace period. Measured here: the short requests take 0.2 s on an idle box, and up
#: to 4.6 s beside two CPU burners (OpenBLAS's threads then wait on each other). The long
#: requests cannot finish inside it on any machine: they run on the bundled model with
#: its context raised (``long_context_model``), and a fast box, which reached the bundled
#: model's 2,048-token context inside a 10 s grace, decodes far fewer than a million.
GRACE = 15.0


async def test_sigterm_under_load_finishes_short_requests_and_exits_0_within_grace(
    tmp_path: Path,
) -> None:
    # Every request decodes from the start (a batch wide enough for all of them), so the
    # short ones never wait for a slot while the grace runs.
    model = long_context_model(tmp_path)
    width = str(SHORT + LONG)
    with serve("--graceful-timeout", str(GRACE), "--max-batch", width, model=model) as server:
        report = await run_shutdown(
            server, short=SHORT, long=LONG, grace=GRACE, short_tokens=SHORT_TOKENS
        )
    assert report["short_all_ok"], report
    assert report["hung"] == 0, report
    assert set(report["outcomes"]["long"]) <= {"clean_error", "cut"}, report
    assert report["late_refused"], report
    assert report["exit_code"] == 0, report
    assert report["exit_s"] < GRACE + 5.0, report
