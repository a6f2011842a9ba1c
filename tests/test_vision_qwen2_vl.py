"""M-RoPE vision families in the batch: a tiny random qwen2_vl and qwen2_5_vl (mlx-vlm's
own classes).

Its image tokens take positions from the image grid and the tokens after them fewer
positions than their index; an image row's greedy tokens must be the model's own, as
a one-row forward over the whole sequence at mlx-vlm's positions gives them, in the
lane, solo, beside text rows, from the prompt cache and over HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import trio

import trio_mlx

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (the 'vision' extra; nox -s tests installs it)"
)

from engine_helpers import NO_EOS
from http_helpers import live_server
from vision_helpers import QUESTION, data_url, image_chat, png

TOKENS = 16
PARAMS = trio_mlx.SamplingParams(max_tokens=TOKENS, logit_bias=NO_EOS)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    from trio_mlx.testing import make_random_vlm

    family = request.param
    return make_random_vlm(tmp_path_factory.mktemp("models") / f"tiny-{family}", family=family)


def _lane(path: Path, budget: int | None = None) -> Any:
    from trio_mlx._start.vision import load
    from trio_mlx.testing import BatchLane

    model, tokenizer, _config, vision = load(str(path))
    return BatchLane(model, tokenizer, max_batch=8, prefill_budget=budget, vision=vision)


def _image_row(lane: Any, row_id: int, chat: list[dict[str, Any]]) -> Any:
    """An image request's row as the engine makes it (its images decoded and hashed)."""
    from trio_mlx._core.images import decode, split_images
    from trio_mlx.testing import RowSpec

    messages, found = split_images(chat)
    decoded = [decode(name, image, 1 << 20) for name, image in found]
    images, digests = [d.image for d in decoded], [d.digest for d in decoded]
    tokens, prompt, _ = lane.vision.encode(lane.tokenizer, messages, images, digests, None, None)
    return RowSpec(row_id, tuple(tokens), PARAMS, images=prompt)


def _reference(lane: Any, row: Any) -> list[int]:
    """Greedy tokens of a one-row forward over the whole sequence each step, no cache:
    mlx-vlm's embeddings and its M-RoPE positions of every token (``get_rope_index``)."""
    import mlx.core as mx

    model, arrays = lane.vision.model, row.images.arrays
    pixels, grid = mx.array(arrays["pixel_values"]), mx.array(arrays["image_grid_thw"])
    tokens, out = list(row.prompt), []
    bias = mx.zeros((model.config.vocab_size,))
    for token_id, value in NO_EOS.items():
        bias[token_id] = value
    for _ in range(TOKENS):
        ids = mx.array([tokens])
        embeds = model.get_input_embeddings(ids, pixels, image_grid_thw=grid).inputs_embeds
        at, _delta = model.language_model.get_rope_index(ids, grid)
        logits = model.language_model(ids, embeds, position_ids=at).logits[0, -1]
        out.append(int(mx.argmax(logits + bias).item()))
        tokens.append(out[-1])
    return out


def _drain(lane: Any, plans: dict[int, Any], limit: int = 300) -> dict[int, list[int]]:
    from trio_mlx.testing import StepPlan

    tokens: dict[int, list[int]] = {}
    for k in range(limit):
        if k > max(plans, default=0) and not lane.rows:
            return tokens
        for event in lane.step(plans.get(k, StepPlan())).events:
            assert event.error is None
            tokens.setdefault(event.id, []).extend(event.token_ids)
    raise AssertionError(f"rows still in the lane after {limit} steps")


@pytest.fixture(scope="module")
def references(qwen_path: Path) -> dict[int, list[int]]:
    """Image seed -> the reference answer to ``image_chat`` of it."""
    lane = _lane(qwen_path)
    return {
        seed: _reference(lane, _image_row(lane, 1, image_chat(_image(seed)))) for seed in (1, 2)
    }


