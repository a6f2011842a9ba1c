"""The engine's public API on the real tiny model: generate, complete, encode, shutdown."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

import trio_mlx
from trio_mlx import InvalidRequest, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["Hello world", "The quick brown fox jumps", "def main():\n    return"]


async def test_complete_returns_max_tokens_and_usage(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        completion = await engine.complete("Hello world", SamplingParams(max_tokens=12))
    result = completion.result
    assert len(completion.token_ids) == 12
    assert result.finish_reason == "length"
    assert result.completion_tokens == 12
    assert result.prompt_tokens == len(engine.encode("Hello world"))
    assert result.lane == "batch"
    assert completion.text == engine.tokenizer.decode(list(completion.token_ids))


async def test_stream_deltas_concatenate_to_the_completion(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=16)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        whole = await engine.complete(PROMPTS[1], params)
        texts, ids = [], []
        async with engine.generate(PROMPTS[1], params) as stream:
            assert stream.prompt_tokens == len(engine.encode(PROMPTS[1]))
            async for delta in stream:
                texts.append(delta.text)
                ids.extend(delta.token_ids)
        assert stream.result.finish_reason == whole.result.finish_reason
    assert "".join(texts) == whole.text
    assert tuple(ids) == whole.token_ids


async def test_greedy_batch_of_eight_equals_each_request_alone(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=24)
    prompts = [PROMPTS[i % 3] + " x" * i for i in range(8)]
    async with trio_mlx.open_engine(tiny_model_path, max_batch=8) as engine:
        alone = [await engine.complete(p, params) for p in prompts]
        together: list[trio_mlx.Completion | None] = [None] * 8

        async def one(i: int) -> None:
            together[i] = await engine.complete(prompts[i], params)

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        assert engine.statistics().steps > 0
    for solo, batched in zip(alone, together, strict=True):
        assert batched is not None
        assert batched.token_ids == solo.token_ids


async def test_stop_string_ends_generation_and_is_not_emitted(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        free = await engine.complete(PROMPTS[0], SamplingParams(max_tokens=30))
        # A stop string taken from the middle of the free-running text.
        stop = free.text[10:13]
        assert len(stop) == 3
        cut = await engine.complete(PROMPTS[0], SamplingParams(max_tokens=30, stop=[stop]))
    assert cut.result.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert stop not in cut.text


async def test_eos_ends_with_stop_and_is_not_in_the_tokens(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        # A huge bias on EOS id 2 makes it the first token.
        params = SamplingParams(max_tokens=10, logit_bias={2: 100.0})
        completion = await engine.complete(PROMPTS[0], params)
    assert completion.result.finish_reason == "stop"
    assert completion.token_ids == ()
    assert completion.text == ""


async def test_encode_rejects_empty_and_too_long_prompts(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        with pytest.raises(InvalidRequest, match="empty"):
            engine.encode("")
        with pytest.raises(InvalidRequest, match="empty"):
            engine.encode([])
        with pytest.raises(InvalidRequest, match="not a token id"):
            engine.encode([1, -3])
        assert engine.context_length == 2048
        with pytest.raises(InvalidRequest, match="more than the model's context") as info:
            engine.encode([5] * 2049)
        assert info.value.code == "context_length_exceeded"
        with pytest.raises(InvalidRequest, match="empty"):
            async with engine.generate(""):
                pass


async def test_chat_messages_use_the_chat_template(tiny_model_path: Path) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        tokens = engine.encode(messages)
        expected = engine.tokenizer.encode(
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        assert tokens == list(expected)
        completion = await engine.complete(messages, SamplingParams(max_tokens=4))
        assert completion.result.prompt_tokens == len(tokens)


async def test_leaving_open_engine_joins_the_worker_thread(tiny_model_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        await engine.complete(PROMPTS[0], SamplingParams(max_tokens=2))
        assert engine.statistics().worker_alive
    assert engine.closed
    assert not engine.statistics().worker_alive
    assert engine.statistics().state == "CLOSED"
    leftover = [
        t for t in threading.enumerate() if t.ident not in before and t.name == "trio-mlx-worker"
    ]
    assert leftover == []
    with pytest.raises(trio_mlx.EngineClosed):
        await engine.complete(PROMPTS[0])


async def test_statistics_count_requests_and_tokens(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        await engine.complete(PROMPTS[0], SamplingParams(max_tokens=5))
        stats = engine.statistics()
    assert stats.requests["batch:finished"] == 1
    assert stats.generated_tokens == 5
    assert stats.running_rows == stats.queued_rows == 0
    assert stats.state == "ADMITTING"


async def test_statistics_report_mlx_memory_and_the_prompt_cache(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        before = engine.statistics()
        await engine.complete(PROMPTS[0], SamplingParams(max_tokens=5))
        after = engine.statistics()
    # The weights are live MLX arrays; the peak is a high-water mark of active memory.
    assert before.mlx_active_memory > 0
    assert after.mlx_peak_memory >= after.mlx_active_memory > 0
    assert after.mlx_cache_memory >= 0
    assert before.prompt_cache_bytes == 0 < after.prompt_cache_bytes
    async with trio_mlx.open_engine(tiny_model_path, prompt_cache_bytes=0) as engine:
        await engine.complete(PROMPTS[0], SamplingParams(max_tokens=5))
        assert engine.statistics().prompt_cache_bytes == 0


async def test_open_engine_reports_a_missing_model_as_not_found(tmp_path: Path) -> None:
    with pytest.raises(trio_mlx.NotFound, match="not found"):
        async with trio_mlx.open_engine(tmp_path / "nowhere"):
            pass  # pragma: no cover
    with pytest.raises(trio_mlx.NotFound, match=r"has no config\.json") as empty:
        async with trio_mlx.open_engine(tmp_path):
            pass  # pragma: no cover
    assert empty.value.param == "model"


async def test_open_engine_refuses_a_bad_policy_value_as_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="max_batch") as bad:
        async with trio_mlx.open_engine(max_batch=0):
            pass  # pragma: no cover
    assert bad.value.param == "max_batch"


async def test_open_engine_names_a_missing_adapter(tmp_path: Path) -> None:
    with pytest.raises(trio_mlx.NotFound, match=r"adapter .*nowhere.* not found") as missing:
        async with trio_mlx.open_engine(adapter_path=tmp_path / "nowhere"):
            pass  # pragma: no cover
    assert missing.value.param == "adapter_path"


async def test_open_engine_reports_an_unreachable_hub_model_as_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Offline mode: huggingface_hub answers from the cache only, so nothing leaves the host.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(trio_mlx.NotFound, match="cannot fetch model trio-mlx-tests/absent") as hub:
        async with trio_mlx.open_engine("trio-mlx-tests/absent"):
            pass  # pragma: no cover
    assert hub.value.code == "model_not_downloadable"


async def test_an_error_in_the_engine_block_propagates_unwrapped(tiny_model_path: Path) -> None:
    with pytest.raises(KeyError, match="from the body"):
        async with trio_mlx.open_engine(tiny_model_path):
            raise KeyError("from the body")


async def test_a_chat_template_given_to_open_engine_renders_chat_prompts(
    tiny_model_path: Path,
) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    async with trio_mlx.open_engine(tiny_model_path, chat_template=template) as engine:
        tokens = engine.encode([{"role": "user", "content": "Hello world"}])
        expected = engine.tokenizer.encode("<user>Hello world", add_special_tokens=False)
        assert tokens == list(expected)


async def test_a_chat_template_that_cannot_render_is_refused_at_open(
    tiny_model_path: Path,
) -> None:
    with pytest.raises(InvalidRequest, match="chat template") as refused:
        async with trio_mlx.open_engine(tiny_model_path, chat_template="{{ messages[5] | nope }}"):
            pass
    assert refused.value.param == "chat_template"
