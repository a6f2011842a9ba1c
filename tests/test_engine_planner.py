"""The step planner in a running engine: grouped admission, deferred (bulk) removal,
chunked prefill, shared prompt-cache entries (the lane's own behaviour, driven step
by step without an engine, is tested in ``test_batch_lane.py``).

Whatever the planner decides (rows held back to be prefilled as a group, dead
rows decoding until a bulk removal, rows parked for a job and resumed), every
greedy row must produce exactly what it produces alone, and a cancelled row
must stop at once and give its slot back within the stated bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio_mlx
import trio_mlx.testing
from engine_helpers import NO_EOS, PROMPT, wait_until
from trio_mlx import SamplingParams
from trio_mlx._start.loading import CPU_PREFILL_BUDGET, GPU_PREFILL_BUDGET
from trio_mlx.testing import batch_lane, step_planner

pytestmark = [pytest.mark.model]

#: Short prompts, and one past the lane's cache_min_prefix (it is served from the prompt cache).
PROMPTS = ["Hello world", "The quick brown fox", "def main():", " ".join([PROMPT] * 20)]
LONGEST = 24
_solo: dict[str, list[int]] = {}


async def _solo_tokens(model: Path) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, generated alone (one row at a time, no prompt cache)."""
    if not _solo:
        params = SamplingParams(max_tokens=LONGEST, logit_bias=NO_EOS)
        async with trio_mlx.open_engine(model, max_batch=4, prompt_cache_bytes=0) as engine:
            for prompt in PROMPTS:
                _solo[prompt] = list((await engine.complete(prompt, params)).token_ids)
    return _solo


row = st.tuples(
    st.integers(0, len(PROMPTS) - 1),  # prompt
    st.integers(1, LONGEST),  # max_tokens
    st.none() | st.integers(0, 10),  # cancel after this many tokens
    st.sampled_from([0.0, 0.0, 0.001, 0.004, 0.015]),  # delay before submitting
)
job = st.tuples(st.just(-1), st.just(0), st.none(), st.sampled_from([0.002, 0.01, 0.03]))


#: Holds admitted rows until their group is complete (no step or time limit).
HOLD: dict[str, Any] = {"admit_wait_steps": 10**6, "admit_wait_seconds": 3600.0}


async def _measure_steps(engine: trio_mlx.Engine) -> None:
    """Let the planner time decode-only steps and a step that prefills, as a server's
    earlier traffic would (a schedule alone is too short to measure both)."""
    params = SamplingParams(max_tokens=24, logit_bias=NO_EOS)
    async with engine.generate(PROMPTS[0], params) as stream:
        seen = 0
        async for delta in stream:
            seen += len(delta.token_ids)
            if seen >= 6 and engine.statistics().prompt_token_seconds is None:
                await engine.complete(PROMPTS[2] * 3, SamplingParams(max_tokens=1))
    assert engine.statistics().prompt_token_seconds is not None, "the stall bound is exercised"


