"""Vision-language models in the engine: a tiny random llava (mlx-vlm's own classes).

Image rows are prefilled through the vision encoder, then decode in the continuous
batch beside text rows; the prompt cache keys them by the images' pixels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (the 'vision' extra; nox -s tests installs it)"
)

from engine_helpers import NO_EOS
from vision_helpers import drain, image_chat, png

PARAMS = trio_mlx.SamplingParams(max_tokens=10, logit_bias=NO_EOS)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trio_mlx.testing import make_random_vlm

    return make_random_vlm(tmp_path_factory.mktemp("models") / "tiny-llava")


async def _answer(engine: trio_mlx.Engine, prompt: object) -> trio_mlx.Completion:
    return await engine.complete(prompt, PARAMS)  # type: ignore[arg-type]


async def test_images_decide_the_answer_and_the_same_image_answers_the_same(
    vlm_path: Path,
) -> None:
    async with trio_mlx.open_engine(vlm_path, prompt_cache_bytes=0) as engine:
        assert engine.takes_images
        first = await _answer(engine, image_chat(trio_mlx.ImageInput(png(1))))
        second = await _answer(engine, image_chat(trio_mlx.ImageInput(png(2))))
        again = await _answer(engine, image_chat(trio_mlx.ImageInput(png(1))))
    assert first.token_ids != second.token_ids
    assert first.token_ids == again.token_ids
    assert len(first.token_ids) == PARAMS.max_tokens


async def test_pixels_and_encoded_bytes_of_one_image_answer_alike(vlm_path: Path) -> None:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png(3))).convert("RGB"))
    async with trio_mlx.open_engine(vlm_path, prompt_cache_bytes=0) as engine:
        encoded = await _answer(engine, image_chat(trio_mlx.ImageInput(png(3))))
        raw = await _answer(engine, image_chat(trio_mlx.ImageInput(pixels)))
    assert encoded.token_ids == raw.token_ids


async def test_an_image_row_among_text_rows_leaves_their_tokens_alone(vlm_path: Path) -> None:
    texts = [[{"role": "user", "content": f"Tell me about topic {i}."}] for i in range(7)]
    picture = image_chat(trio_mlx.ImageInput(png(4)))
    async with trio_mlx.open_engine(vlm_path, max_batch=8, prompt_cache_bytes=0) as engine:
        alone = [await _answer(engine, chat) for chat in texts]
        image_alone = await _answer(engine, picture)
        together: dict[int, trio_mlx.Completion] = {}
        peak = 0

        async def run(i: int, prompt: object) -> None:
            together[i] = await _answer(engine, prompt)

        async def watch() -> None:  # how many rows decoded at once
            nonlocal peak
            while len(together) < 8:
                peak = max(peak, engine.statistics().running_rows)
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            nursery.start_soon(run, 7, picture)
            for i, chat in enumerate(texts):
                nursery.start_soon(run, i, chat)
    assert peak >= 2
    assert [together[i].token_ids for i in range(7)] == [c.token_ids for c in alone]
    assert together[7].token_ids == image_alone.token_ids
    assert together[7].result.lane == "batch"


async def test_a_repeated_image_is_served_from_the_prompt_cache(vlm_path: Path) -> None:
    async with trio_mlx.open_engine(vlm_path) as engine:
        first = await _answer(engine, image_chat(trio_mlx.ImageInput(png(5))))
        again = await _answer(engine, image_chat(trio_mlx.ImageInput(png(5))))
        other = await _answer(engine, image_chat(trio_mlx.ImageInput(png(6))))
    assert first.result.cached_tokens == 0
    # All but the prompt's last token, the image's 16 tokens among them.
    assert again.result.cached_tokens == first.result.prompt_tokens - 1
    assert again.token_ids == first.token_ids
    # Another image of the same size has the same tokens, but not the same prompt.
    assert other.result.prompt_tokens == first.result.prompt_tokens
    assert other.result.cached_tokens == 0


@pytest.mark.parametrize("budget", [None, 8], ids=["whole", "chunks-of-8"])
async def test_a_screenshot_history_reuses_the_earlier_turns(
    vlm_path: Path, budget: int | None
) -> None:
    # With a budget of 8 every image prompt is prefilled over several steps, on top of
    # the cached earlier turns.
    first = image_chat(trio_mlx.ImageInput(png(7)))

    async def turns(engine: trio_mlx.Engine) -> list[trio_mlx.Completion]:
        one = await _answer(engine, first)
        second = [
            *first,
            {"role": "assistant", "content": one.text},
            *image_chat(trio_mlx.ImageInput(png(8)), "And now?"),
        ]
        two = await _answer(engine, second)
        third = [*second, {"role": "assistant", "content": two.text}]
        third.append({"role": "user", "content": "Which was brighter?"})
        return [one, two, await _answer(engine, third)]

    async with trio_mlx.open_engine(vlm_path, prefill_budget=budget) as engine:
        cached = await turns(engine)
    async with trio_mlx.open_engine(vlm_path, prompt_cache_bytes=0) as engine:
        fresh = await turns(engine)
    assert [c.token_ids for c in cached] == [c.token_ids for c in fresh]
    one, two, three = (c.result for c in cached)
    # Turn 2 takes turn 1's prompt (its image included) from the cache and sees only
    # its new image; turn 3 (no new image) takes all of turn 2's prompt.
    assert one.cached_tokens == 0
    assert one.prompt_tokens - 1 <= two.cached_tokens < two.prompt_tokens - 16
    assert three.cached_tokens >= two.prompt_tokens - 1


def _lane(vlm_path: Path, budget: int | None) -> tuple[Any, Any]:
    """A batch lane over the tiny llava (``budget``: its prefill budget), and its tokenizer."""
    from trio_mlx._start.vision import load
    from trio_mlx.testing import BatchLane

    model, tokenizer, _config, vision = load(str(vlm_path))
    lane = BatchLane(model, tokenizer, max_batch=8, prefill_budget=budget, vision=vision)
    return lane, tokenizer


def _image_row(lane: Any, row_id: int, seed: int, max_tokens: int = 10) -> Any:
    """An image request's row as the engine makes it (its image decoded and hashed)."""
    from trio_mlx._core.images import decode, split_images
    from trio_mlx.testing import RowSpec

    messages, found = split_images(image_chat(trio_mlx.ImageInput(png(seed))))
    decoded = [decode(name, image, 1 << 20) for name, image in found]
    images = [d.image for d in decoded]
    digests = [d.digest for d in decoded]
    tokens, prompt, _ = lane.vision.encode(lane.tokenizer, messages, images, digests, None, None)
    params = trio_mlx.SamplingParams(max_tokens=max_tokens, logit_bias=NO_EOS)
    return RowSpec(row_id, tuple(tokens), params, images=prompt)


