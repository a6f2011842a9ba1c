"""Several models on one MLX thread (``trio_mlx.open_host``): loading on demand,
unloading idle or least recently used models, never one in use; real tiny models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio

import trio_mlx
from engine_helpers import make_embedder, wait_until
from trio_mlx import ModelState, SamplingParams
from trio_mlx.testing import make_random_llama

PARAMS = SamplingParams(max_tokens=12)
PROMPT = "The quick brown fox"
#: Bounds for waits on a loaded 2-core machine: never a measure of speed.
DEADLINE = 120.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three tiny llamas of different weights, and an embedder."""
    root = tmp_path_factory.mktemp("host") / "models"
    for seed, name in enumerate(("alpha", "beta", "gamma"), start=1):
        make_random_llama(root / name, seed=seed)
    make_embedder(root / "alpha", root / "embedder")
    return root


async def _text(engine: trio_mlx.Engine, prompt: str = PROMPT) -> list[int]:
    completion = await engine.complete(prompt, PARAMS)
    return list(completion.token_ids)


def _states(host: trio_mlx.ModelHost) -> dict[str, ModelState]:
    return {info.name: info.state for info in host.models()}


async def _alone(path: Path) -> list[int]:
    async with trio_mlx.open_engine(path) as engine:
        return await _text(engine)


async def test_each_model_answers_as_it_does_alone_while_both_decode(model_dir: Path) -> None:
    want = {name: await _alone(model_dir / name) for name in ("alpha", "beta")}
    assert want["alpha"] != want["beta"]  # the two models really differ
    got: dict[str, list[list[int]]] = {"alpha": [], "beta": []}
    async with trio_mlx.open_host([model_dir / "alpha", model_dir / "beta"]) as host:
        assert host.default == "alpha"
        assert _states(host)["alpha"] is ModelState.LOADED  # preloaded
        assert _states(host)["beta"] is ModelState.UNLOADED

        async def ask(name: str) -> None:
            async with host.use(name) as engine:
                got[name].append(await _text(engine))

        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    for name in ("alpha", "beta"):
                        nursery.start_soon(ask, name)
        assert _states(host) == {"alpha": ModelState.LOADED, "beta": ModelState.LOADED}
    assert got == {name: [want[name]] * 3 for name in ("alpha", "beta")}


async def test_max_models_unloads_the_least_recently_used_idle_model(model_dir: Path) -> None:
    async with trio_mlx.open_host(model_dir=model_dir, max_models=2, preload=False) as host:
        assert host.names == ("alpha", "beta", "embedder", "gamma")
        for name in ("alpha", "beta", "alpha"):  # beta is now the least recently used
            async with host.use(name):
                pass
        async with host.use("gamma"):
            states = _states(host)
        assert states["gamma"] is ModelState.LOADED
        assert states["alpha"] is ModelState.LOADED
        assert states["beta"] is ModelState.UNLOADED
        info = {i.name: i for i in host.models()}
        assert (info["beta"].loads, info["beta"].unloads) == (1, 1)