async def _check_schedule(
    model: Path,
    ops: list[tuple[Any, ...]],
    budget: int | None,
    width_multiple: int = 1,
    stall: float | None = None,
    traced: bool = False,
    chunk: int | None = None,
) -> None:
    solo = await _solo_tokens(model)
    got: dict[int, tuple[str, list[int]]] = {}
    # Small bounds so that holding, grouping and deferred removal all happen; a small
    # prefill budget: prompts are prefilled in chunks.
    tune = {
        "admit_group": 3,
        "admit_fraction": 1,
        "admit_wait_steps": 6,
        "admit_wait_seconds": 0.05,
        "removal_delay": 4,
        "removal_fraction": 2,
        "prefill_budget": budget,
        # A chunk below the budget: a prompt longer than it is prefilled alone.
        "long_prompt_chunk": chunk,
        "prefill_width_multiple": width_multiple,
        # With a stall bound each step's chunk follows the measured times (see
        # _measure_steps): it moves from step to step, down to the floor.
        "prefill_stall": stall,
        "prefill_floor": 4,
        "timing_lag": 0,
        # Decode steps traced once per shape (the CUDA default), or the model's own.
        "traced_decode": traced,
    }
    async with trio_mlx.open_engine(
        model, max_batch=6, max_queue=16, drain_timeout=0.005, min_batch_steps=1, **tune
    ) as engine:
        if stall is not None:
            await _measure_steps(engine)

        async def run(i: int, prompt: int, size: int, cancel: int | None, delay: float) -> None:
            await trio.sleep(delay)
            if prompt < 0:  # a job: running rows are parked, then resumed
                await engine.run_exclusive(lambda m, t: None)
                return
            params = SamplingParams(max_tokens=size, logit_bias=NO_EOS)
            tokens: list[int] = []
            async with engine.generate(PROMPTS[prompt], params) as stream:
                async for delta in stream:
                    tokens.extend(delta.token_ids)
                    if cancel is not None and len(tokens) > cancel:
                        got[i] = ("cancelled", tokens)
                        return
            got[i] = ("finished", tokens)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i, op in enumerate(ops):
                    nursery.start_soon(run, i, *op)
            await wait_until(lambda: engine.statistics().batch_rows == 0)
        stats = engine.statistics()
        dead = trio_mlx.testing.dead_rows(engine)
        if any(op[0] >= 0 for op in ops):  # a row ran: the traced step was built, or not
            assert (batch_lane(engine).traced is not None) is traced
    for i, (prompt, size, _cancel, _delay) in enumerate(ops):
        if prompt < 0:
            continue
        how, tokens = got[i]
        want = solo[PROMPTS[prompt]][:size]
        if how == "finished":
            assert tokens == want, (i, ops[i])
        else:
            assert tokens == want[: len(tokens)], (i, ops[i])
    assert stats.requests["batch:failed"] == 0
    assert dead == 0, "an idle lane holds no dead rows"


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(st.one_of(row, row, row, job), min_size=1, max_size=12),
    budget=st.sampled_from([None, 5, 24]),
    width_multiple=st.sampled_from([1, 1, 8]),
    stall=st.sampled_from([None, None, 1.02, 1.1]),
    traced=st.booleans(),
    chunk=st.sampled_from([None, None, 4]),
)
def test_rows_grouped_chunked_removed_in_bulk_cancelled_and_parked_equal_their_solo_runs(
    tiny_model_path: Path,
    ops: list[tuple[Any, ...]],
    budget: int | None,
    width_multiple: int,
    stall: float | None,
    traced: bool,
    chunk: int | None,
) -> None:
    trio.run(_check_schedule, tiny_model_path, ops, budget, width_multiple, stall, traced, chunk)


async def test_arrivals_while_rows_decode_are_admitted_as_one_group(
    tiny_model_path: Path,
) -> None:
    solo = await _solo_tokens(tiny_model_path)
    long = SamplingParams(max_tokens=400, logit_bias=NO_EOS)
    params = SamplingParams(max_tokens=LONGEST, logit_bias=NO_EOS)
    tune = {"admit_group": 4, "admit_fraction": 1, **HOLD}
    async with trio_mlx.open_engine(
        tiny_model_path, max_batch=9, prompt_cache_bytes=0, **tune
    ) as engine:
        outputs: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            outputs[i] = list((await engine.complete(PROMPTS[i], params)).token_ids)

        async with trio.open_nursery() as nursery:
            for _ in range(4):  # four rows decoding: a group may be as large as them
                nursery.start_soon(engine.complete, PROMPT, long)
            # An idle engine admits at once.
            await wait_until(lambda: engine.statistics().generated_tokens >= 4)
            first = engine.statistics().admissions
            assert 1 <= first <= 4
            async with trio.open_nursery() as arrivals:
                for i in range(4):
                    arrivals.start_soon(one, i)
                    # The next arrival comes a few decode steps later.
                    steps = engine.statistics().steps
                    await wait_until(lambda s=steps: engine.statistics().steps >= s + 2)
                    if i < 3:
                        assert engine.statistics().admissions == first, "held until 4 wait"
            # The four went in together (one step call), not one by one.
            assert engine.statistics().admissions == first + 1
            nursery.cancel_scope.cancel()
    for i in range(4):
        assert outputs[i] == solo[PROMPTS[i]]


