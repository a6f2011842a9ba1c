"""Shutdown (fast subset of ``nox -s soak``): SIGTERM under load ends everything, exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from soak._server import serve
from soak.shutdown import long_context_model, run_shutdown, short_requests_seconds

pytestmark = pytest.mark.model

SHORT, LONG = 8, 2
#: Tokens per short request: few, so they fit the grace period on a loaded box.
SHORT_TOKENS = 16
#: The grace period's floor, and its multiple of what the short requests take beside the
#: long ones on this machine now. Measured here: the short requests take 0.2-0.4 s on an
#: idle box, and up to 4.6 s beside two CPU burners (OpenBLAS's threads then wait on each
#: other): the floor alone covers that, and a busier machine gets a longer grace. The long
#: requests cannot finish inside it on any machine: they run on the bundled model with its
#: context raised (``long_context_model``), and a fast box, which reached the bundled
#: model's 2,048-token context inside a 10 s grace, decodes far fewer than a million.
GRACE_FLOOR, GRACE_PER_PACE = 6.0, 4.0


async def test_sigterm_under_load_finishes_short_requests_and_exits_0_within_grace(
    tmp_path: Path,
) -> None:
    # Every request decodes from the start (a batch wide enough for all of them), so the
    # short ones never wait for a slot while the grace runs.
    model = long_context_model(tmp_path)
    width = ("--max-batch", str(SHORT + LONG))
    # This machine's pace now (what ``nox -s soak`` scales its grace by too).
    with serve(*width, model=model) as probe:
        pace = await short_requests_seconds(
            probe, short=SHORT, long=LONG, short_tokens=SHORT_TOKENS
        )
    grace = round(max(GRACE_FLOOR, GRACE_PER_PACE * pace), 1)
    with serve("--graceful-timeout", str(grace), *width, model=model) as server:
        report = await run_shutdown(
            server, short=SHORT, long=LONG, grace=grace, short_tokens=SHORT_TOKENS
        )
    report["pace_s"] = pace
    assert report["short_all_ok"], report
    assert report["hung"] == 0, report
    assert set(report["outcomes"]["long"]) <= {"clean_error", "cut"}, report
    assert report["late_refused"], report
    assert report["exit_code"] == 0, report
    assert report["exit_s"] < grace + 5.0, report