def _image(seed: int) -> trio_mlx.ImageInput:
    return trio_mlx.ImageInput(png(seed))


def test_image_rows_decode_as_the_model_does_at_its_m_rope_positions(
    qwen_path: Path, references: dict[int, list[int]]
) -> None:
    from trio_mlx.testing import RowSpec, StepPlan

    lane = _lane(qwen_path)
    rows = [_image_row(lane, seed, image_chat(_image(seed))) for seed in (1, 2)]
    assert rows[0].images.arrays["image_grid_thw"].tolist() == [[1, 8, 8]]  # 16 tokens, 4 x 4
    assert references[1] != references[2]
    # Each alone (it decodes solo), the two together, and prefilled 8 positions a step
    # beside a text row: the model's own tokens.
    for row in rows:
        assert _drain(lane, {0: StepPlan([row])}) == {row.id: references[row.id]}
    assert _drain(lane, {0: StepPlan(rows)}) == {1: references[1], 2: references[2]}
    chunked = _lane(qwen_path, 8)
    text = RowSpec(9, tuple(chunked.tokenizer.encode("Tell me about topic 9.")), PARAMS)
    together = _drain(chunked, {0: StepPlan([text]), 2: StepPlan(rows)})
    assert (together[1], together[2]) == (references[1], references[2])
    assert together[9] == _drain(_lane(qwen_path, 8), {0: StepPlan([text])})[9]


async def test_an_image_row_among_text_rows_leaves_their_tokens_alone(
    qwen_path: Path, references: dict[int, list[int]]
) -> None:
    texts = [[{"role": "user", "content": f"Tell me about topic {i}."}] for i in range(5)]
    picture = image_chat(_image(1))
    async with trio_mlx.open_engine(qwen_path, max_batch=8, prompt_cache_bytes=0) as engine:
        assert engine.takes_images
        alone = [await engine.complete(chat, PARAMS) for chat in texts]  # type: ignore[arg-type]
        image_alone = await engine.complete(picture, PARAMS)  # type: ignore[arg-type]
        again = await engine.complete(picture, PARAMS)  # type: ignore[arg-type]
        other = await engine.complete(image_chat(_image(2)), PARAMS)  # type: ignore[arg-type]
        together: dict[int, trio_mlx.Completion] = {}

        async def run(i: int, prompt: Any) -> None:
            together[i] = await engine.complete(prompt, PARAMS)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 5, picture)
            for i, chat in enumerate(texts):
                nursery.start_soon(run, i, chat)
    assert list(image_alone.token_ids) == list(again.token_ids) == references[1]
    assert list(other.token_ids) == references[2]
    assert [together[i].token_ids for i in range(5)] == [c.token_ids for c in alone]
    assert list(together[5].token_ids) == references[1]
    assert together[5].result.lane == "batch"


async def test_the_prompt_cache_serves_an_image_prompt_in_its_own_frame(
    qwen_path: Path, references: dict[int, list[int]]
) -> None:
    first = image_chat(_image(1))

    async def turns(engine: trio_mlx.Engine) -> list[trio_mlx.Completion]:
        one = await engine.complete(first, PARAMS)  # type: ignore[arg-type]
        repeat = await engine.complete(first, PARAMS)  # type: ignore[arg-type]
        second = [
            *first,
            {"role": "assistant", "content": one.text},
            *image_chat(_image(2), "And now?"),
        ]
        two = await engine.complete(second, PARAMS)  # type: ignore[arg-type]
        third = [*second, {"role": "assistant", "content": two.text}]
        third.append({"role": "user", "content": "Which was brighter?"})
        return [one, repeat, two, await engine.complete(third, PARAMS)]  # type: ignore[arg-type]

    async with trio_mlx.open_engine(qwen_path) as engine:
        cached = await turns(engine)
    async with trio_mlx.open_engine(qwen_path, prompt_cache_bytes=0) as engine:
        fresh = await turns(engine)
    assert [c.token_ids for c in cached] == [c.token_ids for c in fresh]
    assert list(cached[0].token_ids) == references[1]
    one, repeat, two, three = (c.result for c in cached)
    assert repeat.cached_tokens == one.prompt_tokens - 1
    # Turn 1's entry holds its image's positions in its own frame; turn 2's new image
    # moves every position after it, so nothing of turn 1 serves it. Turn 3 adds no
    # image: all of turn 2's prompt serves.
    assert two.cached_tokens == 0
    assert three.cached_tokens >= two.prompt_tokens - 1


