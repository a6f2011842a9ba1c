"""The prompt cache serves an agent's next turn whatever the model's cache kind.

An agent resends its system prompt and the previous prompt, then the previous
reply changed (its reasoning stripped) and a tool result: the next turn shares
the previous *prompt*, not its reply. Tiny random models of each cache kind:
plain ``KVCache`` (llama), sliding-window layers beside full ones that wrap
and that do not (gemma3_text), linear-attention state beside full attention
(qwen3_next), and a quantized KV cache (``kv_bits``, the serial lane).
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import trio

from trio_mlx import SamplingParams, open_engine
from trio_mlx.testing import make_random_model

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "sigma", "river")

#: family name -> (mlx-lm model type, config overrides)
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "gemma3-wrapping": ("gemma3_text", {}),  # a 32-token window: every prompt wraps it
    "gemma3-unwrapped": ("gemma3_text", {"sliding_window": 4096}),
    "qwen3_next": ("qwen3_next", {}),
    "llama-kv8": ("llama", {"head_dim": 64}),
}


def words(n: int, seed: int) -> str:
    pick = random.Random(seed)
    return " ".join(pick.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    return {
        name: make_random_model(root / name, model_type, **overrides)
        for name, (model_type, overrides) in KINDS.items()
    }


def params(lane: str, kind: str) -> SamplingParams:
    if kind == "llama-kv8":
        return SamplingParams(max_tokens=8, temperature=0.0, kv_bits=8)
    # A fixed seed runs in the serial lane; greedy sampling ignores it.
    return SamplingParams(max_tokens=8, temperature=0.0, seed=1 if lane == "serial" else None)


async def converse(
    model: Path, sampling: SamplingParams, turns: int, **engine: Any
) -> list[tuple[int, int, tuple[int, ...], str]]:
    """(prompt tokens, cached tokens, reply ids, lane) of each turn of an agent's
    conversation whose replies come back shortened."""
    messages = [
        {"role": "system", "content": words(120, 1)},
        {"role": "user", "content": "start " + words(10, 2)},
    ]
    seen = []
    async with open_engine(model, **engine) as e:
        for turn in range(turns):
            done = await e.complete(messages, sampling)
            result = done.result
            seen.append((result.prompt_tokens, result.cached_tokens, done.token_ids, result.lane))
            messages.append({"role": "assistant", "content": done.text[: len(done.text) // 2]})
            messages.append({"role": "user", "content": "result " + words(25, 10 + turn)})
    return seen


# A quantized KV cache runs in the serial lane only: no batch case for it.
CASES = [
    (kind, lane)
    for kind in KINDS
    for lane in ("batch", "serial")
    if not (kind == "llama-kv8" and lane == "batch")
]


@pytest.mark.parametrize(("kind", "lane"), CASES)
async def test_next_turn_reuses_the_previous_prompt_and_answers_the_same(
    models: dict[str, Path], kind: str, lane: str
) -> None:
    sampling = params(lane, kind)
    with trio.fail_after(120):
        cached = await converse(models[kind], sampling, 3)
        fresh = await converse(models[kind], sampling, 3, prompt_cache_bytes=0)
    expected_lane = "serial" if kind == "llama-kv8" else lane
    assert [turn[3] for turn in cached] == [expected_lane] * 3
    assert cached[0][1] == 0
    for before, now in itertools.pairwise(cached):
        assert now[1] >= before[0] - 2, (kind, lane, [t[:2] for t in cached])
    assert [turn[1] for turn in fresh] == [0, 0, 0]
    # Greedy replies with the cache hit are the replies computed from scratch.
    assert [turn[2] for turn in cached] == [turn[2] for turn in fresh]


async def test_statistics_count_hits_and_tokens_reused(models: dict[str, Path]) -> None:
    with trio.fail_after(60):
        async with open_engine(models["qwen3_next"]) as engine:
            messages = [
                {"role": "system", "content": words(120, 1)},
                {"role": "user", "content": "start"},
            ]
            first = await engine.complete(messages, SamplingParams(max_tokens=4))
            messages += [
                {"role": "assistant", "content": "changed"},
                {"role": "user", "content": "more"},
            ]
            second = await engine.complete(messages, SamplingParams(max_tokens=4))
            stats = engine.statistics().prompt_cache
    assert stats is not None
    assert (stats.hits, stats.misses) == (1, 1)
    assert stats.tokens_reused == second.result.cached_tokens >= first.result.prompt_tokens - 1
    assert stats.entries >= 2
    assert 0 < stats.bytes <= stats.max_bytes
