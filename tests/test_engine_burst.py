"""Decode bursts: a Step's worker call may run several decode steps, never past news
(the lane's own bursts are tested in ``test_batch_lane.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_mlx
from engine_helpers import NO_EOS, wait_until
from trio_mlx import SamplingParams, TokenLogprob
from trio_mlx._lanes.output import RowEvent, RowOutput, merge_events

pytestmark = pytest.mark.model


def test_merge_events_joins_a_rows_events_in_order() -> None:
    lp = TokenLogprob(5, -0.5, ())
    events = [
        RowEvent(7, "a", (5,), (lp,), None, None, 1),
        RowEvent(7, "", (6,), (), None, None, 2),
        RowEvent(7, "bc", (8,), (lp,), "length", None, 3),
    ]
    merged = merge_events(events)
    assert merged == RowEvent(7, "abc", (5, 6, 8), (lp, lp), "length", None, 3)
    assert merge_events(events[:1]) is events[0]
    plain = [RowEvent(1, "x", (1,), None, None, None, 1), RowEvent(1, "y", (2,), None)]
    assert merge_events(plain).logprobs is None


@settings(max_examples=100, deadline=None)
@given(
    # 0 and 2 are the tiny model's EOS ids.
    tokens=st.lists(st.sampled_from([0, 2]) | st.integers(3, 40), min_size=1, max_size=30),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=30),
    stop=st.sampled_from([(), ("e",), ("in", "the ")]),
    logprobs=st.booleans(),
    ignore_eos=st.booleans(),
    limits=st.tuples(st.integers(1, 30), st.integers(0, 5)),
)
def test_adding_a_bursts_tokens_and_taking_once_equals_merging_the_pushes(
    tiny_model: tuple[Any, Any],
    tokens: list[int],
    cuts: list[int],
    stop: tuple[str, ...],
    logprobs: bool,
    ignore_eos: bool,
    limits: tuple[int, int],
) -> None:
    import mlx.core as mx

    tokenizer = tiny_model[1]
    params = SamplingParams(
        max_tokens=limits[0],
        min_tokens=min(limits),
        stop=stop,
        logprobs=logprobs,
        top_logprobs=2 if logprobs else 0,
        ignore_eos=ignore_eos,
    )
    eos = frozenset(tokenizer.eos_token_ids)
    pushed = RowOutput(1, params, eos, tokenizer.detokenizer)
    added = RowOutput(1, params, eos, tokenizer.detokenizer)
    vector = mx.log(mx.softmax(mx.arange(48, dtype=mx.float32) % 7))
    ids = iter(tokens)
    done = False
    for cut in cuts:
        events = []
        for token in ids:
            events.append(pushed.push(token, vector, None))
            finish = added.add(token, vector)
            assert finish == events[-1].finish_reason
            if finish is not None:
                done = True
            if done or len(events) == cut:
                break
        if not events:
            break
        assert added.take() == merge_events(events)
        if done:
            break


@pytest.mark.parametrize("logprobs", [True, False])
def test_an_eos_alone_ends_the_row_with_no_token_and_empty_logprobs(
    tiny_model: tuple[Any, Any], logprobs: bool
) -> None:
    tokenizer = tiny_model[1]
    params = SamplingParams(max_tokens=5, logprobs=logprobs)
    output = RowOutput(1, params, frozenset([0, 2]), tokenizer.detokenizer)
    event = output.push(2, None, None)
    assert event == RowEvent(1, "", (), () if logprobs else None, "stop", None, 1)


async def _endless_row(engine: trio_mlx.Engine, seen: list[int], *, task_status: Any) -> None:
    params = SamplingParams(max_tokens=100_000, logit_bias=NO_EOS)
    async with engine.generate("Hello world", params) as stream:
        task_status.started()
        async for delta in stream:
            seen.extend(delta.token_ids)


async def test_news_ends_an_endless_burst(tiny_model_path: Path) -> None:
    """With no step or time limit on bursts, submissions, cancels and jobs still get in."""
    endless = {"burst_steps": 1_000_000, "burst_seconds": 1_000.0}
    async with trio_mlx.open_engine(
        tiny_model_path, prompt_cache_bytes=0, drain_timeout=0.0, **endless
    ) as engine:
        seen: list[int] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(_endless_row, engine, seen)
                # An endless burst holds the row's later tokens: only the first has come.
                await wait_until(lambda: len(seen) >= 1)
                # A new row is admitted, gets its tokens and finishes mid-burst.
                short = SamplingParams(max_tokens=5, logit_bias=NO_EOS)
                result = await engine.complete("The quick brown fox", short)
                assert len(result.token_ids) == 5
                assert result.result.finish_reason == "length"
                # An exclusive job starts (the running row is parked for it).
                assert await engine.run_exclusive(lambda model, tok: 42) == 42
                # A cancel ends the endless row promptly.
                nursery.cancel_scope.cancel()
            await wait_until(lambda: engine.statistics().batch_rows == 0)
        stats = engine.statistics()
        assert stats.requests["batch:cancelled"] == 1
        assert stats.generated_tokens < 100_000


async def test_tuning_an_unknown_field_is_refused(tiny_model_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword arguments: burst_step"):
        async with trio_mlx.open_engine(tiny_model_path, burst_step=1):
            pass  # pragma: no cover - the engine does not start
