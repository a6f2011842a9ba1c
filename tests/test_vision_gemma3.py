"""gemma3 images in the batch: a tiny random gemma3 (mlx-vlm's own classes), whose
image tokens attend to each other both ways in the prefill, sliding-window layers
beside global ones.

The reference is mlx-vlm's model run over the whole sequence each token, with the
mask gemma3 was trained with (causal, windowed in a sliding layer, ORed with "same
image"), then greedy: the batch's image rows must give its tokens exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (the 'vision' extra; nox -s tests installs it)"
)

from engine_helpers import NO_EOS
from vision_helpers import QUESTION, drain, png

TOKENS = 16
PARAMS = trio_mlx.SamplingParams(max_tokens=TOKENS, logit_bias=NO_EOS)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trio_mlx.testing import make_random_vlm

    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    return make_random_vlm(folder, family="gemma3", seed=1)  # its answers turn on the image


def _chat(image: trio_mlx.ImageInput) -> list[dict[str, Any]]:
    """The question, the image, a word: the tiny model's answer turns on the image when
    it comes late in the prompt (its sliding layers see it from the last token)."""
    parts = [{"type": "text", "text": QUESTION}, {"type": "image", "image": image}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Say?"}]}]


def _lane(vlm_path: Path, budget: int | None) -> Any:
    from trio_mlx._start.vision import load
    from trio_mlx.testing import BatchLane

    model, tokenizer, _config, vision = load(str(vlm_path))
    return BatchLane(model, tokenizer, max_batch=8, prefill_budget=budget, vision=vision)


def _image_row(lane: Any, row_id: int, seed: int) -> Any:
    from trio_mlx._core.images import decode, split_images
    from trio_mlx.testing import RowSpec

    messages, found = split_images(_chat(trio_mlx.ImageInput(png(seed))))
    decoded = [decode(name, image, 1 << 20) for name, image in found]
    images, digests = [d.image for d in decoded], [d.digest for d in decoded]
    tokens, prompt, _ = lane.vision.encode(lane.tokenizer, messages, images, digests, None, None)
    return RowSpec(row_id, tuple(tokens), PARAMS, images=prompt)


def _text_row(lane: Any, row_id: int) -> Any:
    from trio_mlx.testing import RowSpec

    prompt = tuple(lane.tokenizer.encode(f"Tell me about topic {row_id}."))
    return RowSpec(row_id, prompt, PARAMS)


def _reference(vision: Any, row: Any, *, bidirectional: bool = True) -> list[int]:
    """Greedy tokens of mlx-vlm's gemma3 over ``row``'s prompt, the whole sequence
    through its layers at each token (no cache), with gemma3's mask."""
    import mlx.core as mx
    import numpy as np

    model = vision.model
    text = model.language_model.model
    tokens = list(row.prompt)
    ids = mx.array([tokens])
    arrays = {k: mx.array(v) for k, v in row.images.arrays.items()}
    pixels = arrays.pop("pixel_values")
    embeds = model.get_input_embeddings(
        ids, pixels, mask=mx.ones(ids.shape, mx.int32), **arrays
    ).inputs_embeds
    image = np.array(tokens) == vision.image_token_id
    group = np.cumsum(np.r_[image[:1], image[1:] & ~image[:-1]]) * image  # 0: text
    bias = mx.array([NO_EOS.get(i, 0.0) for i in range(model.language_model.config.vocab_size)])
    out: list[int] = []
    for _ in range(TOKENS):
        n = embeds.shape[1]
        grid = np.r_[group, np.zeros(n - len(group), int)]
        q, k = np.arange(n)[:, None], np.arange(n)[None, :]
        same = (grid[:, None] == grid[None, :]) & (grid[:, None] > 0) & bidirectional
        full = mx.array((k <= q) | same)
        sliding = mx.array(((k <= q) & (k > q - text.window_size)) | same)
        h = embeds * mx.array(text.config.hidden_size**0.5, mx.bfloat16).astype(embeds.dtype)
        for i, layer in enumerate(text.layers):
            glob = i % text.sliding_window_pattern == text.sliding_window_pattern - 1
            h = layer(h, full if glob else sliding, None)
        logits = model.language_model.lm_head(text.norm(h))[0, -1] + bias
        token = int(mx.argmax(logits).item())
        out.append(token)
        embeds = mx.concatenate([embeds, text.embed_tokens(mx.array([[token]]))], axis=1)
    return out


def test_the_reference_without_the_image_mask_is_mlx_vlms_own_generation(vlm_path: Path) -> None:
    # mlx-vlm 0.7.10 generates gemma3 with a causal mask only: the reference's causal
    # variant gives its tokens, so the reference differs from it by the mask alone.
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    lane = _lane(vlm_path, None)
    row = _image_row(lane, 0, 1)
    ids = mx.array([list(row.prompt)])
    pixels = mx.array(row.images.arrays["pixel_values"])
    steps = generate_step(
        ids, lane.vision.model, pixels, mx.ones(ids.shape, mx.int32), max_tokens=TOKENS,
        temperature=0.0, logit_bias=NO_EOS,
    )  # fmt: skip
    tokens = [int(token) for token, _ in steps]
    assert tokens == _reference(lane.vision, row, bidirectional=False)
    assert tokens != _reference(lane.vision, row)