async def test_max_model_memory_counts_the_weights(model_dir: Path) -> None:
    one = sum(f.stat().st_size for f in (model_dir / "alpha").glob("*.safetensors"))
    models = [model_dir / "alpha", model_dir / "beta"]
    async with trio_mlx.open_host(models, max_model_memory=one * 3 // 2) as host, host.use("beta"):
        assert _states(host) == {"alpha": ModelState.UNLOADED, "beta": ModelState.LOADED}
    with pytest.raises(trio_mlx.InvalidRequest, match="larger than max_model_memory"):
        async with trio_mlx.open_host(models, max_model_memory=one // 2):
            pass


async def test_a_model_in_use_is_never_unloaded_for_another(model_dir: Path) -> None:
    models = [model_dir / "alpha", model_dir / "beta"]
    want = await _alone(model_dir / "alpha")
    async with trio_mlx.open_host(models, max_models=1, load_timeout=0.5) as host:
        async with host.use("alpha") as engine, engine.generate(PROMPT, PARAMS) as stream:
            # beta needs alpha's place, which a request holds: beta waits, then gives up.
            with pytest.raises(trio_mlx.ModelUnavailable, match="not ready") as refused:
                async with host.use("beta"):
                    pass
            assert refused.value.retry_after >= 1
            assert _states(host)["alpha"] is ModelState.LOADED
            tokens = [t async for delta in stream for t in delta.token_ids]
        assert tokens == want
        host.load_timeout = DEADLINE
        async with host.use("beta"):  # alpha is idle now: it makes room
            assert _states(host) == {"alpha": ModelState.UNLOADED, "beta": ModelState.LOADED}


async def test_unload_waits_for_the_requests_in_flight(model_dir: Path) -> None:
    want = await _alone(model_dir / "alpha")
    order: list[str] = []
    async with trio_mlx.open_host([model_dir / "alpha"]) as host:
        with trio.fail_after(DEADLINE):
            async with (
                trio.open_nursery() as nursery,
                host.use() as engine,
                engine.generate(PROMPT, PARAMS) as stream,
            ):

                async def unload() -> None:
                    await host.unload("alpha")
                    order.append("unloaded")

                nursery.start_soon(unload)
                await wait_until(lambda: _states(host)["alpha"] is ModelState.UNLOADING)
                tokens = [t async for delta in stream for t in delta.token_ids]
                order.append("stream ended")
        assert tokens == want
        assert order == ["stream ended", "unloaded"]
        # A request after the unload loads the model again.
        async with host.use("alpha") as engine:
            assert await _text(engine) == want
        assert next(i for i in host.models()).loads == 2


async def test_idle_unload_gives_the_memory_back(model_dir: Path) -> None:
    async with trio_mlx.open_host([model_dir / "alpha", model_dir / "beta"], preload=False) as host:
        baseline = host.active_memory()
        host.idle_unload = None  # load both, and measure, before idling is checked
        async with host.use("alpha"), host.use("beta"):
            loaded = host.active_memory()
        weights = sum(i.weight_bytes for i in host.models())
        assert loaded - baseline >= weights // 2
        async with trio.open_nursery() as nursery:
            host.idle_unload = 0.05
            nursery.start_soon(host._unload_idle)
            with trio.fail_after(DEADLINE):
                await wait_until(
                    lambda: all(s is ModelState.UNLOADED for s in _states(host).values())
                )
            nursery.cancel_scope.cancel()
        # Every model's weights are given back: what stays is less than half of one.
        left = host.active_memory() - baseline
        assert left < min(i.weight_bytes for i in host.models()) // 2, (baseline, loaded, left)


async def test_idle_unload_spares_a_model_in_use(model_dir: Path) -> None:
    async with trio_mlx.open_host([model_dir / "alpha"], idle_unload=0.05) as host:
        async with host.use() as engine:
            # Long past the idle period, with a request holding it: still loaded.
            await trio.sleep(0.5)
            assert _states(host)["alpha"] is ModelState.LOADED
            assert len(await _text(engine)) > 0
        with trio.fail_after(DEADLINE):
            await wait_until(lambda: _states(host)["alpha"] is ModelState.UNLOADED)


async def test_embeddings_from_a_hosted_embedder_equal_the_embedder_alone(
    model_dir: Path,
) -> None:
    import numpy as np

    texts = ["a red fox", "the lazy dog sleeps"]
    async with trio_mlx.open_engine(model_dir / "embedder") as engine:
        want = (await engine.embed(texts)).vectors
    async with trio_mlx.open_host([model_dir / "alpha", model_dir / "embedder"]) as host:
        async with host.use("embedder") as engine:
            got = (await engine.embed(texts)).vectors
        async with host.use("alpha") as engine:
            with pytest.raises(trio_mlx.InvalidRequest, match="no embeddings"):
                await engine.embed(texts)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


async def test_a_failed_load_is_unavailable_and_the_next_request_retries(
    model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir / "beta", broken)
    weights = broken / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 3])
    async with trio_mlx.open_host([model_dir / "alpha", broken]) as host:
        with pytest.raises(trio_mlx.ModelUnavailable, match="loading the model 'broken' failed"):
            async with host.use("broken"):
                pass
        info = {i.name: i for i in host.models()}
        assert info["broken"].state is ModelState.UNLOADED
        assert info["broken"].error
        async with host.use("alpha") as engine:  # the others serve on
            assert await _text(engine)
        weights.write_bytes(good)
        async with host.use("broken") as engine:
            assert await _text(engine) == await _alone(model_dir / "beta")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_models": 0}, "max_models"),
        ({"max_model_memory": -1}, "max_model_memory"),
        ({"idle_unload": 0}, "idle_unload"),
        ({"load_timeout": float("nan")}, "load_timeout"),
    ],
)
async def test_bad_host_settings_are_refused_by_name(
    model_dir: Path, kwargs: dict[str, float], param: str
) -> None:
    with pytest.raises(trio_mlx.InvalidRequest) as refused:
        async with trio_mlx.open_host([model_dir / "alpha"], **kwargs):  # type: ignore[arg-type]
            pass
    assert refused.value.param == param


async def test_unknown_and_duplicate_names_are_refused(model_dir: Path, tmp_path: Path) -> None:
    async with trio_mlx.open_host([model_dir / "alpha"]) as host:
        with pytest.raises(trio_mlx.NotFound, match="'nope' does not exist"):
            async with host.use("nope"):
                pass
    shutil.copytree(model_dir / "beta", tmp_path / "alpha")
    with pytest.raises(trio_mlx.InvalidRequest, match="two models are named 'alpha'"):
        async with trio_mlx.open_host([model_dir / "alpha", tmp_path / "alpha"]):
            pass
    (tmp_path / "empty").mkdir()
    with pytest.raises(trio_mlx.InvalidRequest, match="has no model folders"):
        async with trio_mlx.open_host([], model_dir=tmp_path / "empty"):
            pass


async def test_each_engine_plans_its_memory_in_its_share(model_dir: Path) -> None:
    async with trio_mlx.open_engine(model_dir / "alpha") as engine:
        alone = engine.statistics().kv_memory_budget
    models = [model_dir / "alpha", model_dir / "beta"]
    async with trio_mlx.open_host(models, max_models=2) as host, host.use() as engine:
        shared = engine.statistics().kv_memory_budget
    assert alone > 0
    assert shared > 0
    assert shared < alone * 0.6


async def test_unloading_gives_the_memory_back_after_gc_freeze(model_dir: Path) -> None:
    import gc

    async with trio_mlx.open_host([model_dir / "alpha"], preload=False) as host:
        baseline = host.active_memory()
        await host.load("alpha")
        weights = next(iter(host.models())).weight_bytes
        assert host.active_memory() - baseline >= weights // 2
        gc.freeze()  # as the server does once its first model is loaded
        try:
            await host.unload("alpha")
            left = host.active_memory() - baseline
        finally:
            gc.unfreeze()
    assert left < weights // 2