def _text_row(tokenizer: Any, row_id: int, max_tokens: int) -> Any:
    from trio_mlx.testing import RowSpec

    params = trio_mlx.SamplingParams(max_tokens=max_tokens, logit_bias=NO_EOS)
    return RowSpec(row_id, tuple(tokenizer.encode(f"Tell me about topic {row_id}.")), params)


def test_an_image_prompt_past_the_budget_is_prefilled_a_chunk_a_step_and_answers_alike(
    vlm_path: Path,
) -> None:
    from trio_mlx.testing import StepPlan

    whole, _ = _lane(vlm_path, None)
    chunked, _ = _lane(vlm_path, 8)
    row = _image_row(whole, 1, 9)
    image_tokens = row.prompt.count(whole.vision.image_token_id)
    assert len(row.prompt) - 1 > 4 * 8
    alone, prefilled_whole = drain(whole, {0: StepPlan([row])})
    tokens, prefilled = drain(chunked, {0: StepPlan([row])})
    assert tokens == alone
    assert len(tokens[1]) == 10
    # One step encodes the image; then the language model runs all but the last token,
    # at most the budget a step (the whole lane in one pass).
    assert prefilled_whole[:2] == [image_tokens, len(row.prompt) - 1]
    assert prefilled[0] == image_tokens
    chunks = [n for n in prefilled[1:] if n]
    assert sum(chunks) == len(row.prompt) - 1
    assert max(chunks) <= 8
    assert len(chunks) >= (len(row.prompt) - 1) / 8


def test_text_rows_beside_a_chunked_image_prefill_keep_their_greedy_tokens(
    vlm_path: Path,
) -> None:
    from trio_mlx.testing import StepPlan

    lane, tokenizer = _lane(vlm_path, 8)
    texts = [_text_row(tokenizer, i, 24) for i in range(3)]
    image = _image_row(lane, 9, 10)
    alone = {t.id: drain(_lane(vlm_path, 8)[0], {0: StepPlan([t])})[0][t.id] for t in texts}
    image_alone = drain(_lane(vlm_path, None)[0], {0: StepPlan([image])})[0][9]
    # The image arrives while the text rows decode, another text row while it prefills.
    together, prefilled = drain(
        lane, {0: StepPlan(texts[:2]), 3: StepPlan([image]), 5: StepPlan(texts[2:])}
    )
    assert {t.id: together[t.id] for t in texts} == alone
    assert together[9] == image_alone
    assert max(prefilled[4:]) <= max(8, image.prompt.count(lane.vision.image_token_id))


