"""Several LoRA adapters in one batch: per-row adapters equal each adapter run alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from engine_helpers import NO_EOS, make_adapter, wait_until
from trio_mlx import AdapterConflict, NotFound, SamplingParams, default_adapter_path
from trio_mlx._adapters.multilora import METHODS, method_for_device
from trio_mlx.testing import adapter_registry

pytestmark = pytest.mark.model

PROMPTS = [
    "The quick brown fox jumps",
    "def main():",
    "Once upon a time",
    "import os",
    "The quick brown fox jumps",
    "class Foo:",
    "Once upon a time",
    "for i in range(10):",
]
#: Row i runs under ADAPTERS[i] (None: the base model); three adapters and the base.
ADAPTERS: list[str | None] = [None, "shout", "wide", "deep", "shout", None, "deep", "wide"]


def _params(adapter: str | None, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, logit_bias=NO_EOS, adapter=adapter)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The bundled shout adapter and two random ones: other ranks, other layers."""
    model = trio_mlx.default_model_path()
    folder = tmp_path_factory.mktemp("multilora")
    return {
        "shout": default_adapter_path("shout"),
        "wide": make_adapter(model, folder / "wide", seed=11, rank=4, scale=4.0),
        "deep": make_adapter(
            model,
            folder / "deep",
            seed=12,
            rank=2,
            scale=4.0,
            num_layers=4,
            keys=["self_attn.o_proj", "mlp.down_proj"],
        ),
    }


async def _mount_all(engine: trio_mlx.Engine, adapters: dict[str, Path]) -> None:
    for name, path in adapters.items():
        await engine.mount_adapter(name, path)


@pytest.fixture(scope="module")
def alone(adapters: dict[str, Path]) -> dict[tuple[str, str | None], list[int]]:
    """Every (prompt, adapter) run alone through the serial lane (max_batch=1)."""
    results: dict[tuple[str, str | None], list[int]] = {}

    async def main() -> None:
        async with trio_mlx.open_engine(max_batch=1, prompt_cache_bytes=0) as engine:
            await _mount_all(engine, adapters)
            for prompt, adapter in zip(PROMPTS, ADAPTERS, strict=True):
                result = await engine.complete(prompt, _params(adapter))
                results[prompt, adapter] = list(result.token_ids)
            assert engine.statistics().requests["serial:finished"] == len(PROMPTS)

    trio.run(main)
    return results


