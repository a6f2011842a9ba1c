"""The official ``openai`` client against a live server on the tiny model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from http_helpers import NO_EOS, LiveServer, live_server

pytestmark = pytest.mark.model

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]


@pytest.fixture
async def server(tiny_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(tiny_model_path) as live:
        yield live


@pytest.fixture
async def client(server: LiveServer) -> AsyncIterator[openai.AsyncOpenAI]:
    # openai's async client runs on anyio, so it works under Trio as it is.
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


async def test_models_list_names_the_served_model(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    ids = [model.id async for model in client.models.list()]
    assert ids == [server.engine.model_id]
    model = await client.models.retrieve(server.engine.model_id)
    assert model.owned_by == "trio-mlx"


async def test_chat_completion_with_usage(server: LiveServer, client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=server.engine.model_id, messages=USER, max_tokens=7, logit_bias=NO_EOS
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 7
    assert reply.usage.prompt_tokens == len(server.engine.encode(USER))
    assert reply.object == "chat.completion"


async def test_chat_stream_concatenates_to_the_whole_reply(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    model = server.engine.model_id
    whole = await client.chat.completions.create(
        model=model, messages=USER, max_tokens=12, logit_bias=NO_EOS
    )
    stream = await client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=12,
        logit_bias=NO_EOS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


async def test_chat_logprobs_shape(server: LiveServer, client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=server.engine.model_id,
        messages=USER,
        max_tokens=5,
        logit_bias=NO_EOS,
        logprobs=True,
        top_logprobs=3,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert len(logprobs.content) == 5
    for entry in logprobs.content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.bytes == list(entry.token.encode())


async def test_text_completion_and_its_logprobs(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    reply = await client.completions.create(
        model=server.engine.model_id, prompt="Hello", max_tokens=6, logprobs=2, logit_bias=NO_EOS
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens is not None
    assert len(choice.logprobs.tokens) == 6
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset == [
        sum(len(t) for t in choice.logprobs.tokens[:i]) for i in range(6)
    ]
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 6


async def test_text_completion_stream_and_n_choices(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    stream = await client.completions.create(
        model=server.engine.model_id,
        prompt="Hello",
        max_tokens=5,
        n=3,
        stream=True,
        logit_bias=NO_EOS,
    )
    texts = ["", "", ""]
    finished = set()
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    # Greedy decoding: every choice of one prompt is the same text.
    assert texts[0] == texts[1] == texts[2]


async def test_bad_request_raises_with_our_message(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    model = server.engine.model_id
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=model, messages=USER, temperature=-1)
    assert caught.value.body == {
        "message": "temperature must be >= 0.0, not -1.0",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": None,
    }
    with pytest.raises(openai.BadRequestError, match="messages must not be empty"):
        await client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.chat.completions.create(model="gpt-4o", messages=USER)


async def test_tools_on_a_model_without_tool_calling_is_a_clear_400(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    with pytest.raises(openai.BadRequestError, match="does not support tool calling") as caught:
        await client.chat.completions.create(
            model=server.engine.model_id,
            messages=USER,
            tools=[tool],  # type: ignore[list-item]
        )
    assert caught.value.code == "tools_unsupported"
