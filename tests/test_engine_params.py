"""Per-row sampling parameters in one batch: each changes its own row only."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
import trio

import trio_mlx
from engine_helpers import NO_EOS, PROMPT
from trio_mlx import SamplingParams
from trio_mlx.testing import batch_lane

pytestmark = pytest.mark.model


async def _batch(
    engine: trio_mlx.Engine, params: list[SamplingParams]
) -> list[trio_mlx.Completion]:
    """Run the requests together (one batch) and return their completions in order."""
    out: list[trio_mlx.Completion | None] = [None] * len(params)

    async def one(i: int) -> None:
        out[i] = await engine.complete(PROMPT, params[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(params)):
            nursery.start_soon(one, i)
    assert all(c is not None for c in out)
    return [c for c in out if c is not None]


@pytest.mark.parametrize(
    "changed",
    [
        SamplingParams(max_tokens=20, logit_bias={**NO_EOS, 0: -100.0}, temperature=1.0, top_k=3),
        SamplingParams(max_tokens=20, logit_bias=NO_EOS, temperature=1.0, top_p=0.5),
        SamplingParams(max_tokens=20, logit_bias=NO_EOS, temperature=1.0, min_p=0.2),
        SamplingParams(max_tokens=20, logit_bias=NO_EOS, presence_penalty=2.0),
        SamplingParams(max_tokens=20, logit_bias=NO_EOS, frequency_penalty=2.0),
        SamplingParams(max_tokens=20, logit_bias=NO_EOS, repetition_penalty=3.0),
        SamplingParams(max_tokens=20, logit_bias=NO_EOS, logprobs=True, top_logprobs=5),
    ],
    ids=["top_k", "top_p", "min_p", "presence", "frequency", "repetition", "logprobs"],
)
async def test_a_row_parameter_leaves_its_greedy_neighbours_alone(
    tiny_model_path: Path, changed: SamplingParams
) -> None:
    plain = SamplingParams(max_tokens=20, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        alone = await engine.complete(PROMPT, plain)
        left, middle, right = await _batch(engine, [plain, changed, plain])
    assert left.token_ids == alone.token_ids
    assert right.token_ids == alone.token_ids
    assert len(middle.token_ids) == 20


async def test_logit_bias_banning_a_token_affects_only_its_row(tiny_model_path: Path) -> None:
    plain = SamplingParams(max_tokens=20, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        alone = await engine.complete(PROMPT, plain)
        banned_token = alone.token_ids[0]
        banned = SamplingParams(max_tokens=20, logit_bias={**NO_EOS, banned_token: -100.0})
        neighbour, changed = await _batch(engine, [plain, banned])
    assert neighbour.token_ids == alone.token_ids
    assert banned_token not in changed.token_ids
    assert changed.token_ids != alone.token_ids


async def test_penalties_change_the_penalised_row(tiny_model_path: Path) -> None:
    plain = SamplingParams(max_tokens=40, logit_bias=NO_EOS)
    penalised = SamplingParams(max_tokens=40, logit_bias=NO_EOS, frequency_penalty=2.0)
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        a, b = await _batch(engine, [plain, penalised])
    assert a.token_ids != b.token_ids
    # A frequency penalty of 2 repeats tokens less.
    assert len(set(b.token_ids)) >= len(set(a.token_ids))


async def test_greedy_logprobs_are_the_top_choice_and_normalised(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=4, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        completion = await engine.complete(PROMPT, params)
        without = await engine.complete(PROMPT, SamplingParams(max_tokens=8, logit_bias=NO_EOS))
    assert without.logprobs is None
    assert completion.logprobs is not None
    assert len(completion.logprobs) == 8
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry.token_id == token_id
        assert entry.logprob <= 0.0
        assert len(entry.top) == 4
        assert entry.top[0][0] == token_id
        assert math.isclose(entry.top[0][1], entry.logprob, rel_tol=1e-5, abs_tol=1e-5)
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)


async def test_sampled_rows_in_one_batch_differ(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=20, temperature=2.0, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        a, b = await _batch(engine, [params, params])
    assert a.token_ids != b.token_ids


async def test_prompt_cache_serves_a_shared_prefix(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=6, logit_bias=NO_EOS)
    long = " ".join([PROMPT] * 20)  # past the lane's cache_min_prefix
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        first = await engine.complete(long, params)
        second = await engine.complete(long + " over the lazy dog", params)
        again = await engine.complete(long + " over the lazy dog", params)
        stats = engine.statistics()
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        uncached = await engine.complete(long + " over the lazy dog", params)
    assert first.result.cached_tokens == 0
    assert second.result.cached_tokens >= first.result.prompt_tokens - 1
    assert stats.cached_prompt_tokens == second.result.cached_tokens + again.result.cached_tokens
    assert uncached.result.cached_tokens == 0
    # Served from a shared (not copied) entry, twice: the entry stays whole.
    assert uncached.token_ids == second.token_ids == again.token_ids


async def test_prompt_cache_cap_defaults_to_a_share_of_memory_and_honours_a_setting(
    tiny_model_path: Path,
) -> None:
    import mlx.core as mx

    async with trio_mlx.open_engine(tiny_model_path) as engine:
        default = engine.statistics().prompt_cache
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=12_345_678) as engine:
        chosen = engine.statistics().prompt_cache
    assert default is not None
    assert chosen is not None
    # The tiny model's weights are a few MB: the cap is a fifth of MLX's limit, give or take.
    limit = int(mx.get_memory_limit())
    assert 0.19 * limit <= default.max_bytes <= 0.2 * limit
    assert chosen.max_bytes == 12_345_678


async def test_prompt_cache_skips_a_prefix_shorter_than_the_lanes_threshold(
    tiny_model_path: Path,
) -> None:
    params = SamplingParams(max_tokens=6, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        # The CPU's threshold, on any backend: any prefix is reused (a
        # prefilled token costs compute there).
        batch_lane(engine).cache_min_prefix = 1
        await engine.complete(PROMPT, params)
        reused = await engine.complete(PROMPT + " over the lazy dog", params)
        # The GPU's threshold: a short shared prefix is prefilled instead of fetched.
        batch_lane(engine).cache_min_prefix = 64
        await engine.complete(PROMPT + " and", params)
        skipped = await engine.complete(PROMPT + " and the quick dog", params)
    assert reused.result.cached_tokens > 0
    assert skipped.result.cached_tokens == 0


async def test_prompt_cache_holds_no_more_memory_than_it_counts(tiny_model_path: Path) -> None:
    # A finished row's cache comes out of the batch as a lazy slice of the
    # batch's whole KV buffers; stored unevaluated, each entry kept a buffer
    # alive that its byte count did not see (measured: 1-1.5 GB under a 36 MB count).
    import mlx.core as mx

    async with trio_mlx.open_engine(tiny_model_path, max_batch=16) as engine:

        def active(model: object, tokenizer: object) -> int:
            mx.synchronize()
            return int(mx.get_active_memory())

        baseline = await engine.run_exclusive(active)

        async def one(i: int) -> None:
            prompt = f"{PROMPT} {i} " * (1 + i % 7)
            params = SamplingParams(max_tokens=4 + i % 29, logit_bias=NO_EOS)
            await engine.complete(prompt, params)

        for wave in range(6):
            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, wave * 16 + i)
        held = await engine.run_exclusive(active) - baseline
        counted = engine.statistics().prompt_cache_bytes
        assert counted > 0
        # What the cache counts, plus slack for MLX's own small allocations.
        assert held <= 2 * counted + 4 * 2**20, (held, counted)


async def test_extreme_top_k_and_top_p_sample_instead_of_failing(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        vocab = len(engine.tokenizer.get_vocab())
        base = SamplingParams(max_tokens=8, logit_bias=NO_EOS, temperature=0.8, seed=5)
        greedy = await engine.complete(PROMPT, SamplingParams(max_tokens=8, logit_bias=NO_EOS))
        whole = await engine.complete(PROMPT, base)
        past_vocab = await engine.complete(PROMPT, attrs.evolve(base, top_k=vocab + 1000))
        tiny_p = await engine.complete(PROMPT, attrs.evolve(base, top_p=1e-300))
    # top_k past the vocabulary keeps every token: the same draw as no top_k.
    assert past_vocab.token_ids == whole.token_ids
    # A vanishing top_p keeps only the most likely token: greedy decoding.
    assert tiny_p.token_ids == greedy.token_ids


async def test_a_vanishing_temperature_is_greedy_and_spoils_no_later_row(
    tiny_model_path: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        greedy = await engine.complete(PROMPT, SamplingParams(max_tokens=8, logit_bias=NO_EOS))
        tiny = [
            await engine.complete(
                PROMPT, SamplingParams(max_tokens=8, logit_bias=NO_EOS, temperature=t)
            )
            for t in (1e-300, 5e-324)
        ]
        # top_k=1 keeps only the most likely token: greedy, whatever the random state.
        top_1 = await engine.complete(
            PROMPT, SamplingParams(max_tokens=8, logit_bias=NO_EOS, temperature=1.0, top_k=1)
        )
    assert [c.token_ids for c in tiny] == [greedy.token_ids] * 2
    assert top_1.token_ids == greedy.token_ids


#: logit_bias that makes the tiny model end at once (its EOS id 2 always wins).
_EOS_NOW = {2: 100.0}


@pytest.mark.parametrize("lane", ["batch", "serial"])
async def test_ignore_eos_and_min_tokens_keep_a_row_going(tiny_model_path: Path, lane: str) -> None:
    # A seed sends a request to the serial lane; greedy decoding ignores it.
    seed = {"seed": 1} if lane == "serial" else {}
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        ends = await engine.complete(PROMPT, SamplingParams(logit_bias=_EOS_NOW, **seed))
        ignored = await engine.complete(
            PROMPT, SamplingParams(max_tokens=5, logit_bias=_EOS_NOW, ignore_eos=True, **seed)
        )
        held = await engine.complete(
            PROMPT, SamplingParams(max_tokens=9, logit_bias=_EOS_NOW, min_tokens=4, **seed)
        )
    assert (ends.result.finish_reason, ends.result.completion_tokens, ends.result.lane) == (
        "stop",
        1,
        lane,
    )
    # ignore_eos: the EOS ids are ordinary tokens; only max_tokens ends the row.
    assert ignored.result.finish_reason == "length"
    assert ignored.token_ids == (2, 2, 2, 2, 2)
    # min_tokens: EOS is banned for 4 tokens, then wins at once.
    assert held.result.finish_reason == "stop"
    assert held.result.completion_tokens == 5
    assert len(held.token_ids) == 4
    assert 2 not in held.token_ids


@pytest.mark.parametrize("include", [False, True])
async def test_include_stop_str_in_output_keeps_the_stop_string(
    tiny_model_path: Path, include: bool
) -> None:
    plain = SamplingParams(max_tokens=30, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        whole = (await engine.complete(PROMPT, plain)).text
        stop = whole[10:13]
        cut = await engine.complete(
            PROMPT, attrs.evolve(plain, stop=[stop], include_stop_str_in_output=include)
        )
    at = whole.index(stop)
    assert cut.result.finish_reason == "stop"
    assert cut.text == (whole[: at + len(stop)] if include else whole[:at])


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(trio_mlx.InvalidRequest) as caught:
        SamplingParams(max_tokens=3, min_tokens=4)
    assert caught.value.param == "min_tokens"
    with pytest.raises(trio_mlx.InvalidRequest) as caught:
        SamplingParams(ignore_eos=1)  # type: ignore[arg-type]
    assert caught.value.param == "ignore_eos"


async def test_min_tokens_counts_on_across_a_park(tiny_model_path: Path) -> None:
    # EOS always wins, so each row ends the moment min_tokens lets it: a park halfway
    # (an exclusive job preempts the batch) must not restart or skip the count.
    params = SamplingParams(max_tokens=60, logit_bias=_EOS_NOW, min_tokens=30)
    async with trio_mlx.open_engine(
        tiny_model_path, drain_timeout=0.0, min_batch_steps=0, prompt_cache_bytes=0
    ) as engine:
        results: list[trio_mlx.GenerationResult | None] = [None, None]
        lengths = [0, 0]
        started = trio.Event()

        async def row(i: int) -> None:
            async with engine.generate(PROMPT, params) as stream:
                async for delta in stream:
                    lengths[i] += len(delta.token_ids)
                    if lengths[i] >= 10:
                        started.set()
                results[i] = stream.result

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(row, i)
            await started.wait()
            await engine.run_exclusive(lambda model, tokenizer: None)
        assert engine.statistics().preemptions >= 1
    assert lengths == [30, 30]
    for result in results:
        assert result is not None
        assert (result.finish_reason, result.completion_tokens) == ("stop", 31)