@pytest.mark.parametrize("budget", [None, 8], ids=["whole", "chunks-of-8"])
def test_an_image_row_greedy_equals_mlx_vlm_with_the_image_attended_both_ways(
    vlm_path: Path, budget: int | None
) -> None:
    from trio_mlx.testing import StepPlan

    lane = _lane(vlm_path, budget)
    image_tokens, window = 16, lane.vision.text_model.model.window_size
    rows = [_image_row(lane, i, seed) for i, seed in enumerate((1, 2, 1))]
    # The prompt passes the sliding window: the rotating caches drop keys in the prefill.
    assert len(rows[0].prompt) > 2 * window
    answers = []
    for row in rows:
        tokens, prefilled = drain(lane, {0: StepPlan([row])})
        answers.append(tokens[row.id])
        if budget:
            # Chunks of at most 8, but the image's 16 tokens in one chunk of their own.
            chunks = [n for n in prefilled[1:] if n]
            assert sum(chunks) == len(row.prompt) - 1
            assert image_tokens in chunks
            assert max(chunks) == image_tokens
            assert sorted(chunks)[-2] <= 8
    reference = _reference(lane.vision, rows[0])
    assert answers[0] == reference
    assert len(reference) == TOKENS
    # The image decides the answer; the same image answers the same.
    assert answers[1] == _reference(lane.vision, rows[1]) != answers[0]
    assert answers[2] == answers[0]
    # The test sees the mask: causal attention over the image answers otherwise.
    assert _reference(lane.vision, rows[0], bidirectional=False) != reference


def test_an_image_row_among_text_rows_leaves_their_tokens_alone(vlm_path: Path) -> None:
    from trio_mlx.testing import StepPlan

    lane = _lane(vlm_path, 8)
    texts = [_text_row(lane, i) for i in range(3)]
    image = _image_row(lane, 9, 4)
    alone = {t.id: drain(_lane(vlm_path, 8), {0: StepPlan([t])})[0][t.id] for t in texts}
    together, _ = drain(
        lane, {0: StepPlan(texts[:2]), 2: StepPlan([image]), 4: StepPlan(texts[2:])}
    )
    assert {t.id: together[t.id] for t in texts} == alone
    assert together[9] == _reference(lane.vision, image)


async def test_the_engine_serves_gemma3_images_and_caches_them(vlm_path: Path) -> None:
    async with trio_mlx.open_engine(vlm_path, max_batch=4) as engine:
        assert engine.takes_images
        first = await engine.complete(_chat(trio_mlx.ImageInput(png(5))), PARAMS)
        again = await engine.complete(_chat(trio_mlx.ImageInput(png(5))), PARAMS)
        other = await engine.complete(_chat(trio_mlx.ImageInput(png(6))), PARAMS)
        together: dict[int, trio_mlx.Completion] = {}

        async def run(i: int, seed: int) -> None:
            chat = _chat(trio_mlx.ImageInput(png(seed)))
            together[i] = await engine.complete(chat, PARAMS)

        async with trio.open_nursery() as nursery:
            for i, seed in enumerate((5, 6)):
                nursery.start_soon(run, i, seed)
    assert first.result.cached_tokens == 0
    # The rotating caches' prefix is served whole: all but the prompt's last token.
    assert again.result.cached_tokens == first.result.prompt_tokens - 1
    assert again.token_ids == first.token_ids
    assert other.token_ids != first.token_ids
    assert [together[0].token_ids, together[1].token_ids] == [first.token_ids, other.token_ids]
    assert first.result.lane == "batch"
    # Alone (a seed: the serial lane), the image attended both ways answers alike.
    seeded = trio_mlx.SamplingParams(
        max_tokens=PARAMS.max_tokens, logit_bias=PARAMS.logit_bias, seed=1
    )
    async with trio_mlx.open_engine(vlm_path, prompt_cache_bytes=0) as engine:
        alone = await engine.complete(_chat(trio_mlx.ImageInput(png(6))), seeded)
    assert alone.result.lane == "serial"
    assert alone.token_ids == other.token_ids


def test_a_gemma3_whose_image_passes_its_sliding_window_is_refused(tmp_path: Path) -> None:
    from trio_mlx._start.vision import load
    from trio_mlx.testing import make_random_vlm

    folder = tmp_path / "narrow"
    make_random_vlm(folder, family="gemma3")
    import json

    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["sliding_window"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(trio_mlx.InvalidRequest, match="16 tokens is longer than its sliding"):
        load(str(folder))


@pytest.mark.parametrize("budget", [None, 8], ids=["whole", "chunks-of-8"])
async def test_a_screenshot_history_reuses_the_rotating_caches_of_earlier_turns(
    vlm_path: Path, budget: int | None
) -> None:
    params = trio_mlx.SamplingParams(max_tokens=6, logit_bias=NO_EOS)
    first = _chat(trio_mlx.ImageInput(png(7)))

    async def turns(engine: trio_mlx.Engine) -> list[trio_mlx.Completion]:
        one = await engine.complete(first, params)
        second = [*first, {"role": "assistant", "content": one.text}]
        second += _chat(trio_mlx.ImageInput(png(8)))
        return [one, await engine.complete(second, params)]

    async with trio_mlx.open_engine(vlm_path, prefill_budget=budget) as engine:
        cached = await turns(engine)
    async with trio_mlx.open_engine(vlm_path, prompt_cache_bytes=0) as engine:
        fresh = await turns(engine)
    assert [c.token_ids for c in cached] == [c.token_ids for c in fresh]
    one, two = (c.result for c in cached)
    # Turn 2 takes turn 1's prompt (its image included) and prefills its new image.
    assert one.cached_tokens == 0
    assert one.prompt_tokens - 1 <= two.cached_tokens < two.prompt_tokens - 16
