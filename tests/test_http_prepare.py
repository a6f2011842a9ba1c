"""One request, one rendering: every endpoint renders the chat template once.

The engine's ``prepare`` renders a chat (messages, tools, template arguments)
into token ids and says whether the prompt opens a reasoning block; the HTTP
layer's ``prepare()`` hands that prepared prompt to generation, which does not
render it again. Counted on the tokenizer's ``apply_chat_template`` for one
request on each endpoint, streamed and whole, on a model with reasoning markers
(the case that rendered twice: once to look for an open ``<think>``, once to
tokenize).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from http_helpers import LiveServer, live_server
from scripted_model import make_scripted_model
from trio_mlx import InvalidRequest, PreparedPrompt
from trio_mlx.testing import CHAT_TEMPLATE

pytestmark = pytest.mark.model

USER: Any = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The template opens the reasoning block itself (as Qwen3's may).
    return make_scripted_model(
        tmp_path_factory.mktemp("models") / "thinker",
        ["Plan.", "</think>", "Answer."],
        tokenizer_config={"chat_template": CHAT_TEMPLATE + "<think>"},
        extra_tokens=["<think>", "</think>"],
    )


@pytest.fixture
async def server(thinking_model: Path) -> AsyncIterator[LiveServer]:
    async with live_server(thinking_model) as live:
        yield live


@pytest.fixture
def renders(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each call of the tokenizer's ``apply_chat_template`` appends 1."""
    calls: list[int] = []
    kind = type(server.engine.tokenizer)
    original: Callable[..., Any] = kind.apply_chat_template

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(kind, "apply_chat_template", counted)
    return calls


