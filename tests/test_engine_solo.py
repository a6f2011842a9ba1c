"""A row decoding alone in the batch lane runs over plain caches (``BatchLane.solo_decode``).

A one-row ``BatchKVCache`` pays for being a batch on every step (array offsets,
a boolean mask); alone, the row's caches become mlx-lm's ``KVCache`` over the
same buffers, and go back to a batch as soon as anything touches the batch.
These tests check that a row's tokens do not depend on it: joining, parking,
being stored in the prompt cache and the switch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trio_mlx
from engine_helpers import NO_EOS, PROMPT
from trio_mlx import SamplingParams
from trio_mlx.testing import BatchLane, PromptCache, RowSpec, StepPlan, batch_lane

PROMPTS = ["Hello world", "The quick brown fox", " ".join([PROMPT] * 6)]


def _tokens(lane: BatchLane, result: Any, into: dict[int, list[int]]) -> None:
    for e in result.events:
        assert e.error is None
        into.setdefault(e.id, []).extend(e.token_ids)


def _run(
    model: Any, tokenizer: Any, *, solo: bool, join_at: int | None, park_at: int | None
) -> tuple[dict[int, list[int]], list[bool]]:
    """Row 0 alone; row 1 joins at step ``join_at``; row 0 is parked and resumed at ``park_at``."""
    lane = BatchLane(model, tokenizer, max_batch=4, solo_decode=solo)
    lane.removal_fraction, lane.removal_delay = 0, 3
    specs = [
        RowSpec(
            i, tuple(tokenizer.encode(PROMPTS[i])), SamplingParams(max_tokens=n, logit_bias=NO_EOS)
        )
        for i, n in ((0, 24), (1, 40))
    ]
    tokens: dict[int, list[int]] = {}
    states: list[bool] = []
    _tokens(lane, lane.step(StepPlan([specs[0]])), tokens)
    for k in range(200):
        if not lane.rows:
            break
        if k == join_at:
            _tokens(lane, lane.step(StepPlan([specs[1]])), tokens)
        elif k == park_at:
            lane.park([0])
            assert not lane.solo, "a parked row leaves an empty batch"
            _tokens(lane, lane.step(StepPlan(resumes=[0])), tokens)
        else:
            _tokens(lane, lane.step(), tokens)
        states.append(lane.solo)
    assert not lane.rows
    return tokens, states


@pytest.mark.parametrize(
    ("join_at", "park_at"), [(None, None), (6, None), (None, 5), (8, 4)], ids=str
)
def test_a_row_alone_decodes_over_plain_caches_and_its_tokens_do_not_change(
    tiny_model: tuple[Any, Any], join_at: int | None, park_at: int | None
) -> None:
    model, tokenizer = tiny_model
    solo, states = _run(model, tokenizer, solo=True, join_at=join_at, park_at=park_at)
    batched, batched_states = _run(model, tokenizer, solo=False, join_at=join_at, park_at=park_at)
    assert solo == batched
    assert len(solo[0]) == 24
    assert not any(batched_states)
    assert states[2], "the row alone went solo after its first steps"
    if join_at is not None:
        # The arrival is prefilled on its step and joins on the next one.
        assert states[join_at], "a row in prefill is not in the decode batch yet"
        assert not states[join_at + 1], "a row joining turns the batch back into a batch"
        assert len(solo[1]) == 40
        assert states[-2], "once the first row's slot is freed, the last row goes solo again"


def test_a_row_alone_is_stored_in_the_prompt_cache_and_reused_exactly(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    lane = BatchLane(model, tokenizer, max_batch=4, prompt_cache=PromptCache(1 << 30))
    lane.cache_min_prefix = 1
    prompt = tuple(tokenizer.encode(PROMPTS[2]))
    params = SamplingParams(max_tokens=12, logit_bias=NO_EOS)

    def run(row_id: int) -> tuple[list[int], int, bool]:
        tokens: dict[int, list[int]] = {}
        result = lane.step(StepPlan([RowSpec(row_id, prompt, params)]))
        cached, went_solo = result.cached[row_id], False
        _tokens(lane, result, tokens)
        while lane.rows:
            _tokens(lane, lane.step(), tokens)
            went_solo |= lane.solo
        return tokens[row_id], cached, went_solo

    first, cached, went_solo = run(1)
    assert (cached, went_solo) == (0, True)
    second, cached, _ = run(2)
    assert cached >= len(prompt) - 1, "the row stored from its plain caches"
    assert second == first


def test_a_padded_row_is_copied_out_and_back_unchanged() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from trio_mlx._lanes.mlxlm_batch import one_row_cache, plain_cache

    cache = BatchKVCache([2])
    keys = mx.arange(2 * 5 * 4, dtype=mx.float32).reshape(1, 2, 5, 4)
    cache.update_and_fetch(keys, -keys)
    plain = plain_cache(cache, 2)
    assert plain.offset == 3
    assert mx.array_equal(plain.keys[..., :3, :], keys[..., 2:, :]).item()
    back = one_row_cache(plain)
    assert back.left_padding.tolist() == [0]
    assert back.offset.tolist() == [3]
    k, v = back.keys_and_values()
    assert mx.array_equal(k, keys[..., 2:, :]).item()
    assert mx.array_equal(v, -keys[..., 2:, :]).item()
    # Unpadded, the plain cache takes the batch cache's buffers as they are.
    unpadded = BatchKVCache([0])
    unpadded.update_and_fetch(keys, keys)
    assert plain_cache(unpadded, 0).keys is unpadded.keys


async def test_the_switch_reaches_the_lane(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for value, expected in (("0", False), ("1", True)):
        monkeypatch.setenv("TRIO_MLX_SOLO_DECODE", value)
        async with trio_mlx.open_engine(tiny_model_path, max_batch=2) as engine:
            assert batch_lane(engine).solo_decode is expected


@pytest.mark.parametrize(("ours", "theirs"), [(5, 300), (300, 5), (7, 7)], ids=str)
def test_rows_joining_the_batch_get_the_caches_mlx_lm_would_build(ours: int, theirs: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from trio_mlx._lanes.mlxlm_batch import join_caches

    def cache(rows: int, length: int, padding: list[int], seed: int) -> BatchKVCache:
        c = BatchKVCache(padding)
        key = mx.random.key(seed)
        c.update_and_fetch(
            mx.random.normal((rows, 2, length, 4), key=key),
            mx.random.normal((rows, 2, length, 4), key=mx.random.split(key)[0]),
        )
        return c

    def pair() -> tuple[BatchKVCache, BatchKVCache]:
        return cache(3, ours, [0, 2, 1], 1), cache(2, theirs, [1, 0], 2)

    expected, other = pair()
    expected.extend(other)  # mlx-lm's
    layers = [pair(), pair()]
    assert join_caches([a for a, _ in layers], [b for _, b in layers])
    for joined, _ in layers:
        assert joined._idx == expected._idx
        assert joined.left_padding.tolist() == expected.left_padding.tolist()
        assert joined.offset.tolist() == expected.offset.tolist()
        for got, want in zip(joined.keys_and_values(), expected.keys_and_values(), strict=True):
            assert got.shape == want.shape
            assert mx.array_equal(got, want).item()
    # Anything but plain batch caches is left to mlx-lm.
    assert not join_caches([BatchKVCache([0])], [cache(1, 3, [0], 3)])


def test_a_model_whose_caches_are_not_plain_batch_caches_never_goes_solo(
    tiny_model: tuple[Any, Any],
) -> None:
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    from trio_mlx._lanes.mlxlm_batch import generation_class

    model, _ = tiny_model
    generation = generation_class().empty(model, None)
    generation.prompt_cache = [BatchKVCache([0]), BatchRotatingKVCache(16, [0])]
    generation._enter_solo()
    assert not generation.solo
    assert not generation.solo_allowed, "the model's cache kinds do not change: not tried again"
    assert type(generation.prompt_cache[1]) is BatchRotatingKVCache
