"""The optional CUDA warm-up: which token counts it primes, and that it only runs when asked."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from trio_mlx import SamplingParams
from trio_mlx._start import warmup as _cuda_warmup
from trio_mlx.testing import BatchLane, PromptCache, RowSpec, StepPlan


class CountingModel:
    """The real tiny model, recording the token count of every forward pass."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.widths: list[int] = []
        self.layers = model.layers  # what mlx-lm's make_prompt_cache reads

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        self.widths.append(int(tokens.shape[1]))
        return self.model(tokens, cache=cache)


def test_prime_widths_cover_every_batch_size_and_every_eighth_width() -> None:
    """Decode batches of 1..max_batch rows and prefill widths 8, 16, ... up to the budget."""
    assert _cuda_warmup.prime_widths(4, 20) == [1, 2, 3, 4, 8, 16]
    widths = _cuda_warmup.prime_widths(64, 768)
    assert widths == sorted(set(widths))
    assert set(range(1, 65)) <= set(widths)
    assert {w for w in widths if w > 64} == set(range(72, 769, 8))


def test_warm_up_is_off_unless_asked_and_only_on_cuda(tiny_model: tuple[Any, Any]) -> None:
    """No variable, a value other than 1, or no CUDA: no forward pass at all."""
    counting = CountingModel(tiny_model[0])
    for environ, cuda in (({}, True), ({"TRIO_MLX_CUDA_WARMUP": "0"}, True),
                          ({"TRIO_MLX_CUDA_WARMUP": "1"}, False)):  # fmt: skip
        assert _cuda_warmup.warm_up(counting, 4, 32, environ, cuda=cuda) == {}
    assert counting.widths == []


def test_warm_up_primes_each_width_once_and_leaves_the_model_unchanged(
    tiny_model: tuple[Any, Any],
) -> None:
    """Asked for, on CUDA: one pass per width, into scratch caches; later outputs are the same."""
    model = tiny_model[0]
    prompt = mx.array([[3, 5, 7, 11]])
    before = model(prompt, cache=make_prompt_cache(model))
    counting = CountingModel(model)
    done = _cuda_warmup.warm_up(counting, 3, 24, {"TRIO_MLX_CUDA_WARMUP": "1"}, cuda=True)
    assert counting.widths == [1, 2, 3, 8, 16, 24]
    assert done["primed_widths"] == 6
    assert done["seconds"] >= 0
    after = model(prompt, cache=make_prompt_cache(model))
    assert mx.array_equal(before, after).item()


def _greedy(lane: BatchLane, prompts: list[tuple[int, ...]]) -> dict[int, list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens: dict[int, list[int]] = {}
    plan = StepPlan([RowSpec(100 + i, p, params) for i, p in enumerate(prompts)])
    while True:
        for event in lane.step(plan).events:
            assert event.error is None
            tokens.setdefault(event.id, []).extend(event.token_ids)
        plan = StepPlan()
        if not lane.rows:
            return tokens


def test_the_lane_pass_meets_the_lanes_paths_and_leaves_it_as_it_was(
    tiny_model: tuple[Any, Any],
) -> None:
    """Asked for, on CUDA, with the lane: its schedule runs (a prompt-cache hit among
    it), no row and no cache entry is left, and the lane decodes as a fresh one does."""
    model, tokenizer = tiny_model
    prompts = [tuple(tokenizer.encode(p)) for p in ("Hello world", "def main():")]

    def fresh() -> BatchLane:
        lane = BatchLane(model, tokenizer, max_batch=12)
        lane.prefill_budget = 48  # the pass's long prompt is prefilled in chunks
        lane.prompt_cache = PromptCache(1 << 26)
        return lane

    want = _greedy(fresh(), prompts)
    lane = fresh()
    done = _cuda_warmup.warm_up(model, 12, 48, {"TRIO_MLX_CUDA_WARMUP": "1"}, cuda=True, lane=lane)
    assert done["lane_rows"] == 8 + 4  # a batch of max_batch - 4, two joining, two later
    assert 20 < done["lane_calls"] < _cuda_warmup.LANE_PASS_STEPS
    assert done["lane_cached"] >= 64, "the 130-token prompt came again and hit the cache"
    assert lane.rows == 0
    assert lane.prompt_cache is not None
    assert lane.prompt_cache.nbytes == 0
    assert lane.decode_steps > 20
    assert _greedy(lane, prompts) == want


def test_a_lane_pass_that_fails_leaves_the_lane_empty_and_the_load_going(
    tiny_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the schedule raises half-way; the warm-up logs it, returns
    what it did, and leaves no row behind."""
    model, tokenizer = tiny_model
    lane = BatchLane(model, tokenizer, max_batch=12)
    lane.prompt_cache = PromptCache(1 << 26)
    real = BatchLane.park

    def broken(self: BatchLane, ids: Any) -> None:
        real(self, ids)
        raise RuntimeError("injected")

    monkeypatch.setattr(BatchLane, "park", broken)
    done = _cuda_warmup.warm_up(model, 12, 48, {"TRIO_MLX_CUDA_WARMUP": "1"}, cuda=True, lane=lane)
    assert "lane_rows" not in done
    assert done["primed_widths"] > 0
    assert lane.rows == 0
    assert lane.prompt_cache.nbytes == 0