async def test_each_endpoint_renders_the_chat_template_once(
    server: LiveServer, renders: list[int]
) -> None:
    counts: dict[str, int] = {}
    async with (
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as oai,
        anthropic.AsyncAnthropic(base_url=server.url, api_key="-", max_retries=0) as claude,
    ):
        for stream in (False, True):
            renders.clear()
            chat = await oai.chat.completions.create(
                model="thinker", messages=USER, max_tokens=8, stream=stream
            )
            if stream:
                reasoning = "".join(
                    [
                        (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        async for chunk in chat  # type: ignore[union-attr]
                        if chunk.choices
                    ]
                )
            else:
                reasoning = (chat.choices[0].message.model_extra or {})["reasoning_content"]  # type: ignore[union-attr]
            # The prompt opened the block: what came before </think> is reasoning.
            assert reasoning == "Plan."
            counts[f"chat stream={stream}"] = len(renders)

            renders.clear()
            if stream:
                async with oai.responses.stream(
                    model="thinker", input="Weather?", max_output_tokens=8
                ) as events:
                    reply = await events.get_final_response()
            else:
                reply = await oai.responses.create(
                    model="thinker", input="Weather?", max_output_tokens=8
                )
            assert reply.output_text == "Answer."
            counts[f"responses stream={stream}"] = len(renders)

            renders.clear()
            if stream:
                async with claude.messages.stream(
                    model="thinker", max_tokens=8, messages=USER
                ) as events:
                    message = await events.get_final_message()
            else:
                message = await claude.messages.create(model="thinker", max_tokens=8, messages=USER)
            assert [block.type for block in message.content] == ["thinking", "text"]
            counts[f"messages stream={stream}"] = len(renders)

            renders.clear()
            await oai.completions.create(
                model="thinker", prompt="Weather?", max_tokens=2, stream=stream
            )
            counts[f"completions stream={stream}"] = len(renders)
        # n choices share one rendering.
        renders.clear()
        several = await oai.chat.completions.create(
            model="thinker", messages=USER, max_tokens=8, n=3
        )
        assert len(several.choices) == 3
        counts["chat n=3"] = len(renders)
    assert counts == {
        **{
            f"{api} stream={s}": 1
            for api in ("chat", "responses", "messages")
            for s in (False, True)
        },
        "completions stream=False": 0,
        "completions stream=True": 0,
        "chat n=3": 1,
    }


async def test_prepare_says_whether_the_prompt_opens_reasoning(
    server: LiveServer, renders: list[int]
) -> None:
    engine = server.engine
    prepared = await engine.prepare(USER)
    assert isinstance(prepared, PreparedPrompt)
    assert prepared.opens_reasoning
    assert list(prepared.tokens) == engine.encode(USER)
    assert len(renders) == 2  # prepare, and encode for the comparison
    # Other markers than the tokenizer's: this prompt opens none of them.
    assert not (await engine.prepare(USER, reasoning_markers=("<plan>", "</plan>"))).opens_reasoning
    # Text and token ids are not chats: no template, no reasoning block.
    text = await engine.prepare("<think>")
    assert not text.opens_reasoning
    assert text.tokens == tuple(engine.encode("<think>"))
    renders.clear()
    async with engine.generate(prepared) as stream:
        assert stream.prompt_tokens == len(prepared.tokens)
        async for _ in stream:
            pass
    assert renders == []  # generation took the tokens as they were
    with pytest.raises(InvalidRequest, match="prepared"):
        async with engine.generate(prepared, tools=[{"type": "function"}]):
            pass


async def test_max_tokens_beyond_the_context_is_cut_once_by_the_engine(server: LiveServer) -> None:
    context = server.engine.context_length
    assert context is not None
    prompt_tokens = len(server.engine.encode(USER))
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for path, body in (
            ("/v1/chat/completions", {"messages": USER}),
            ("/v1/completions", {"prompt": "Weather?"}),
        ):
            reply = await http.post(path, json={**body, "model": "thinker", "max_tokens": 10**9})
            assert reply.status_code == 200, reply.text
            used = reply.json()["usage"]["prompt_tokens"]
            assert used == prompt_tokens or path == "/v1/completions"
            # max_tokens ran as the room the prompt left, and the header says so.
            assert reply.headers["x-max-tokens-clamped"] == str(context - used)


async def test_several_prompts_render_together_and_a_refused_one_is_a_400(
    server: LiveServer,
) -> None:
    vocab = len(server.engine.tokenizer.get_vocab())
    prompts: list[Any] = ["Weather?", "Paris?" * 300, "Rome?"]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        whole = await http.post(
            "/v1/completions", json={"model": "thinker", "prompt": prompts, "max_tokens": 1}
        )
        refused = await http.post(
            "/v1/completions",
            json={"model": "thinker", "prompt": ["Hi", "Paris? " * 5000, "Rome?"], "max_tokens": 1},
        )
        outside = await http.post(
            "/v1/completions",
            json={"model": "thinker", "prompt": [[1, 2], [vocab + 5]], "max_tokens": 1},
        )
    assert whole.status_code == 200, whole.text
    assert [c["index"] for c in whole.json()["choices"]] == [0, 1, 2]
    expected = sum(len(server.engine.encode(p)) for p in prompts)
    assert whole.json()["usage"]["prompt_tokens"] == expected
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert outside.status_code == 400
    assert "outside the vocabulary" in outside.json()["error"]["message"]


async def test_a_prepared_prompt_is_checked_as_token_ids_are(server: LiveServer) -> None:
    vocab = len(server.engine.tokenizer.get_vocab())
    context = server.engine.context_length
    assert context is not None
    for bad, said in (
        (PreparedPrompt(()), "tokenizes to nothing"),
        (PreparedPrompt((1, vocab + 7)), "outside the vocabulary"),
        (PreparedPrompt((-1,)), "outside the vocabulary"),
        (PreparedPrompt((1,) * (context + 1)), "context"),
    ):
        with pytest.raises(InvalidRequest, match=said):
            async with server.engine.generate(bad):
                pass
    with pytest.raises(InvalidRequest, match="token ids"):
        PreparedPrompt([1, "2"])  # type: ignore[list-item]
    assert PreparedPrompt([1, 2]).tokens == (1, 2)