def test_a_text_row_joins_beside_an_image_prefill_within_the_budget(vlm_path: Path) -> None:
    from trio_mlx.testing import StepPlan

    lane, tokenizer = _lane(vlm_path, 32)
    image, text = _image_row(lane, 9, 12), _text_row(tokenizer, 1, 12)
    image_tokens = image.prompt.count(lane.vision.image_token_id)
    assert image_tokens + len(text.prompt) - 1 <= 32 < len(image.prompt)
    # The image's encoder pass and the text row's prompt share the first step: the image
    # row is not in the text pass, so it pads none of it.
    first = lane.step(StepPlan([image, text]))
    assert [n for n, _ in first.timings] == [image_tokens + len(text.prompt) - 1]
    tokens, _ = drain(lane, {})
    for event in first.events:
        tokens[event.id] = [*event.token_ids, *tokens.get(event.id, [])]
    assert tokens[1] == drain(_lane(vlm_path, 32)[0], {0: StepPlan([text])})[0][1]
    assert tokens[9] == drain(_lane(vlm_path, None)[0], {0: StepPlan([image])})[0][9]


def test_an_image_row_cancelled_or_parked_mid_prefill_leaves_nothing_behind(
    vlm_path: Path,
) -> None:
    from trio_mlx.testing import StepPlan

    lane, tokenizer = _lane(vlm_path, 8)
    image = _image_row(lane, 9, 11)
    image_alone = drain(_lane(vlm_path, None)[0], {0: StepPlan([image])})[0][9]
    image_tokens = image.prompt.count(lane.vision.image_token_id)
    # Cancelled after its encoder pass and one chunk: no event, no row, no more work.
    steps = [lane.step(StepPlan([image])), lane.step()]
    assert [n for step in steps for n, _ in step.timings] == [image_tokens, 8]
    steps.append(lane.step(StepPlan(removes=[9])))
    assert not any(e.token_ids or e.error for step in steps for e in step.events)
    assert lane.rows == 0
    assert (lane.step().steps, lane.step().timings) == (0, ())
    # Parked mid-prefill (behind a text row that came first): it holds no work while
    # parked and starts again when resumed.
    text = _text_row(tokenizer, 1, 30)
    steps = [lane.step(StepPlan([text, image])), lane.step(), lane.step()]
    prefilled = sum(n for step in steps for n, _ in step.timings)
    assert len(text.prompt) - 1 + image_tokens < prefilled < len(text.prompt) + len(image.prompt)
    lane.park([9])
    assert lane.rows == 2
    parked = [lane.step() for _ in range(3)]
    assert all(n == 0 for result in parked for n, _ in result.timings)
    assert not any(e.id == 9 for result in parked for e in result.events)
    tokens, _ = drain(lane, {0: StepPlan(resumes=[9])})
    assert tokens[9] == image_alone
    assert lane.rows == 0
    assert (lane.step().steps, lane.dead_rows) == (0, 0)


async def test_bad_images_are_refused_naming_them(vlm_path: Path) -> None:
    async with trio_mlx.open_engine(vlm_path, max_image_pixels=32 * 32) as engine:
        with pytest.raises(trio_mlx.InvalidRequest, match="image 0 is not an image") as bad:
            await _answer(engine, image_chat(trio_mlx.ImageInput(b"not a png")))
        assert bad.value.code == "invalid_image"
        with pytest.raises(trio_mlx.InvalidRequest, match="33 x 32 pixels") as big:
            await _answer(engine, image_chat(trio_mlx.ImageInput(png(1, (33, 32)))))
        assert big.value.code == "image_too_large"
        # The engine serves on.
        assert len((await _answer(engine, image_chat(trio_mlx.ImageInput(png(1))))).token_ids)


