"""Memory-aware admission on the real tiny model: the KV budget, refusals, waiting rows."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from engine_helpers import NO_EOS, wait_until
from trio_mlx import InvalidRequest, SamplingParams
from trio_mlx._core.arbiter import Admit
from trio_mlx._memory import KVProfile
from trio_mlx._start import kv_measure

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def profile(tiny_model: tuple[Any, Any]) -> KVProfile:
    model, _tokenizer = tiny_model
    return kv_measure.measure(model, 5)


def test_the_measured_profile_prices_a_real_cache_exactly(
    tiny_model: tuple[Any, Any], profile: KVProfile
) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _tokenizer = tiny_model
    # 2 layers x 2 KV heads x 32 dims (hidden 128 over 4 heads) x (keys + values) x float32.
    assert profile == KVProfile(per_token=2 * 2 * 32 * 2 * 4)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * 600]), cache=cache))
    assert sum(layer.nbytes for layer in cache) == profile.row_bytes(600)


async def test_the_default_budget_is_positive_and_below_the_machines_memory(
    tiny_model_path: Path,
) -> None:
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        stats = engine.statistics()
    assert 0 < stats.kv_memory_budget < machine
    assert stats.kv_memory_reserved == 0


async def test_a_request_that_can_never_fit_is_refused_naming_its_tokens_and_the_limit(
    tiny_model_path: Path, profile: KVProfile
) -> None:
    limit = profile.row_bytes(512)
    async with trio_mlx.open_engine(tiny_model_path, kv_memory_bytes=limit) as engine:
        message = (
            rf"the request needs a KV cache of 610 tokens \(600 prompt \+ 10 max_tokens\), "
            rf"{profile.row_bytes(610)} bytes; the engine's KV memory budget is {limit} bytes, "
            r"which holds at most 512 tokens for one request"
        )
        with pytest.raises(InvalidRequest, match=message) as refused:
            await engine.complete([5] * 600, SamplingParams(max_tokens=10))
        assert refused.value.code == "kv_memory_exceeded"
        assert engine.statistics().requests["batch:rejected"] == 1
        # A prompt that fits has its max_tokens cut to the room one request has.
        clamped = await engine.complete(
            [5] * 100, SamplingParams(max_tokens=900, logit_bias=NO_EOS)
        )
        assert clamped.result.max_tokens == 412
        assert clamped.result.completion_tokens == 412


async def _run_in_order(engine: trio_mlx.Engine, rows: list[tuple[int, int]]) -> list[int]:
    """Submit rows of (prompt tokens, max_tokens) in order; return every one's output length."""
    done: list[int] = [0] * len(rows)

    async def row(i: int, accepted: trio.Event) -> None:
        prompt, max_tokens = rows[i]
        params = SamplingParams(max_tokens=max_tokens, logit_bias=NO_EOS)
        async with engine.generate([5 + i] * prompt, params) as stream:
            accepted.set()
            async for delta in stream:
                done[i] += len(delta.token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(rows)):
            accepted = trio.Event()
            nursery.start_soon(row, i, accepted)
            await accepted.wait()  # submitted in this order
    return done


async def test_rows_that_fit_alone_but_not_together_run_one_after_the_other(
    tiny_model_path: Path, profile: KVProfile
) -> None:
    log: list[tuple[Any, Any]] = []

    def hook(decision: Any, after: Any) -> None:
        log.append((decision, after))

    # Each row holds 300 tokens at worst (512 with the cache's steps): one fits, two do not.
    limit = profile.row_bytes(512)
    async with trio_mlx.open_engine(
        tiny_model_path, kv_memory_bytes=limit, prompt_cache_bytes=0, decision_hook=hook
    ) as engine:
        with trio.fail_after(120):
            done = await _run_in_order(engine, [(10, 290), (10, 290)])
        assert engine.statistics().kv_memory_reserved == 0
    assert done == [290, 290]
    admits = [(d.ids, after.outcomes["FINISHED"]) for d, after in log if isinstance(d, Admit)]
    assert [ids for ids, _ in admits] == [(1,), (2,)]
    assert admits[1][1] == 1, "the second row started before the first had finished"
    assert max(after.running_rows for _, after in log) == 1
    assert max(after.kv_bytes_reserved for _, after in log) == profile.row_bytes(300)
    assert any(after.running_rows == 1 and after.queued_rows == 1 for _, after in log)


async def test_a_waiting_large_row_is_not_jumped_by_a_newer_small_one(
    tiny_model_path: Path, profile: KVProfile
) -> None:
    log: list[tuple[Any, Any]] = []

    def hook(decision: Any, after: Any) -> None:
        log.append((decision, after))

    # Rows of 512 tokens at worst, a large one of 1,024: two small rows fit, the large
    # one fits only alone. The newer small row would fit beside the first, yet waits.
    limit = profile.row_bytes(1024)
    async with trio_mlx.open_engine(
        tiny_model_path, kv_memory_bytes=limit, prompt_cache_bytes=0, decision_hook=hook
    ) as engine:
        with trio.fail_after(180):
            done = await _run_in_order(engine, [(10, 290), (10, 700), (10, 290)])
            await wait_until(lambda: engine.statistics().running_rows == 0)
    assert done == [290, 700, 290]
    admits = [d.ids for d, _ in log if isinstance(d, Admit)]
    assert admits == [(1,), (2,), (3,)]
    assert any(after.running_rows == 1 and after.queued_rows == 2 for _, after in log)
    assert max(after.kv_bytes_reserved for _, after in log) <= limit