@pytest.mark.parametrize(
    ("name", "value", "on_cpu", "on_gpu"),
    [
        ("prefill_budget", 96, CPU_PREFILL_BUDGET, GPU_PREFILL_BUDGET),
        ("long_prompt_chunk", 48, None, None),  # off by default on every device
    ],
)
async def test_a_prefill_setting_reaches_the_lane_and_is_checked(
    tiny_model_path: Path, name: str, value: int, on_cpu: int | None, on_gpu: int | None
) -> None:
    async with trio_mlx.open_engine(tiny_model_path, **{name: value}) as engine:
        assert getattr(batch_lane(engine), name) == value
    import mlx.core as mx

    default = on_cpu if mx.default_device() == mx.cpu else on_gpu
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        assert getattr(batch_lane(engine), name) == default
    for bad in (0, -5, 2.5, True):
        with pytest.raises(trio_mlx.InvalidRequest, match=name):
            async with trio_mlx.open_engine(tiny_model_path, **{name: bad}):
                pass


async def test_the_prefill_stall_reaches_the_planner_and_is_checked(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path, prefill_stall=2.5) as engine:
        assert step_planner(engine).prefill_stall == 2.5
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        assert step_planner(engine).prefill_stall is None
    for bad in (1, 0.5, -2, True, "2"):
        with pytest.raises(trio_mlx.InvalidRequest, match="prefill_stall"):
            async with trio_mlx.open_engine(tiny_model_path, prefill_stall=bad):  # type: ignore[arg-type]
                pass


async def test_an_arrival_held_for_its_group_does_not_cut_the_burst(tiny_model_path: Path) -> None:
    # Two decoding rows: groups of two; bursts end by count or news only.
    tune = {
        "admit_group": 4,
        "admit_fraction": 1,
        **HOLD,
        "burst_steps": 40,
        "burst_seconds": 3600.0,
    }
    async with trio_mlx.open_engine(
        tiny_model_path, max_batch=8, prompt_cache_bytes=0, **tune
    ) as engine:
        long = SamplingParams(max_tokens=2000, logit_bias=NO_EOS)
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(engine.complete, PROMPT, long)
            await wait_until(lambda: engine.statistics().generated_tokens >= 2)
            base = engine.statistics()
            nursery.start_soon(engine.complete, PROMPTS[0], long)  # held: one of a group of two
            await wait_until(lambda: engine.statistics().steps >= base.steps + 3)
            stats = engine.statistics()
            assert stats.admissions == base.admissions, "held until a second arrival"
            # Every burst since ran its 40 steps for both rows: none was cut short.
            grown = stats.generated_tokens - base.generated_tokens
            assert grown >= 2 * 40 * 3
            assert grown % (2 * 40) == 0
            nursery.cancel_scope.cancel()


#: Each scheduler bound, a value it takes and values it refuses.
BOUNDS: list[tuple[str, Any, tuple[Any, ...]]] = [
    ("burst_steps", 3, (0, 1.5, None)),
    ("burst_seconds", 0.5, (-1, "1", True)),
    ("admit_group", 5, (0, 2.0)),
    ("admit_fraction", 2, (0, None)),
    ("admit_wait_steps", 0, (-1, None)),
    ("admit_wait_seconds", 0.0, (-0.1, None)),
    ("prefill_floor", 8, (0, None)),
    ("timing_lag", 0, (-1, None)),
    ("removal_delay", 3, (-1, 1.0)),
    ("removal_fraction", 0, (-1, None)),
    ("prefill_width_multiple", 4, (0, None)),
    ("traced_decode", False, (1, "yes")),
    ("decision_hook", print, (1, "hook")),
]


def test_a_bad_scheduler_bound_is_refused_naming_it() -> None:
    for name, good, bads in BOUNDS:
        assert getattr(trio_mlx.EngineSettings(**{name: good}), name) == good
        for bad in bads:
            with pytest.raises(trio_mlx.InvalidRequest, match=name) as caught:
                trio_mlx.EngineSettings(**{name: bad})
            assert caught.value.param == name


async def test_the_scheduler_bounds_reach_the_planner_and_the_lane(tiny_model_path: Path) -> None:
    chosen = {name: good for name, good, _ in BOUNDS if name != "decision_hook"}
    async with trio_mlx.open_engine(tiny_model_path, **chosen) as engine:
        planner, lane = step_planner(engine), batch_lane(engine)
        for name, value in chosen.items():
            assert getattr(planner if hasattr(planner, name) else lane, name) == value, name
