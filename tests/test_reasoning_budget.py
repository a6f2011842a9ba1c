"""A reasoning budget ends the reasoning block once spent: in both lanes, and as
Anthropic's ``thinking.budget_tokens`` on ``/v1/messages``.

The scripted model (``scripted_model.py``) answers any prompt with
``<think>one two three four five six </think>Answer.``; its next token depends
only on the current one, so a ``</think>`` forced early is followed by the answer.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import pytest

import trio_mlx
from http_helpers import live_server
from scripted_model import make_scripted_model

pytestmark = pytest.mark.model

REASONING = ["one ", "two ", "three ", "four ", "five ", "six "]
SCRIPT = ["<think>", *REASONING, "</think>", "Answer."]


@pytest.fixture(scope="module")
def budgeted_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_model(tmp_path_factory.mktemp("models") / "budgeted", SCRIPT)


@pytest.mark.parametrize("lane", ["batch", "serial"])
async def test_the_budget_ends_the_reasoning_block_after_that_many_tokens(
    budgeted_model: Path, lane: str
) -> None:
    async with trio_mlx.open_engine(budgeted_model) as engine:
        tokenizer = engine.tokenizer
        markers = tuple(
            tuple(tokenizer.encode(m, add_special_tokens=False)) for m in ("<think>", "</think>")
        )
        seed = {"seed": 1} if lane == "serial" else {}
        prompt = [{"role": "user", "content": "Go"}]
        texts = []
        for budget in (2, 4, 50):
            params = trio_mlx.SamplingParams(
                max_tokens=20,
                reasoning_budget=budget,
                reasoning_markers=(markers[0], markers[1]),
                **seed,
            )
            completion = await engine.complete(prompt, params)
            assert completion.result.lane == lane
            texts.append(completion.text)
    reasoning = "".join(REASONING)
    assert texts == [
        "<think>one two </think>Answer.",
        "<think>one two three four </think>Answer.",
        f"<think>{reasoning}</think>Answer.",
    ]


async def test_a_budget_without_markers_is_refused() -> None:
    with pytest.raises(trio_mlx.InvalidRequest, match="reasoning_markers") as raised:
        trio_mlx.SamplingParams(reasoning_budget=3)
    assert raised.value.param == "reasoning_budget"
    with pytest.raises(trio_mlx.InvalidRequest, match="two non-empty tuples"):
        trio_mlx.SamplingParams(reasoning_budget=3, reasoning_markers=((1,), ()))


async def test_anthropic_budget_tokens_ends_the_thinking_block(budgeted_model: Path) -> None:
    async with live_server(budgeted_model) as server:
        client = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused")
        question = {"role": "user", "content": "Go"}
        replies = [
            await client.messages.create(
                model="budgeted",
                max_tokens=30,
                messages=[question],
                thinking={"type": "enabled", "budget_tokens": budget},
            )
            for budget in (3, 29)
        ]
        async with client.messages.stream(
            model="budgeted",
            max_tokens=30,
            messages=[question],
            thinking={"type": "enabled", "budget_tokens": 3},
        ) as stream:
            streamed = await stream.get_final_message()
    for reply, reasoning in zip(replies, ["one two three ", "".join(REASONING)], strict=True):
        assert [block.type for block in reply.content] == ["thinking", "text"]
        assert reply.content[0].thinking == reasoning  # type: ignore[union-attr]
        assert reply.content[1].text == "Answer."  # type: ignore[union-attr]
    assert streamed.content[0].thinking == "one two three "  # type: ignore[union-attr]
