"""The prompt cache's disk tier: checkpoints survive a restart, stay with their
model, and a torn file or two writers on one folder never give a wrong answer."""

from __future__ import annotations

import logging
import random
import threading
from pathlib import Path

import pytest
import trio

from trio_mlx import Completion, SamplingParams, open_engine
from trio_mlx._lanes.prompt_disk import DiskTier
from trio_mlx.testing import make_random_model

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "sigma", "river")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def chat() -> list[dict[str, str]]:
    """A chat of more than the disk tier's 1,024 tokens (the tiny tokenizer: ~4 a word)."""
    pick = random.Random(1)
    system = " ".join(pick.choice(WORDS) for _ in range(300))
    return [{"role": "system", "content": system}, {"role": "user", "content": "go on"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("disk")
    return {
        "llama": make_random_model(root / "llama", "llama"),
        "other-llama": make_random_model(root / "other-llama", "llama", seed=1),
        "qwen3_next": make_random_model(root / "qwen3_next", "qwen3_next"),
    }


def entry_files(folder: Path) -> list[Path]:
    return list(folder.glob("*.safetensors"))


def truncate_entries(folder: Path) -> int:
    """Cut every entry's data file in half; returns how many there were."""
    files = entry_files(folder)
    for data in files:
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return len(files)


async def answer(model: Path, folder: Path | None) -> Completion:
    kwargs = {"prompt_cache_dir": folder} if folder is not None else {"prompt_cache_bytes": 0}
    async with open_engine(model, **kwargs) as engine:
        return await engine.complete(chat(), GREEDY)


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
async def test_a_restarted_engine_serves_its_first_turn_from_disk(
    models: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    with trio.fail_after(120):
        first = await answer(models[kind], tmp_path)
        second = await answer(models[kind], tmp_path)
        fresh = await answer(models[kind], None)
    assert first.result.cached_tokens == 0
    assert second.result.cached_tokens == second.result.prompt_tokens - 1
    assert second.token_ids == first.token_ids == fresh.token_ids
    assert entry_files(tmp_path)


async def test_another_model_never_reuses_the_entries(
    models: dict[str, Path], tmp_path: Path
) -> None:
    with trio.fail_after(120):
        await answer(models["llama"], tmp_path)
        other = await answer(models["other-llama"], tmp_path)
    assert other.result.cached_tokens == 0


async def test_a_truncated_entry_is_skipped_with_a_warning(
    models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(120):
        first = await answer(models["qwen3_next"], tmp_path)
        assert truncate_entries(tmp_path)
        with caplog.at_level(logging.WARNING, logger="trio_mlx"):
            async with open_engine(models["qwen3_next"], prompt_cache_dir=tmp_path) as engine:
                second = await engine.complete(chat(), GREEDY)
                stats = engine.statistics().prompt_cache
    assert second.result.cached_tokens == 0
    assert second.token_ids == first.token_ids
    assert stats is not None
    assert stats.disk_failures >= 1
    assert "skipping the disk entry" in caplog.text


def test_two_writers_on_one_folder_leave_every_entry_whole(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import ArraysCache, KVCache

    def cache(seed: int) -> list[object]:
        mx.random.seed(seed)
        kv = KVCache()
        kv.update_and_fetch(mx.random.normal((1, 2, 40, 8)), mx.random.normal((1, 2, 40, 8)))
        state = ArraysCache(2)
        state[0], state[1] = mx.random.normal((1, 3, 8)), mx.random.normal((1, 2, 4, 4))
        layers = [kv, state]
        mx.eval([c.state for c in layers])
        return layers

    prompts = [[seed] * 40 for seed in range(1, 9)]
    caches = [cache(seed) for seed in range(1, 9)]
    writers = [DiskTier(tmp_path, "model", 1 << 30, min_tokens=1) for _ in range(2)]
    for writer in writers:
        writer.open()

    def write(writer: DiskTier) -> None:
        for prompt, layers in zip(prompts, caches, strict=True):
            writer.submit(prompt, layers)  # both write every key
            writer.flush()  # each one, not only the newest of a backlog

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for writer in writers:
        writer.close()
    reader = DiskTier(tmp_path, "model", 1 << 30, min_tokens=1)
    reader.open()
    try:
        for prompt, layers in zip(prompts, caches, strict=True):
            found = reader.lookup([*prompt, 0], 0)
            assert found is not None
            loaded, length = found
            assert length == len(prompt)
            ours = tree_flatten([c.state for c in loaded])
            theirs = tree_flatten([c.state for c in layers])
            assert [k for k, _ in ours] == [k for k, _ in theirs]
            for (_, x), (_, y) in zip(ours, theirs, strict=True):
                assert x == y if not isinstance(x, mx.array) else mx.array_equal(x, y).item()
    finally:
        reader.close()
    assert reader.failures == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_eviction_keeps_the_folder_under_its_cap(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 2, 256, 64)), mx.zeros((1, 2, 256, 64)))
    mx.eval(kv.state)
    size = kv.nbytes
    tier = DiskTier(tmp_path, "model", 3 * size, min_tokens=1)
    tier.open()
    for seed in range(8):
        tier.submit([seed] * 10, [kv])
    tier.close()
    held = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert 0 < held <= 3 * size
    assert len(list(tmp_path.glob("*.json"))) == len(list(tmp_path.glob("*.safetensors")))


def _kv(seed: int, tokens: int = 40) -> list[object]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    kv = KVCache()
    shape = (1, 2, tokens, 8)
    kv.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    mx.eval(kv.state)
    return [kv]


def test_a_slow_disk_keeps_the_newest_checkpoints_and_drops_the_oldest_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    started = threading.Event()
    write = DiskTier._write

    def slow_write(self: DiskTier, *args: object) -> None:  # a disk slower than the turns
        started.set()
        release.wait(30)
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "_write", slow_write)
    tier = DiskTier(tmp_path, "model", 1 << 30, min_tokens=1)
    tier.open()
    prompts = [[seed] * 40 for seed in range(1, 6)]
    tier.submit(prompts[0], _kv(1))
    assert started.wait(30)  # the writer holds the first; the rest wait
    for seed, prompt in enumerate(prompts[1:], start=2):
        tier.submit(prompt, _kv(seed))
    release.set()
    tier.close()
    reader = DiskTier(tmp_path, "model", 1 << 30, min_tokens=1)
    reader.open()
    try:
        kept = [reader.lookup([*prompt, 0], 0) is not None for prompt in prompts]
    finally:
        reader.close()
    assert tier.dropped == 2
    assert kept == [True, False, False, True, True]


def test_a_flipped_byte_in_any_chunk_is_caught_and_the_entry_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from trio_mlx._lanes import prompt_disk

    monkeypatch.setattr(prompt_disk, "CHUNK", 4096)  # several chunks from a small entry
    tier = DiskTier(tmp_path, "model", 1 << 30, min_tokens=1)
    tier.open()
    prompt = [7] * 200
    tier.submit(prompt, _kv(7, tokens=200))
    tier.close()
    (data,) = entry_files(tmp_path)
    raw = bytearray(data.read_bytes())
    assert len(raw) > 3 * 4096
    raw[2 * 4096 + 100] ^= 0xFF  # the third chunk's
    data.write_bytes(bytes(raw))
    reader = DiskTier(tmp_path, "model", 1 << 30, min_tokens=1)
    reader.open()
    try:
        with caplog.at_level(logging.WARNING, logger="trio_mlx"):
            found = reader.lookup([*prompt, 0], 0)
    finally:
        reader.close()
    assert found is None
    assert reader.failures == 1
    assert "CRC-32 of its chunks" in caplog.text
