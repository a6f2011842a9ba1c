"""Images in chat messages: the public :class:`ImageInput`, decoding, and the content hash.

A chat message's content may be a list of parts; a part ``{"type": "image", "image":
ImageInput(...)}`` is an image. :func:`split_images` takes the images out of a chat
(the template sees ``{"type": "image"}`` where each was) and :func:`decode` turns each
into RGB pixels and a hash of those decoded pixels, the key the prompt cache stores an
image prompt under: the same screenshot sent again hits, whatever its encoding.
Decoding runs in a thread (PIL), bounded in pixels before the pixels are read.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from trio_mlx._core.prompts import PreparedPrompt, PromptEncoder, opens_reasoning
from trio_mlx._errors import InvalidRequest
from trio_mlx._start.vision import Vision, VisionPrompt

__all__ = [
    "DecodedImage",
    "ImageInput",
    "decode",
    "has_images",
    "prepare",
    "refuse_images",
    "split_images",
]


def _data(value: Any) -> Any:
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return value


@attrs.frozen(eq=False)
class ImageInput:
    """An image for a vision model: encoded bytes (PNG, JPEG, WebP, GIF, ...) or an
    RGB(A) pixel array (height x width x 3 or 4, uint8, e.g. a numpy array).

    Put it in a chat message as a content part: ``{"type": "image", "image":
    ImageInput(png_bytes)}``. ``name`` is what an error about it says (default:
    ``image <n>``, counting from 0 over the whole chat).
    """

    data: Any = attrs.field(converter=_data)
    name: str | None = None


@attrs.frozen(eq=False)
class DecodedImage:
    """An image decoded: PIL's RGB image and the SHA-256 of its pixels (with their size)."""

    image: Any
    digest: str


def has_images(prompt: Any) -> bool:
    """Whether ``prompt`` is a chat with an image part in some message's content."""
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
        return False
    for message in prompt:
        if not isinstance(message, Mapping):
            return False
        content = message.get("content")
        if isinstance(content, list | tuple) and any(
            isinstance(p, Mapping) and p.get("type") == "image" for p in content
        ):
            return True
    return False


def split_images(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[tuple[str, ImageInput]]]:
    """A chat's messages with each image part reduced to ``{"type": "image"}``, and its
    images in order with their names; a chat without images comes back unchanged."""
    images: list[tuple[str, ImageInput]] = []
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list | tuple) or not any(
            isinstance(p, Mapping) and p.get("type") == "image" for p in content
        ):
            out.append(dict(message))
            continue
        parts: list[Any] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "image":
                image = part.get("image")
                n = len(images)
                if not isinstance(image, ImageInput):
                    raise InvalidRequest(
                        f"image {n}: an image part needs an ImageInput as 'image'",
                        param="messages",
                    )
                images.append((image.name or f"image {n}", image))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def decode(name: str, image: ImageInput, max_pixels: int) -> DecodedImage:
    """Decode ``image`` to RGB (any thread); InvalidRequest naming it if it is not an
    image PIL reads, or has more than ``max_pixels`` pixels (checked before decoding)."""
    from PIL import Image

    data = image.data
    try:
        if isinstance(data, bytes):
            if not data:
                raise InvalidRequest(f"{name} is empty", param="messages", code="invalid_image")
            with Image.open(io.BytesIO(data)) as opened:
                _check_size(name, opened.size, max_pixels)
                opened.load()
                rgb = opened.convert("RGB")
        else:
            import numpy as np

            array = np.asarray(data)
            if array.ndim != 3 or array.shape[2] not in (3, 4) or array.dtype != np.uint8:
                raise InvalidRequest(
                    f"{name}: pixels must be a height x width x 3 (or 4) uint8 array, "
                    f"not {array.dtype} {array.shape}",
                    param="messages",
                    code="invalid_image",
                )
            _check_size(name, (array.shape[1], array.shape[0]), max_pixels)
            rgb = Image.fromarray(np.ascontiguousarray(array)).convert("RGB")
    except InvalidRequest:
        raise
    except Exception as exc:
        raise InvalidRequest(
            f"{name} is not an image that can be decoded ({type(exc).__name__}: {exc})",
            param="messages",
            code="invalid_image",
        ) from None
    digest = hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}:".encode())
    digest.update(rgb.tobytes())
    return DecodedImage(rgb, digest.hexdigest())


def _check_size(name: str, size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise InvalidRequest(f"{name} has no pixels", param="messages", code="invalid_image")
    if width * height > max_pixels:
        raise InvalidRequest(
            f"{name} is {width} x {height} pixels, more than the {max_pixels} allowed",
            param="messages",
            code="image_too_large",
        )


async def prepare(
    vision: Vision | None,
    prompts: PromptEncoder,
    model_id: str,
    max_pixels: int,
    request: tuple[Any, ...],
) -> PreparedPrompt:
    """A chat with images as a prompt: each image decoded and hashed, the chat rendered
    and its image tokens expanded by the model's processor, in a thread. ``request`` is
    (the chat, its tools, its template arguments, the reasoning markers)."""
    prompt, tools, template_kwargs, *rest = request
    markers = rest[0] if rest else None
    messages, found = split_images(prompt)
    if vision is None:
        raise InvalidRequest(
            f"the model {model_id} does not take images",
            param="messages",
            code="images_unsupported",
        )
    prompts.refuse_oversized(messages, tools=tools)

    def work() -> tuple[list[int], VisionPrompt, str]:
        decoded = [decode(name, image, max_pixels) for name, image in found]
        images, digests = [d.image for d in decoded], [d.digest for d in decoded]
        return vision.encode(prompts.tokenizer, messages, images, digests, tools, template_kwargs)

    tokens, images, text = await trio.to_thread.run_sync(work)
    prompts.check_length(tokens)
    # (attrs' tuple converter reads to mypy as an unsolved Iterable[_T_co])
    ids: Any = tuple(tokens)
    return PreparedPrompt(ids, opens_reasoning(text, markers), None, images)


def refuse_images(prompt: Any, why: str) -> None:
    """InvalidRequest if ``prompt`` is a chat with images: they must be ``why``."""
    if has_images(prompt):
        raise InvalidRequest(
            f"a chat with images must be {why}", param="messages", code="images_unsupported"
        )