@pytest.mark.parametrize("method", METHODS)
async def test_eight_rows_over_three_adapters_and_the_base_equal_each_run_alone(
    adapters: dict[str, Path], alone: dict[tuple[str, str | None], list[int]], method: str
) -> None:
    # The adapters change the output (else equality would prove nothing).
    for prompt in ("The quick brown fox jumps", "Once upon a time"):
        outputs = {tuple(alone[p, a]) for p, a in alone if p == prompt}
        assert len(outputs) == 2  # each of these prompts runs under two different adapters
    results: dict[int, list[int]] = {}
    async with trio_mlx.open_engine(max_batch=8, prompt_cache_bytes=0) as engine:
        adapter_registry(engine).method = method  # every way to compute the stacked layers
        await _mount_all(engine, adapters)
        # On CUDA the gathering methods are built as dense (see _adapters/multilora.py).
        assert adapter_registry(engine).stack.method == method_for_device(method)
        before = engine.statistics()

        async def one(i: int) -> None:
            result = await engine.complete(PROMPTS[i], _params(ADAPTERS[i]))
            results[i] = list(result.token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
        stats = engine.statistics()
    for i, (prompt, adapter) in enumerate(zip(PROMPTS, ADAPTERS, strict=True)):
        assert results[i] == alone[prompt, adapter], (i, adapter)
    assert stats.requests["serial:finished"] == 0
    assert stats.requests["batch:finished"] == len(PROMPTS)
    assert stats.drains == before.drains
    assert dict(stats.adapter_requests) == {"batch:shout": 2, "batch:wide": 2, "batch:deep": 2}
    assert dict(stats.adapter_rows) == {}  # all ended: the live gauge is empty


async def test_mount_and_unmount_while_rows_decode(
    adapters: dict[str, Path], alone: dict[tuple[str, str | None], list[int]]
) -> None:
    long = SamplingParams(max_tokens=400, logit_bias=NO_EOS, adapter="shout")
    # drain_timeout=0: a job parks the running rows at once (they resume after it).
    async with trio_mlx.open_engine(max_batch=8, prompt_cache_bytes=0, drain_timeout=0) as engine:
        await engine.mount_adapter("shout", adapters["shout"])
        await engine.mount_adapter("deep", adapters["deep"])
        finished: list[list[int]] = []

        async def decode() -> None:
            finished.append(list((await engine.complete(PROMPTS[1], long)).token_ids))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(decode)
            with trio.fail_after(30):
                await wait_until(lambda: engine.statistics().generated_tokens > 0)
            # An adapter the running row uses cannot go: refused, nothing changes.
            with pytest.raises(AdapterConflict, match="in use") as caught:
                await engine.unmount_adapter("shout")
            assert caught.value.code == "adapter_in_use"
            assert dict(engine.statistics().adapter_rows) == {"batch:shout": 1}
            await engine.unmount_adapter("deep")  # unused: goes while the row decodes
            await engine.mount_adapter("wide", adapters["wide"])
            assert not finished  # both jobs ran while the row was still decoding
            wide = await engine.complete(PROMPTS[2], _params("wide"))
        assert engine.adapters == ("shout", "wide")
        assert list(wide.token_ids) == alone[PROMPTS[2], "wide"]
        # Parked for the jobs and resumed, the row went on as if uninterrupted.
        again = await engine.complete(PROMPTS[1], long)
        assert engine.statistics().preemptions > 0
    assert finished == [list(again.token_ids)]


async def test_a_request_for_an_adapter_unmounted_while_it_waited_gets_not_found(
    adapters: dict[str, Path],
) -> None:
    long = SamplingParams(max_tokens=60, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(max_batch=2, prompt_cache_bytes=0) as engine:
        await engine.mount_adapter("wide", adapters["wide"])
        outcome: list[Any] = []

        async def waiter() -> None:
            try:
                await engine.complete(PROMPTS[0], _params("wide"))
            except NotFound as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(2):  # the batch is full: the next request waits in the queue
                nursery.start_soon(engine.complete, PROMPTS[3], long)
            with trio.fail_after(30):
                await wait_until(lambda: engine.statistics().running_rows == 2)
            nursery.start_soon(waiter)
            with trio.fail_after(30):
                await wait_until(lambda: engine.statistics().queued_rows == 1)
            await engine.unmount_adapter("wide")
        assert len(outcome) == 1
        assert "no adapter named 'wide'" in str(outcome[0])


async def test_the_prompt_cache_never_crosses_adapters(
    adapters: dict[str, Path],
) -> None:
    prompt = "Once upon a time " * 40  # long enough for the prompt cache (>= 64 tokens)
    names: list[str | None] = [None, "shout", "wide", None, "shout", "wide"]
    async with trio_mlx.open_engine(max_batch=4) as engine:
        await _mount_all(engine, adapters)
        results = []
        for name in names:
            result = await engine.complete(prompt, _params(name, 6))
            results.append((list(result.token_ids), result.result.cached_tokens))
    async with trio_mlx.open_engine(max_batch=4, prompt_cache_bytes=0) as engine:
        await _mount_all(engine, adapters)
        fresh = {n: list((await engine.complete(prompt, _params(n, 6))).token_ids) for n in names}
    # First run of each adapter: nothing cached under it, though the same prompt ran before.
    assert [cached for _, cached in results[:3]] == [0, 0, 0]
    # Second run: its own earlier prefix is reused, and the tokens are the uncached ones.
    assert all(cached > 0 for _, cached in results[3:])
    for (tokens, _), name in zip(results, names, strict=True):
        assert tokens == fresh[name], name
    assert len({tuple(fresh[n]) for n in (None, "shout", "wide")}) == 3


async def test_a_name_unmounted_and_mounted_again_starts_with_an_empty_prompt_cache(
    adapters: dict[str, Path],
) -> None:
    prompt = "Once upon a time " * 40
    async with trio_mlx.open_engine(max_batch=4) as engine:
        await engine.mount_adapter("x", adapters["wide"])
        await engine.complete(prompt, _params("x", 6))
        again = await engine.complete(prompt, _params("x", 6))
        assert again.result.cached_tokens > 0
        await engine.unmount_adapter("x")
        # The same name, other weights: nothing computed under the old ones is reused.
        await engine.mount_adapter("x", adapters["deep"])
        fresh = await engine.complete(prompt, _params("x", 6))
        await engine.mount_adapter("deep", adapters["deep"])
        deep = await engine.complete(prompt, _params("deep", 6))
    assert fresh.result.cached_tokens == 0
    assert list(fresh.token_ids) == list(deep.token_ids) != list(again.token_ids)


async def test_max_loras_bounds_the_mounted_adapters_with_a_conflict(
    adapters: dict[str, Path],
) -> None:
    async with trio_mlx.open_engine(max_loras=2) as engine:
        await engine.mount_adapter("shout", adapters["shout"])
        await engine.mount_adapter("wide", adapters["wide"])
        with pytest.raises(AdapterConflict, match="max_loras=2") as caught:
            await engine.mount_adapter("deep", adapters["deep"])
        assert caught.value.code == "too_many_adapters"
        assert caught.value.status_code == 409
        await engine.unmount_adapter("wide")
        await engine.mount_adapter("deep", adapters["deep"])
        assert engine.adapters == ("shout", "deep")


async def test_a_dora_adapter_runs_in_the_serial_lane_and_a_lora_one_in_the_batch(
    adapters: dict[str, Path], tmp_path: Path
) -> None:
    dora = tmp_path / "dora"
    shutil.copytree(adapters["wide"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    async with trio_mlx.open_engine() as engine:
        await engine.mount_adapter("dora", dora)
        await engine.mount_adapter("wide", adapters["wide"])
        assert adapter_registry(engine).serial_reason("dora") == "a dora adapter"
        assert adapter_registry(engine).serial_reason("wide") is None
        on_dora = await engine.complete(PROMPTS[0], _params("dora"))
        on_wide = await engine.complete(PROMPTS[0], _params("wide"))
        stats = engine.statistics()
    assert (on_dora.result.lane, on_wide.result.lane) == ("serial", "batch")
    assert dict(stats.adapter_requests) == {"serial:dora": 1, "batch:wide": 1}