async def test_openai_chat_sees_the_image_on_qwen2_vl(qwen_path: Path) -> None:
    def chat(url: str) -> Any:
        parts = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTION},
        ]
        return [{"role": "user", "content": parts}]

    async with live_server(qwen_path) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            model = server.engine.model_id
            replies = [
                await client.chat.completions.create(
                    model=model, messages=chat(data_url(png(seed))), max_tokens=8, temperature=0
                )
                for seed in (1, 2, 1)
            ]
            stream = await client.chat.completions.create(
                model=model, messages=chat(data_url(png(1))), max_tokens=8, stream=True
            )
            streamed = "".join(
                [c.choices[0].delta.content or "" async for c in stream if c.choices]
            )
        direct = await server.engine.complete(
            image_chat(_image(1)), trio_mlx.SamplingParams(max_tokens=8)
        )
    texts = [r.choices[0].message.content or "" for r in replies]
    assert texts[0] == texts[2] == streamed == direct.text
    assert texts[0] != texts[1]
    assert replies[0].usage is not None
    assert replies[2].usage is not None
    assert replies[2].usage.prompt_tokens == replies[0].usage.prompt_tokens


async def test_image_rows_that_speculate_equal_plain_decoding(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from trio_mlx.testing import make_random_vlm

    # Small weights: its greedy text soon repeats, so prompt lookup drafts are taken.
    loopy = make_random_vlm(
        tmp_path_factory.mktemp("models") / "loopy-qwen2-vl", family="qwen2_vl", weight_scale=1.0
    )
    prompts: list[Any] = [image_chat(_image(1)), image_chat(_image(2)), "Tell me about topic 1."]
    params = trio_mlx.SamplingParams(max_tokens=40, ignore_eos=True)

    async def run(**settings: Any) -> tuple[list[tuple[int, ...]], trio_mlx.EngineStatistics]:
        outs: list[tuple[int, ...]] = [()] * len(prompts)
        async with trio_mlx.open_engine(
            loopy, speculation_governor=False, prompt_cache_bytes=0, **settings
        ) as engine:

            async def one(i: int) -> None:
                outs[i] = (await engine.complete(prompts[i], params)).token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i)
            return outs, engine.statistics()

    plain, _ = await run()
    spec, stats = await run(prompt_lookup=True)
    assert spec == plain
    assert stats.draft_accepted_tokens["prompt_lookup"] > 0


async def test_an_image_request_with_a_seed_runs_alone_and_answers_as_in_the_batch(
    qwen_path: Path,
) -> None:
    """The serial lane prefills at the M-RoPE positions too (a seed runs a request alone)."""
    chat = image_chat(_image(1))
    seeded = trio_mlx.SamplingParams(max_tokens=TOKENS, logit_bias=NO_EOS, seed=3)
    async with trio_mlx.open_engine(qwen_path) as engine:
        batched = await engine.complete(chat, PARAMS)
        alone = await engine.complete(chat, seeded)
        other = await engine.complete(image_chat(_image(2)), seeded)
    assert (batched.result.lane, alone.result.lane) == ("batch", "serial")
    assert alone.token_ids == batched.token_ids
    assert alone.result.cached_tokens > 0  # the batch's entry, in its frame
    assert other.token_ids != alone.token_ids
