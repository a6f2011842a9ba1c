"""The optional CUDA warm-up: which token counts it primes, and that it only runs when asked."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from trio_mlx import _cuda_warmup


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