@pytest.mark.parametrize("alone", ["seed", "kv_bits", "max_batch=1"])
async def test_an_image_request_that_runs_alone_answers_as_in_the_batch(
    vlm_path: Path, alone: str
) -> None:
    """The serial lane (a seed, a quantized cache, ``max_batch=1``) prefills images as
    the batch does; a repeated image comes from the prompt cache where the cache is
    the plain one (not for a quantized cache)."""
    chat = image_chat(trio_mlx.ImageInput(png(3)))
    async with trio_mlx.open_engine(vlm_path) as engine:
        batched = await _answer(engine, chat)
        assert batched.result.lane == "batch"
    extra: dict[str, Any] = {"seed": 1} if alone == "seed" else {}
    if alone == "kv_bits":
        extra = {"kv_bits": 8, "kv_group_size": 32}
    params = trio_mlx.SamplingParams(max_tokens=10, logit_bias=NO_EOS, **extra)
    settings: dict[str, Any] = {"max_batch": 1} if alone == "max_batch=1" else {}
    async with trio_mlx.open_engine(vlm_path, **settings) as engine:
        first = await engine.complete(chat, params)
        again = await engine.complete(chat, params)
        other = await engine.complete(image_chat(trio_mlx.ImageInput(png(4))), params)
    assert first.result.lane == again.result.lane == "serial"
    if alone == "kv_bits":  # 8-bit keys and values: the same model, not the same sums
        assert len(first.token_ids) == PARAMS.max_tokens
        assert again.result.cached_tokens == 0
    else:
        assert first.token_ids == batched.token_ids
        assert again.result.cached_tokens == first.result.prompt_tokens - 1
    assert first.result.cached_tokens == 0
    assert again.token_ids == first.token_ids
    assert other.token_ids != first.token_ids


async def test_a_failed_image_prefill_fails_its_request_alone(
    vlm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_mlx._start.vision import Vision

    def broken(*_: object) -> None:
        raise RuntimeError("injected: the vision encoder failed")

    async with trio_mlx.open_engine(vlm_path, prompt_cache_bytes=0) as engine:
        text = [{"role": "user", "content": "Tell me about topic 1."}]
        before = await _answer(engine, text)
        with monkeypatch.context() as patch:
            patch.setattr(Vision, "embed", broken)
            with pytest.raises(trio_mlx.GenerationFailed, match="injected"):
                await _answer(engine, image_chat(trio_mlx.ImageInput(png(1))))
        after = await _answer(engine, text)
        image = await _answer(engine, image_chat(trio_mlx.ImageInput(png(1))))
    assert after.token_ids == before.token_ids
    assert len(image.token_ids) == PARAMS.max_tokens


async def test_a_vision_family_that_cannot_batch_is_refused_at_load(
    vlm_path: Path, tmp_path: Path
) -> None:
    import json

    from trio_mlx.testing import with_context

    folder = with_context(vlm_path, tmp_path / "idefics3-shaped", 2048)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "idefics3"}))
    with pytest.raises(trio_mlx.InvalidRequest, match="'idefics3' is not supported") as refused:
        async with trio_mlx.open_engine(folder):
            pass
    assert refused.value.code == "vision_family_unsupported"


def test_pixel_arrays_are_checked() -> None:
    import numpy as np

    from trio_mlx._core.images import decode

    with pytest.raises(trio_mlx.InvalidRequest, match="uint8"):
        decode("image 0", trio_mlx.ImageInput(np.zeros((4, 4, 3), np.float32)), 100)
    with pytest.raises(trio_mlx.InvalidRequest, match="more than the 15 allowed"):
        decode("image 0", trio_mlx.ImageInput(np.zeros((4, 4, 3), np.uint8)), 15)
    one = decode("a", trio_mlx.ImageInput(np.zeros((4, 4, 4), np.uint8)), 16)
    same = decode("b", trio_mlx.ImageInput(np.zeros((4, 4, 3), np.uint8)), 16)
    assert one.digest == same.digest  # RGBA with zero alpha: the same RGB pixels


async def test_a_text_model_refuses_images(tiny_model_path: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        assert not engine.takes_images
        with pytest.raises(trio_mlx.InvalidRequest, match="does not take images") as refused:
            await _answer(engine, image_chat(trio_mlx.ImageInput(png(1))))
    assert refused.value.code == "images_unsupported"


def test_a_text_model_never_imports_mlx_vlm(tiny_model_path: Path) -> None:
    script = (
        "import sys, trio, trio_mlx\n"
        "async def main():\n"
        f"    async with trio_mlx.open_engine({str(tiny_model_path)!r}) as engine:\n"
        "        await engine.complete('Hello', trio_mlx.SamplingParams(max_tokens=2))\n"
        "trio.run(main)\n"
        "print('mlx_vlm' in sys.modules)\n"
    )
    engine_root = Path(trio_mlx.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(engine_root), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
