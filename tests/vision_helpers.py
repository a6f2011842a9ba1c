"""Images and chats for the vision tests (the tiny VLM is ``trio_mlx.testing.make_random_vlm``)."""

from __future__ import annotations

import base64
import io
from typing import Any

#: The vision tests' question after each image.
#: Long enough that a prompt holding it passes the batch lane's shortest cached prefix
#: (64 tokens on a GPU, where a shorter one is prefilled rather than fetched).
QUESTION = (
    "What is in the picture? Describe the colours, the shapes and the light of the scene, "
    "then say what the picture shows in one short sentence, plainly, for a reader."
)


def png(seed: int, size: tuple[int, int] = (32, 32), *, flat: bool = False) -> bytes:
    """A seeded random RGB image (``flat``: one colour, a few bytes), PNG-encoded."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    if flat:
        pixels[:] = pixels[0, 0]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_chat(image: Any, text: str = QUESTION) -> list[dict[str, Any]]:
    """A one-message chat: ``image`` (an ``ImageInput``) then ``text``."""
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
        }
    ]


def drain(
    lane: Any, plans: dict[int, Any], limit: int = 300
) -> tuple[dict[int, list[int]], list[int]]:
    """Step ``lane`` (``plans[k]`` at step k) until no row is left: each row's tokens,
    and the prompt positions each decode step prefilled (its timings)."""
    from trio_mlx.testing import StepPlan

    tokens: dict[int, list[int]] = {}
    prefilled: list[int] = []
    for k in range(limit):
        if k > max(plans, default=0) and not lane.rows:
            return tokens, prefilled
        result = lane.step(plans.get(k, StepPlan()))
        prefilled.extend(n for n, _ in result.timings)
        for event in result.events:
            assert event.error is None
            tokens.setdefault(event.id, []).extend(event.token_ids)
    raise AssertionError(f"rows still in the lane after {limit} steps")
