"""A gemma3 vision-language model over HTTP with the official openai client: its image
rows batch (each image attended both ways in its prefill) and answer as the engine does."""

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

from http_helpers import NO_EOS, live_server
from vision_helpers import QUESTION, data_url, png


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trio_mlx.testing import make_random_vlm

    folder = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    return make_random_vlm(folder, family="gemma3", seed=1)  # its answers turn on the image


def _parts(image: dict[str, Any]) -> list[Any]:
    """The question, the image, a word (the tiny model answers by a late image)."""
    content = [{"type": "text", "text": QUESTION}, image, {"type": "text", "text": "Say?"}]
    return [{"role": "user", "content": content}]


async def test_gemma3_images_over_chat_completions_answer_as_the_engine(vlm_path: Path) -> None:
    params = trio_mlx.SamplingParams(max_tokens=12, logit_bias=NO_EOS)
    bias = {str(k): v for k, v in NO_EOS.items()}
    async with live_server(vlm_path) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = server.engine.model_id
        card = await client.models.retrieve(model)
        assert card.model_extra is not None
        assert card.model_extra["input_modalities"] == ["text", "image"]
        replies: dict[int, Any] = {}

        async def ask(i: int, seed: int) -> None:
            url = {"type": "image_url", "image_url": {"url": data_url(png(seed))}}
            replies[i] = await client.chat.completions.create(
                model=model, messages=_parts(url), max_tokens=12, logit_bias=bias
            )

        async with trio.open_nursery() as nursery:  # two image rows in one batch
            for i, seed in enumerate((1, 2)):
                nursery.start_soon(ask, i, seed)
        await ask(2, 1)
        engine = [
            await server.engine.complete(
                _parts({"type": "image", "image": trio_mlx.ImageInput(png(seed))}), params
            )
            for seed in (1, 2)
        ]
        await client.close()
    texts = [replies[i].choices[0].message.content for i in range(3)]
    assert texts[:2] == [c.text for c in engine]
    assert texts[0] != texts[1]
    assert texts[2] == texts[0]
    first, again = replies[0].usage, replies[2].usage
    assert first is not None
    assert again is not None
    assert again.prompt_tokens_details is not None
    assert again.prompt_tokens_details.cached_tokens == first.prompt_tokens - 1
