"""The gate, the serial lane, exclusive jobs and LoRA adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from engine_helpers import NO_EOS, PROMPT, wait_until
from trio_mlx import InvalidRequest, NotFound, SamplingParams
from trio_mlx._core.gate import choose_lane

# --- the gate: one test per reason -----------------------------------------------------


def test_gate_batches_plain_sampling_and_penalties() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        presence_penalty=1.0,
        logit_bias={3: 2.0},
        logprobs=True,
        top_logprobs=3,
        stop=["x"],
    )
    lane = choose_lane(params, max_batch=8, caches_merge=True)
    assert lane.batch
    assert lane.reason is None


def test_gate_sends_a_seeded_request_to_the_serial_lane() -> None:
    lane = choose_lane(SamplingParams(seed=1), max_batch=8, caches_merge=True)
    assert (lane.name, lane.reason) == ("serial", "seed")


def test_gate_sends_kv_bits_to_the_serial_lane() -> None:
    lane = choose_lane(SamplingParams(kv_bits=8), max_batch=8, caches_merge=True)
    assert (lane.name, lane.reason) == ("serial", "kv_bits")


def test_gate_batches_a_request_for_a_mounted_plain_lora_adapter() -> None:
    lane = choose_lane(SamplingParams(adapter="a"), max_batch=8, caches_merge=True)
    assert lane.batch


def test_gate_sends_an_adapter_that_cannot_batch_to_the_serial_lane() -> None:
    lane = choose_lane(
        SamplingParams(adapter="a"), max_batch=8, caches_merge=True, adapter_reason="a dora adapter"
    )
    assert (lane.name, lane.reason) == ("serial", "adapter: a dora adapter")


def test_gate_sends_an_adapter_request_with_kv_bits_to_the_serial_lane() -> None:
    lane = choose_lane(SamplingParams(adapter="a", kv_bits=8), max_batch=8, caches_merge=True)
    assert (lane.name, lane.reason) == ("serial", "kv_bits")


def test_gate_sends_everything_serial_when_caches_cannot_merge() -> None:
    lane = choose_lane(SamplingParams(), max_batch=8, caches_merge=False)
    assert lane.name == "serial"
    assert lane.reason is not None
    assert "merge" in lane.reason


def test_gate_sends_everything_serial_with_max_batch_one() -> None:
    lane = choose_lane(SamplingParams(), max_batch=1, caches_merge=True)
    assert (lane.name, lane.reason) == ("serial", "max_batch=1")


# --- the serial lane ---------------------------------------------------------------------


@pytest.mark.model
async def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        runs = [
            await engine.complete(
                PROMPT, SamplingParams(max_tokens=24, temperature=1.5, seed=seed, logit_bias=NO_EOS)
            )
            for seed in (7, 7, 8)
        ]
    assert runs[0].result.lane == "serial"
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids


@pytest.mark.model
async def test_seeded_request_is_reproducible_under_batch_traffic(tiny_model_path: Path) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.5, seed=11, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, drain_timeout=0.05) as engine:
        quiet = await engine.complete(PROMPT, seeded)
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(
                    engine.complete,
                    PROMPT + " x" * i,
                    SamplingParams(max_tokens=40, temperature=1.0, logit_bias=NO_EOS),
                )
            await wait_until(lambda: engine.statistics().running_rows > 0)
            busy = await engine.complete(PROMPT, seeded)
    assert busy.token_ids == quiet.token_ids


@pytest.mark.model
async def test_serial_greedy_equals_batch_greedy(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=20, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        batch = await engine.complete(PROMPT, params)
    async with trio_mlx.open_engine(tiny_model_path, max_batch=1, prompt_cache_bytes=0) as engine:
        serial = await engine.complete(PROMPT, params)
    assert (batch.result.lane, serial.result.lane) == ("batch", "serial")
    assert serial.token_ids == batch.token_ids


@pytest.mark.model
async def test_kv_bits_request_runs_serially_to_max_tokens(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        completion = await engine.complete(
            PROMPT, SamplingParams(max_tokens=10, kv_bits=8, kv_group_size=32, logit_bias=NO_EOS)
        )
        with pytest.raises(InvalidRequest, match="does not divide"):
            await engine.complete(PROMPT, SamplingParams(kv_bits=8, kv_group_size=64))
        assert engine.statistics().requests["serial:finished"] == 1
    assert completion.result.lane == "serial"
    assert len(completion.token_ids) == 10


@pytest.mark.parametrize(("head", "group", "length"), [(32, 32, 1), (32, 32, 40), (64, 64, 540)])
def test_kv_bits_attention_on_cuda_equals_mlx_lms_quantized_attention(
    head: int, group: int, length: int
) -> None:
    """The CUDA path (dequantize, then MLX's fused attention) against mlx-lm's own, on
    the shapes MLX's CUDA backend has no quantized kernel for."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from trio_mlx.testing import dequantized_attention

    mx.random.seed(0)
    queries = mx.random.normal((1, 8, length, head))
    keys, values = (mx.random.normal((1, 2, length + 7, head)) for _ in range(2))
    q_keys = mx.quantize(keys, group_size=group, bits=8)
    q_values = mx.quantize(values, group_size=group, bits=8)
    mask = "causal" if length > 1 else None
    scale = head**-0.5
    ours = dequantized_attention(queries, q_keys, q_values, scale, mask, group, 8)
    theirs = quantized_scaled_dot_product_attention(
        queries, q_keys, q_values, scale=scale, mask=mask, group_size=group, bits=8
    )
    assert ours.shape == theirs.shape
    assert mx.allclose(ours, theirs, atol=1e-4, rtol=1e-4).item()


@pytest.mark.model
async def test_cancelled_serial_generation_stops_within_a_token(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        params = SamplingParams(max_tokens=2000, seed=1, logit_bias=NO_EOS)
        async with engine.generate(PROMPT, params) as stream:
            async for _delta in stream:
                break
        with trio.fail_after(60):
            await wait_until(lambda: engine.statistics().requests["serial:cancelled"] > 0)
        generated = engine.statistics().generated_tokens
        # Another request still runs normally afterwards.
        after = await engine.complete(PROMPT, SamplingParams(max_tokens=3))
    assert generated < 50
    assert len(after.token_ids) == 3


# --- exclusive jobs ---------------------------------------------------------------------


@pytest.mark.model
async def test_run_exclusive_runs_on_the_mlx_thread_with_the_model(tiny_model_path: Path) -> None:
    import threading

    def probe(model: Any, tokenizer: Any) -> tuple[str, int]:
        return threading.current_thread().name, len(tokenizer.encode("abc"))

    async with trio_mlx.open_engine(tiny_model_path) as engine:
        name, count = await engine.run_exclusive(probe)
        assert engine.statistics().requests["job:finished"] == 1
    assert name == "trio-mlx-worker"
    assert count >= 1


@pytest.mark.model
async def test_run_exclusive_error_reaches_the_caller_and_engine_survives(
    tiny_model_path: Path,
) -> None:
    def boom(model: Any, tokenizer: Any) -> None:
        raise KeyError("boom")

    async with trio_mlx.open_engine(tiny_model_path) as engine:
        with pytest.raises(KeyError, match="boom"):
            await engine.run_exclusive(boom)
        completion = await engine.complete(PROMPT, SamplingParams(max_tokens=2))
        assert engine.statistics().requests["job:failed"] == 1
    assert len(completion.token_ids) == 2


# --- adapters ---------------------------------------------------------------------------


@pytest.mark.model
async def test_mounted_adapter_changes_only_requests_that_name_it(
    tiny_model_path: Path, tiny_adapter_path: Path
) -> None:
    params = SamplingParams(max_tokens=16, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        base = await engine.complete(PROMPT, params)
        await engine.mount_adapter("shout", tiny_adapter_path)
        assert engine.adapters == ("shout",)
        tuned = await engine.complete(
            PROMPT, SamplingParams(max_tokens=16, logit_bias=NO_EOS, adapter="shout")
        )
        base_again = await engine.complete(PROMPT, params)
        await engine.unmount_adapter("shout")
        assert engine.adapters == ()
        with pytest.raises(NotFound, match="shout"):
            await engine.complete(PROMPT, SamplingParams(adapter="shout"))
    assert tuned.result.lane == "batch"  # a plain LoRA adapter batches (test_engine_multilora)
    assert tuned.token_ids != base.token_ids
    assert base_again.token_ids == base.token_ids


@pytest.mark.model
async def test_mount_rejects_bad_names_and_paths(
    tiny_model_path: Path, tiny_adapter_path: Path, tmp_path: Path
) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        with pytest.raises(NotFound, match="no adapter at"):
            await engine.mount_adapter("x", tmp_path / "missing")
        with pytest.raises(InvalidRequest, match="not an adapter directory"):
            await engine.mount_adapter("x", tmp_path)
        with pytest.raises(InvalidRequest, match="non-empty"):
            await engine.mount_adapter("", tiny_adapter_path)
        await engine.mount_adapter("a", tiny_adapter_path)
        with pytest.raises(InvalidRequest, match="already mounted"):
            await engine.mount_adapter("a", tiny_adapter_path)
        with pytest.raises(NotFound, match="no adapter named 'b'"):
            await engine.unmount_adapter("b")


@pytest.mark.model
async def test_open_engine_with_adapter_path_fuses_it(
    tiny_model_path: Path, tiny_adapter_path: Path
) -> None:
    params = SamplingParams(max_tokens=12, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        await engine.mount_adapter("shout", tiny_adapter_path)
        tuned = await engine.complete(
            PROMPT, SamplingParams(max_tokens=12, logit_bias=NO_EOS, adapter="shout")
        )
    async with trio_mlx.open_engine(tiny_model_path, adapter_path=tiny_adapter_path) as engine:
        fused = await engine.complete(PROMPT, params)
    assert fused.result.lane == "batch"
    assert fused.token_ids == tuned.token_ids
