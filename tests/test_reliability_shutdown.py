"""Shutdown (fast subset of ``nox -s soak``): SIGTERM under load ends everything, exit 0."""

from __future__ import annotations

import pytest
from soak._server import serve
from soak.shutdown import run_shutdown

pytestmark = pytest.mark.model

SHORT, LONG = 8, 2
#: Tokens per short request: few, so the grace that fits them stays far below the time
#: the long requests need to reach the end of the bundled model's 2,048-token context.
SHORT_TOKENS = 16


#: The grace period, the most the long requests allow: they must still be running at the
#: deadline, and an idle box decodes about 145 tokens/s per row here, so 10 s is ~1,450 of
#: the context's tokens (one run that scaled the grace to a probe's 15 s gave 75 s, and
#: they reached the context's end).
GRACE = 10.0


async def test_sigterm_under_load_finishes_short_requests_and_exits_0_within_grace() -> None:
    # The grace period must fit the short requests on a loaded box too. It used to be 8x
    # a probe of their time, at least 3 s and then 6 s; but a probe is one sample, and on a
    # shared box beside two CPU burners probes read 0.25-0.32 s while the same requests
    # under SIGTERM outlived 3 s and 6 s (CI, twice). The whole allowance costs at most
    # the seconds the long requests run anyway, so the grace is always the most allowed.
    with serve("--graceful-timeout", str(GRACE)) as server:
        report = await run_shutdown(
            server, short=SHORT, long=LONG, grace=GRACE, short_tokens=SHORT_TOKENS
        )
    assert report["short_all_ok"], report
    assert report["hung"] == 0, report
    assert set(report["outcomes"]["long"]) <= {"ok", "clean_error", "cut"}, report
    assert report["late_refused"], report
    assert report["exit_code"] == 0, report
    assert report["exit_s"] < GRACE + 5.0, report
