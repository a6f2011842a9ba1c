"""Randomized interleavings against the real engine: every request ends exactly once.

Hypothesis draws a mix of batch rows, serial generations, exclusive jobs,
adapter mounts and cancellations, submitted at random moments. Each example
opens its own engine, records every arbiter decision, and checks the
arbiter's invariants on them, the outcome of each request, and that the
engine is idle afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio_mlx
from engine_helpers import NO_EOS, wait_until
from trio_mlx import AdapterConflict, EngineOverloaded, InvalidRequest, NotFound, SamplingParams
from trio_mlx._core.arbiter import Admit, Park, Resume, Start, Step

pytestmark = [pytest.mark.model, pytest.mark.props]

PROMPTS = ["Hello world", "The quick brown fox", "def main():"]
MAX_BATCH = 3

delays = st.sampled_from([0.0, 0.0, 0.001, 0.005, 0.02])
cancel_after = st.none() | st.integers(min_value=0, max_value=6)
op = st.one_of(
    st.tuples(st.just("row"), st.integers(1, 24), cancel_after, delays),
    st.tuples(st.just("serial"), st.integers(1, 12), cancel_after, delays),
    st.tuples(st.just("adapter_row"), st.integers(1, 8), cancel_after, delays),
    st.tuples(st.just("job"), st.just(0), st.none() | st.just(0), delays),
    st.tuples(st.just("mount"), st.just(0), st.none(), delays),
    st.tuples(st.just("unmount"), st.just(0), st.none(), delays),
)


def _check_decisions(log: list[tuple[Any, Any]]) -> None:
    """The arbiter's invariants, on the decisions the actor carried out."""
    last_job = 0
    for decision, after in log:
        assert after.running_rows <= MAX_BATCH
        if isinstance(decision, Start):
            assert after.running_rows == 0, "a job started while rows ran"
            # Ids grow with submission order: jobs start first come, first served.
            assert decision.job_id > last_job
            last_job = decision.job_id
        if isinstance(decision, Admit | Resume):
            assert after.state.name == "ADMITTING", "rows admitted outside ADMITTING"
        if isinstance(decision, Step):
            assert after.running_job is None
        if isinstance(decision, Park):
            assert after.running_rows == 0


def _idle(stats: trio_mlx.EngineStatistics) -> bool:
    busy = stats.running_rows + stats.queued_rows + stats.parked_rows
    busy += stats.waiting_jobs + stats.running_jobs
    return busy == 0 and stats.batch_rows == 0


async def _check_scenario(model: Path, adapter: Path, ops: list[tuple[Any, ...]]) -> None:
    outcomes: dict[int, list[str]] = {i: [] for i in range(len(ops))}
    log: list[tuple[Any, Any]] = []

    def hook(decision: Any, after: Any) -> None:
        log.append((decision, after))

    async with trio_mlx.open_engine(
        model,
        max_batch=MAX_BATCH,
        max_queue=6,
        drain_timeout=0.01,
        min_batch_steps=2,
        decision_hook=hook,
    ) as engine:

        async def run(i: int, kind: str, size: int, cancel: int | None, delay: float) -> None:
            await trio.sleep(delay)
            try:
                if kind == "job":
                    with trio.move_on_after(0.002 if cancel is not None else 60) as scope:
                        await engine.run_exclusive(lambda m, t: None)
                    outcomes[i].append("cancelled" if scope.cancelled_caught else "finished")
                    return
                if kind == "mount":
                    await engine.mount_adapter("a", adapter)
                    outcomes[i].append("finished")
                    return
                if kind == "unmount":
                    await engine.unmount_adapter("a")
                    outcomes[i].append("finished")
                    return
                params = SamplingParams(
                    max_tokens=size,
                    logit_bias=NO_EOS,
                    seed=1 if kind == "serial" else None,
                    adapter="a" if kind == "adapter_row" else None,
                )
                async with engine.generate(PROMPTS[i % 3], params) as stream:
                    tokens = 0
                    async for delta in stream:
                        tokens += len(delta.token_ids)
                        if cancel is not None and tokens > cancel:
                            break
                    else:
                        assert stream.result.completion_tokens == size
                        assert tokens == size
                        outcomes[i].append("finished")
                        return
                outcomes[i].append("cancelled")
            except EngineOverloaded:
                outcomes[i].append("rejected")
            except (NotFound, InvalidRequest, AdapterConflict):
                # Adapter races: not mounted yet, already mounted, already gone, in use.
                outcomes[i].append("refused")

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i, (kind, size, cancel, delay) in enumerate(ops):
                    nursery.start_soon(run, i, kind, size, cancel, delay)
            # A cancelled running job (or row) stops within a token or a step.
            await wait_until(lambda: _idle(engine.statistics()))
        stats = engine.statistics()

    assert all(len(o) == 1 for o in outcomes.values()), outcomes
    assert _idle(stats)
    assert stats.arbiter.running_job is None
    assert stats.batch_rows == 0
    refused = sum(o == ["refused"] for o in outcomes.values())
    # Only adapter rows whose adapter went while they waited fail (NotFound at insert).
    assert stats.requests["batch:failed"] <= refused
    for lane in ("batch", "serial", "job"):
        assert stats.requests[f"{lane}:closed"] == 0
    rejected = sum(o == ["rejected"] for o in outcomes.values())
    assert (
        sum(stats.requests[f"{lane}:rejected"] for lane in ("batch", "serial", "job")) == rejected
    )
    ended = sum(o[0] in ("finished", "cancelled") for o in outcomes.values())
    counted = sum(
        stats.requests[f"{lane}:{how}"]
        for lane in ("batch", "serial", "job")
        for how in ("finished", "cancelled", "failed")
    )
    # Adapter races refused before submission are not counted; those refused on
    # the MLX thread (mounted twice, unmounted meanwhile) end as failed.
    assert ended <= counted <= ended + refused
    _check_decisions(log)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(op, min_size=1, max_size=10))
def test_random_interleavings_end_every_request_exactly_once(
    tiny_model_path: Path, tiny_adapter_path: Path, ops: list[tuple[Any, ...]]
) -> None:
    trio.run(_check_scenario, tiny_model_path, tiny_adapter_path, ops)
