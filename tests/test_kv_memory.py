"""The KV memory rules (pure): what rows cost at worst, and whether they fit a budget."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_mlx._memory import (
    KV_MEMORY_FRACTION,
    MIN_PROMPT_CACHE_BYTES,
    MIN_ROW_TOKENS,
    PROMPT_CACHE_FRACTION,
    KVBudget,
    KVProfile,
    default_limit,
    default_prompt_cache,
)

PROFILES = st.builds(
    KVProfile,
    per_token=st.integers(0, 1 << 20),
    windows=st.lists(st.tuples(st.integers(1, 1 << 16), st.integers(0, 1 << 16)), max_size=3).map(
        tuple
    ),
    per_row=st.integers(0, 1 << 20),
    step=st.sampled_from([1, 64, 256]),
)
TOKENS = st.integers(0, 1 << 20)


@given(PROFILES, TOKENS, TOKENS)
def test_a_longer_row_never_costs_less(profile: KVProfile, a: int, b: int) -> None:
    low, high = sorted((a, b))
    assert profile.row_bytes(low) <= profile.row_bytes(high)


@given(PROFILES, TOKENS)
def test_windowed_layers_cost_no_more_than_their_window(profile: KVProfile, tokens: int) -> None:
    length = -(-tokens // profile.step) * profile.step
    bound = sum(cost * window for window, cost in profile.windows)
    assert profile.row_bytes(tokens) <= profile.per_token * length + bound + profile.per_row


@given(PROFILES, st.lists(TOKENS, min_size=1, max_size=8))
def test_a_batch_costs_its_rows_padded_to_the_longest(
    profile: KVProfile, lengths: list[int]
) -> None:
    cost = profile.batch_bytes(lengths)
    assert cost == len(lengths) * profile.row_bytes(max(lengths))
    assert cost >= sum(profile.row_bytes(n) for n in lengths)


@given(PROFILES, st.integers(0, 1 << 40), st.lists(TOKENS, max_size=8), st.data())
def test_what_fits_still_fits_with_a_row_taken_out(
    profile: KVProfile, limit: int, lengths: list[int], data: st.DataObject
) -> None:
    budget = KVBudget(profile, limit)
    if budget.fits(lengths) and lengths:
        del lengths[data.draw(st.integers(0, len(lengths) - 1))]
        assert budget.fits(lengths)


@given(PROFILES, st.integers(0, 1 << 40))
def test_row_capacity_is_the_longest_row_that_fits_alone(profile: KVProfile, limit: int) -> None:
    budget = KVBudget(profile, limit)
    capacity = budget.row_capacity()
    if capacity is None:
        assert budget.fits([1 << 40])
    elif profile.row_bytes(0) > limit:
        assert capacity == 0
    else:
        assert budget.fits([capacity])
        assert not budget.fits([capacity + 1])


def test_the_default_budget_is_a_share_of_memory_less_weights_and_the_prompt_cache() -> None:
    profile = KVProfile(per_token=1024)
    memory, weights, cache = 10 << 30, 2 << 30, 256 << 20
    expected = int((memory - weights) * KV_MEMORY_FRACTION) - cache
    assert default_limit(memory, weights, cache, profile) == expected
    # Weights larger than memory: still one row of MIN_ROW_TOKENS.
    floor = profile.row_bytes(MIN_ROW_TOKENS)
    assert default_limit(1 << 30, 2 << 30, 0, profile) == floor


def test_a_bad_profile_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="'per_token' must be an int >= 0: -1"):
        KVProfile(per_token=-1)
    with pytest.raises(ValueError, match="'windows' must be a tuple"):
        KVProfile(windows=((1, -2),))


@given(st.integers(0, 1 << 42), st.integers(0, 1 << 42))
def test_the_default_prompt_cache_is_a_share_of_what_the_weights_leave(
    memory: int, weights: int
) -> None:
    cap = default_prompt_cache(memory, weights)
    assert cap >= MIN_PROMPT_CACHE_BYTES
    assert cap == max(MIN_PROMPT_CACHE_BYTES, int((memory - weights) * PROMPT_CACHE_FRACTION))


def test_a_large_gpu_holds_an_agents_turns_in_the_default_prompt_cache() -> None:
    # A 1B llama (2.5 GB of bf16 weights, 32 KB of KV a token) on 80% of 141 GB:
    # ten 40k-token checkpoints fit; the former fixed 256 MiB held none.
    cap = default_prompt_cache(int(0.8 * 141e9), int(2.5e9))
    assert cap >= 10 * 40_000 * 32 * 1024
