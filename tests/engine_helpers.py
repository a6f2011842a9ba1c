"""Helpers shared by the engine tests."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

import trio_mlx

#: logit_bias that keeps the tiny model from ending a row early (its EOS ids are 0 and 2).
NO_EOS = {0: -100.0, 2: -100.0}
#: A prompt the engine tests share.
PROMPT = "The quick brown fox jumps"


def make_adapter(
    model_path: Path,
    out: Path,
    *,
    seed: int = 3,
    rank: int = 4,
    scale: float = 20.0,
    num_layers: int = 2,
    keys: list[str] | None = None,
) -> Path:
    """A random LoRA adapter for a model (lora_b non-zero, so it changes outputs)."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _tokenizer = mlx_lm.load(str(model_path))
    lora: dict[str, object] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        lora["keys"] = keys
    model.freeze()
    linear_to_lora_layers(model, num_layers, lora)
    mx.random.seed(seed)
    weights = {
        name: mx.random.normal(value.shape) * 0.5
        for name, value in tree_flatten(model.trainable_parameters())
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": lora}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def make_embedder(source: Path, folder: Path) -> Path:
    """A copy of the model at ``source`` whose sentence-transformers files ask for mean
    pooling (what an embedding model's folder says)."""
    shutil.copytree(source, folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    return folder


async def wait_until(predicate: Callable[[], bool], *, poll: float = 0.005) -> None:
    """Poll ``predicate`` (it reads ``engine.statistics()``) until it holds.

    Statistics are snapshots, not events: polling them is what an outside
    observer (a test, ``/metrics``) does. Wrap the call in ``trio.fail_after``.
    """
    while not predicate():  # noqa: ASYNC110 - polling a snapshot on purpose
        await trio.sleep(poll)


async def generate_across_a_park(
    engine: trio_mlx.Engine,
    prompts: Sequence[str],
    params: trio_mlx.SamplingParams,
    *,
    after: int,
) -> list[tuple[int, ...]]:
    """Each prompt's tokens, generated together; once one row has streamed ``after``
    tokens, an exclusive job parks them all and they resume."""
    parked: list[tuple[int, ...]] = [()] * len(prompts)
    started = trio.Event()

    async def row(i: int) -> None:
        async with engine.generate(prompts[i], params) as stream:
            ids: list[int] = []
            async for delta in stream:
                ids.extend(delta.token_ids)
                if len(ids) >= after:
                    started.set()
            parked[i] = tuple(ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(row, i)
        await started.wait()
        await engine.run_exclusive(lambda model, tokenizer: None)
    return parked
