"""Failure containment and shutdown: mocks only to inject faults."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from engine_helpers import NO_EOS, PROMPT, wait_until
from trio_mlx import EngineClosed, GenerationFailed, SamplingParams

pytestmark = pytest.mark.model

#: A logit_bias entry that marks a row for fault injection.
POISON = 511


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trio-mlx-worker"]


async def _outcome(
    engine: trio_mlx.Engine, params: SamplingParams
) -> trio_mlx.Completion | BaseException:
    try:
        return await engine.complete(PROMPT, params)
    except (GenerationFailed, EngineClosed) as exc:
        return exc


async def test_a_failing_logits_processor_fails_only_its_row(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio_mlx._lanes.processors as processors

    real = processors.make_processors

    def poisoned(params: SamplingParams) -> list[Any]:
        processors = real(params)
        if params.logit_bias and POISON in params.logit_bias:

            def explode(tokens: Any, logits: Any) -> Any:
                raise ValueError("processor exploded")

            processors.append(explode)
        return processors

    monkeypatch.setattr(processors, "make_processors", poisoned)
    healthy = SamplingParams(max_tokens=12, logit_bias=NO_EOS)
    sick = SamplingParams(max_tokens=12, logit_bias={**NO_EOS, POISON: 0.0})
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        alone = await engine.complete(PROMPT, healthy)
        results: list[Any] = [None, None, None]

        async def run(i: int, params: SamplingParams) -> None:
            results[i] = await _outcome(engine, params)

        async with trio.open_nursery() as nursery:
            for i, params in enumerate([healthy, sick, healthy]):
                nursery.start_soon(run, i, params)
        stats = engine.statistics()
    assert isinstance(results[1], GenerationFailed)
    assert "processor exploded" in str(results[1])
    assert results[0].token_ids == alone.token_ids
    assert results[2].token_ids == alone.token_ids
    assert stats.requests["batch:failed"] == 1
    assert stats.requests["batch:finished"] == 3


class _Boom:
    """Wraps a decoder layer; its Nth forward raises."""

    def __init__(self, layer: Any, fail_on: int) -> None:
        self.layer = layer
        self.calls = 0
        self.fail_on = fail_on

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected forward failure")
        return self.layer(*args, **kwargs)


def _install_boom(fail_on: int) -> Any:
    def install(model: Any, tokenizer: Any) -> None:
        model.model.layers[0] = _Boom(model.model.layers[0], fail_on)

    return install


def _remove_boom(model: Any, tokenizer: Any) -> None:
    layer = model.model.layers[0]
    if isinstance(layer, _Boom):
        model.model.layers[0] = layer.layer


async def test_a_failing_decode_step_fails_the_running_rows_and_the_engine_keeps_serving(
    tiny_model_path: Path,
) -> None:
    params = SamplingParams(max_tokens=30, logit_bias=NO_EOS)
    # The failure is aimed at the Nth call of a layer's Python; a traced decode
    # step (CUDA's default) runs that Python only when it traces a shape.
    async with trio_mlx.open_engine(tiny_model_path, traced_decode=False) as engine:
        expected = await engine.complete(PROMPT, params)
        await engine.run_exclusive(_install_boom(fail_on=10))
        results: list[Any] = [None, None]

        async def run(i: int) -> None:
            results[i] = await _outcome(engine, params)

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(run, i)
        after = await engine.complete(PROMPT, params)
        await engine.run_exclusive(_remove_boom)
        stats = engine.statistics()
    assert all(isinstance(r, GenerationFailed) for r in results)
    assert "injected forward failure" in str(results[0])
    assert after.token_ids == expected.token_ids
    assert stats.requests["batch:failed"] == 2
    assert stats.worker_alive


async def test_a_failing_serial_generation_fails_only_itself(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        await engine.run_exclusive(_install_boom(fail_on=3))
        failed = await _outcome(engine, SamplingParams(max_tokens=10, seed=1))
        ok = await engine.complete(PROMPT, SamplingParams(max_tokens=10, seed=1))
        stats = engine.statistics()
    assert isinstance(failed, GenerationFailed)
    assert len(ok.token_ids) > 0
    assert stats.requests["serial:failed"] == 1


async def test_a_dead_worker_closes_the_engine_and_every_pending_request(
    tiny_model_path: Path,
) -> None:
    def die(model: Any, tokenizer: Any) -> None:
        raise SystemExit("worker dies")

    async with trio_mlx.open_engine(tiny_model_path) as engine:
        results: list[Any] = [None]

        async def row() -> None:
            results[0] = await _outcome(
                engine, SamplingParams(max_tokens=100_000, logit_bias=NO_EOS)
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(row)
            with trio.fail_after(20):
                await wait_until(lambda: engine.statistics().running_rows > 0)
            with pytest.raises(EngineClosed, match="worker thread died"):
                await engine.run_exclusive(die)
        stats = engine.statistics()
        assert engine.closed
        with pytest.raises(EngineClosed):
            await engine.complete(PROMPT)
    assert isinstance(results[0], EngineClosed)
    assert stats.state == "CLOSED"
    assert not stats.worker_alive
    assert _worker_threads() == []


async def test_shutdown_with_work_in_flight_ends_everything_and_joins_the_thread(
    tiny_model_path: Path,
) -> None:
    outcomes: list[Any] = []
    forever = SamplingParams(max_tokens=100_000, logit_bias=NO_EOS)
    with trio.fail_after(30):
        async with (
            trio.open_nursery() as outer,
            trio_mlx.open_engine(tiny_model_path, max_batch=2, grace_period=0.3) as engine,
        ):

            async def run(params: SamplingParams) -> None:
                outcomes.append(await _outcome(engine, params))

            for params in [
                forever,
                forever,
                forever,
                SamplingParams(max_tokens=100_000, seed=1, logit_bias=NO_EOS),
            ]:
                outer.start_soon(run, params)
            # Tokens flowing: rows running, or parked behind the serial job.
            await wait_until(lambda: engine.statistics().generated_tokens >= 10)
    assert len(outcomes) == 4
    assert all(isinstance(o, EngineClosed) for o in outcomes), outcomes
    stats = engine.statistics()
    assert stats.state == "CLOSED"
    assert stats.requests["batch:closed"] == 3
    assert stats.requests["serial:closed"] == 1
    assert _worker_threads() == []


async def test_shutdown_lets_short_work_finish_within_the_grace_period(
    tiny_model_path: Path,
) -> None:
    results: list[Any] = []
    async with (
        trio.open_nursery() as outer,
        trio_mlx.open_engine(tiny_model_path, grace_period=10.0) as engine,
    ):

        async def run() -> None:
            results.append(await _outcome(engine, SamplingParams(max_tokens=50, logit_bias=NO_EOS)))

        outer.start_soon(run)
        with trio.fail_after(20):
            await wait_until(lambda: engine.statistics().running_rows > 0)
    assert len(results) == 1
    assert isinstance(results[0], trio_mlx.Completion)
    assert len(results[0].token_ids) == 50


async def test_cancelling_the_engine_block_skips_the_grace_period(tiny_model_path: Path) -> None:
    outcomes: list[Any] = []
    forever = SamplingParams(max_tokens=100_000, logit_bias=NO_EOS)
    grace = 60.0
    with trio.CancelScope() as scope:
        async with trio_mlx.open_engine(tiny_model_path, grace_period=grace) as engine:

            async def run() -> None:
                outcomes.append(await _outcome(engine, forever))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                # Cancel once the row runs, not at a fixed time: a loaded machine may
                # still be loading the model after half a second.
                with trio.fail_after(60):
                    await wait_until(lambda: engine.statistics().running_rows > 0)
                cancelled_at = trio.current_time()
                scope.cancel()
                await trio.sleep_forever()
    assert scope.cancelled_caught
    # Waiting out the grace period would take all of it.
    assert trio.current_time() - cancelled_at < grace / 2
    assert engine.statistics().state == "CLOSED"
    assert _worker_threads() == []
