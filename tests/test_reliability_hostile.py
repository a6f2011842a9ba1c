"""Hostile input (fast subset of ``nox -s soak``): never a 5xx, never a crash.

Hand-picked nasty bodies one by one, a bounded Hypothesis run, and a short
schemathesis run against ``/openapi.json``, all on a real server subprocess.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import trio
from soak import hostile
from soak._server import ServerProcess, serve

pytestmark = pytest.mark.model

JSON = {"Content-Type": "application/json"}

#: Cases that take the server down with them: each gets a server of its own.
CRASHERS = {"logit_bias key past vocab"}
#: Known bugs, each an exact reason (strict: the mark flips when the fix lands).
KNOWN: dict[str, str] = {}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serve("--max-tokens", "4") as live:
        yield live


def _case_params() -> list[object]:
    return [
        pytest.param(case, id=case[0], marks=_marks(case[0]))
        for case in hostile.CASES
        if case[0] not in CRASHERS
    ]


def _marks(name: str) -> list[pytest.MarkDecorator]:
    if name in KNOWN:
        return [pytest.mark.xfail(strict=True, reason=KNOWN[name])]
    return []


def _assert_clean(tally: hostile.Tally) -> None:
    assert tally.problems == []
    assert tally.server_errors == 0
    assert "transport_error" not in tally.statuses


@pytest.mark.parametrize("case", _case_params())
def test_a_hostile_body_gets_no_5xx(server: ServerProcess, case: tuple[str, str, bytes]) -> None:
    tally = hostile.Tally()
    hostile.run_case(server.url, tally, case)
    _assert_clean(tally)
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c[0], marks=_marks(c[0])) for c in hostile.CASES if c[0] in CRASHERS],
)
def test_a_hostile_body_does_not_kill_the_server(case: tuple[str, str, bytes]) -> None:
    with serve("--max-tokens", "4") as live:
        tally = hostile.Tally()
        hostile.run_case(live.url, tally, case)
        alive = live.process.poll() is None
        _assert_clean(tally)
        assert alive, f"the server died: exit {live.process.returncode}"


def test_100_hypothesis_bodies_get_no_5xx(server: ServerProcess) -> None:
    tally = hostile.run_hypothesis(server.url, 100)
    assert tally.cases == 100
    _assert_clean(tally)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_schemathesis_against_the_openapi_description_gets_no_5xx(server: ServerProcess) -> None:
    tally = hostile.run_schemathesis(server.url, 5)
    assert tally.cases >= 30
    _assert_clean(tally)
    assert httpx.get(f"{server.url}/health").status_code == 200


async def test_a_huge_prompt_is_refused_from_its_size_while_health_answers(
    server: ServerProcess,
) -> None:
    # 3.8 MB of text: more bytes than the context could hold in tokens, so it is
    # refused before tokenizing (it used to hold the event loop for seconds).
    body = json.dumps({"prompt": "a " * 1_900_000, "max_tokens": 1}).encode()
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        done = trio.Event()

        async def huge() -> None:
            reply = await http.post("/v1/completions", content=body, headers=JSON)
            assert reply.status_code == 400
            assert reply.json()["error"]["code"] == "context_length_exceeded"
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(huge)
            while not done.is_set() or len(statuses) < 3:
                statuses.append((await http.get("/health")).status_code)
                await trio.sleep(0.02)
    assert set(statuses) == {200}
