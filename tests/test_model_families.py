"""Every model family the project claims, through the engine: both lanes, the
prompt cache, an adapter, a JSON schema and embeddings, on a tiny random model of each
(``trio_mlx.testing.make_random_model``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from engine_helpers import NO_EOS, make_adapter
from trio_mlx import SamplingParams
from trio_mlx.testing import FAMILIES, batch_lane, make_random_model

pytestmark = pytest.mark.model

#: Past the families' 32-token sliding windows: a RotatingKVCache wraps.
LONG = "The quick brown fox jumps over the lazy dog, " * 8
PROMPTS = [LONG, "Hello world", "def main():\n    return"]
GREEDY = SamplingParams(max_tokens=8, logit_bias=NO_EOS)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model of one family (built once per module and family)."""
    name: str = request.param
    return make_random_model(tmp_path_factory.mktemp("families") / name, name)


def _adapter_keys(model_path: Path) -> list[str]:
    """Two linear layers of the model's last block, its attention's where it has them."""
    import mlx.nn as nn
    import mlx_lm

    model, _ = mlx_lm.load(str(model_path))
    linear = [
        name
        for name, module in model.layers[-1].named_modules()
        if isinstance(module, nn.Linear) and "." in name
    ]
    attention = [k for k in linear if k.endswith(("q_proj", "v_proj"))]
    return sorted(attention or linear)[:2]


async def test_embeddings_equal_the_models_own_forward_pass(family: Path) -> None:
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    model, _ = mlx_lm.load(str(family))
    async with trio_mlx.open_engine(family, embedding_pooling="last") as engine:
        result = await engine.embed(PROMPTS)  # one padded pass, or one a pass
        ids = [engine.encode(prompt) for prompt in PROMPTS]
    for tokens, vector in zip(ids, result.vectors, strict=True):
        hidden = np.array(model.model(mx.array([tokens]))[0, -1].astype(mx.float32))
        np.testing.assert_allclose(vector, hidden / np.linalg.norm(hidden), atol=2e-5)


async def test_batched_rows_equal_each_request_alone(family: Path) -> None:
    async with trio_mlx.open_engine(family, max_batch=4, prompt_cache_bytes=0) as engine:
        alone = [await engine.complete(p, GREEDY) for p in PROMPTS]
        together: list[Any] = [None] * len(PROMPTS)

        async def one(i: int) -> None:
            together[i] = await engine.complete(PROMPTS[i], GREEDY)

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) == GREEDY.max_tokens for c in alone)


async def test_the_serial_lane_gives_the_batch_lanes_tokens(family: Path) -> None:
    async with trio_mlx.open_engine(family, prompt_cache_bytes=0) as engine:
        batch = await engine.complete(LONG, GREEDY)
    async with trio_mlx.open_engine(family, max_batch=1, prompt_cache_bytes=0) as engine:
        serial = await engine.complete(LONG, GREEDY)
    assert serial.result.lane == "serial"
    assert serial.token_ids == batch.token_ids


#: Caches that cannot be cut back once past their window (a wrapped RotatingKVCache):
#: a repeated prompt longer than the window is prefilled again.
SLIDING = {"gpt_oss", "gemma3_text"}
#: Linear-attention or convolution state cannot be cut back at all: no entry,
#: which holds the prompt and its answer, serves a later prompt yet.
NEVER_TRIMMED = {"qwen3_next", "lfm2"}


async def test_a_repeated_prompt_reuses_the_cache_with_the_same_answer(family: Path) -> None:
    prompt = PROMPTS[2] if family.name in SLIDING else LONG
    async with trio_mlx.open_engine(family) as engine:
        batch_lane(engine).cache_min_prefix = 1  # the CPU's threshold, on any backend
        first = await engine.complete(prompt, GREEDY)
        again = await engine.complete(prompt, GREEDY)
    assert again.token_ids == first.token_ids
    assert first.result.cached_tokens == 0
    if family.name not in NEVER_TRIMMED:
        assert again.result.cached_tokens == first.result.prompt_tokens - 1


async def test_an_adapter_changes_the_answer(
    family: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    adapter = make_adapter(
        family,
        tmp_path_factory.mktemp("adapters") / family.name,
        num_layers=1,
        keys=_adapter_keys(family),
    )
    params = SamplingParams(max_tokens=8, logit_bias=NO_EOS, adapter="a")
    async with trio_mlx.open_engine(family, max_batch=4) as engine:
        await engine.mount_adapter("a", adapter)
        base = await engine.complete(LONG, GREEDY)
        adapted = await engine.complete(LONG, params)
        both: list[Any] = [None, None]

        async def one(i: int, p: SamplingParams) -> None:
            both[i] = await engine.complete(LONG, p)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, GREEDY)
            nursery.start_soon(one, 1, params)
    assert adapted.token_ids != base.token_ids
    assert [c.token_ids for c in both] == [base.token_ids, adapted.token_ids]


async def test_a_json_schema_constrains_the_answer(family: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=40, json_schema=schema)
    async with trio_mlx.open_engine(family) as engine:
        completion = await engine.complete(LONG, params)
    assert completion.result.finish_reason == "stop"
    assert isinstance(json.loads(completion.text)["ok"], bool)


async def test_a_hybrid_model_turns_the_traced_step_off_with_one_info_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The traced decode step is CUDA's by default; forced here, it runs its check on the CPU.
    monkeypatch.setenv("TRIO_MLX_TRACED_DECODE", "1")
    path = make_random_model(tmp_path / "qwen3_next", "qwen3_next")
    caplog.set_level(logging.INFO, logger="trio_mlx")
    async with trio_mlx.open_engine(path) as engine:
        completion = await engine.complete(PROMPTS[1], GREEDY)
    assert len(completion.token_ids) == GREEDY.max_tokens
    traced = [r for r in caplog.records if "traced decode" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in traced] == [(logging.INFO, None)]
    assert "ArraysCache" in traced[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
