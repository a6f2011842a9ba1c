"""Images in requests: the three APIs' image parts, bounded, fetched, and handed over.

The parsers (OpenAI chat ``image_url`` parts, Responses ``input_image`` parts,
Anthropic ``image`` blocks) turn each image into an :class:`ImageRef` in a content
part ``{"type": "image", "image": ref}``: a ``data:`` URL or base64 text, or an
``http(s)`` URL. :func:`resolve` then, before the engine sees the chat, enforces the
server's bounds (``--max-images``, ``--max-image-bytes``; URLs only with
``--allow-image-urls``, each fetched within ``--image-fetch-timeout`` seconds and the
byte bound) and puts a :class:`trio_mlx.ImageInput` in each part; the engine decodes
the image and bounds its pixels. Each error is a 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

import trio_mlx
from trio_mlx import InvalidRequest
from trio_mlx_http._common.fields import joined_text
from trio_mlx_http._settings import Settings

__all__ = [
    "ImageRef",
    "check_detail",
    "image_part",
    "image_url",
    "joined_content",
    "resolve",
    "resolve_prompts",
]


@attrs.frozen
class ImageRef:
    """An image as a request gave it: base64 ``data`` or a ``url``, and where it was."""

    where: str
    data: str | None = None
    url: str | None = None


def image_part(ref: ImageRef) -> dict[str, Any]:
    """The chat content part the engine's chat templates see for an image."""
    return {"type": "image", "image": ref}


def image_url(url: Any, where: str) -> ImageRef:
    """An image given as a URL: ``data:<type>;base64,<data>`` or ``http(s)://``."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where} must be a data: or http(s) URL string", param=where)
    if url.startswith("data:"):
        head, comma, data = url.partition(",")
        if not comma or not head.endswith(";base64"):
            raise InvalidRequest(
                f"{where} must be a base64 data: URL (data:image/png;base64,...)", param=where
            )
        return ImageRef(where, data=data)
    if url.startswith(("http://", "https://")):
        return ImageRef(where, url=url)
    raise InvalidRequest(
        f"{where} must be a data: or http(s) URL, not {url[:40]!r}",
        param=where,
        code="invalid_image",
    )


def check_detail(detail: Any, where: str) -> None:
    """An image's ``detail``: only "auto" (the model's processor sets the resolution)."""
    if detail not in (None, "auto"):
        raise InvalidRequest(
            f"{where} {detail!r:.20} is not supported: the model's processor sets an "
            "image's resolution; send 'auto' or leave it out",
            param=where,
            code="unsupported_parameter",
        )


def _refs(messages: Sequence[Mapping[str, Any]]) -> list[ImageRef]:
    refs = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("image"), ImageRef):
                    refs.append(part["image"])
    return refs


async def resolve_prompts(
    engine: trio_mlx.Engine, settings: Settings, prompts: Sequence[Any]
) -> tuple[Any, ...]:
    """``prompts`` with every chat's images resolved (see :func:`resolve`)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping):
            prompt = await resolve(engine, settings, prompt)
        out.append(prompt)
    return tuple(out)


async def resolve(
    engine: trio_mlx.Engine, settings: Settings, messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` with each :class:`ImageRef` replaced by the image's bytes, checked."""
    refs = _refs(messages)
    if not refs:
        return messages
    if not engine.takes_images:
        raise InvalidRequest(
            f"{refs[0].where}: the model {engine.model_id} does not take images",
            param=refs[0].where,
            code="images_unsupported",
        )
    if len(refs) > settings.max_images:
        raise InvalidRequest(
            f"the request has {len(refs)} images, more than the {settings.max_images} allowed",
            param=refs[settings.max_images].where,
            code="too_many_images",
        )
    found: dict[int, bytes] = {}
    for ref in refs:
        if ref.url is not None and not settings.allow_image_urls:
            raise InvalidRequest(
                f"{ref.where}: image URLs are not fetched by this server (start it with "
                "--allow-image-urls); send the image as a base64 data: URL",
                param=ref.where,
                code="image_urls_disabled",
            )
    for ref in refs:
        found[id(ref)] = _decoded(ref, settings) if ref.url is None else await _fetch(ref, settings)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                _input(p, found)
                if isinstance(p, Mapping) and isinstance(p.get("image"), ImageRef)
                else p
                for p in content
            ]
            message = {**message, "content": content}
        out.append(message)
    return out


def _input(part: Mapping[str, Any], found: Mapping[int, bytes]) -> dict[str, Any]:
    ref: ImageRef = part["image"]
    return {"type": "image", "image": trio_mlx.ImageInput(found[id(ref)], ref.where)}


def _too_big(ref: ImageRef, size: int | str, limit: int) -> InvalidRequest:
    return InvalidRequest(
        f"{ref.where}: the image has {size} bytes, more than the {limit} allowed",
        param=ref.where,
        code="image_too_large",
    )


def _decoded(ref: ImageRef, settings: Settings) -> bytes:
    data = ref.data or ""
    limit = settings.max_image_bytes
    if len(data) // 4 * 3 > limit + 2:
        raise _too_big(ref, f"about {len(data) // 4 * 3}", limit)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(
            f"{ref.where} is not valid base64", param=ref.where, code="invalid_image"
        ) from None
    if len(raw) > limit:
        raise _too_big(ref, len(raw), limit)
    if not raw:
        raise InvalidRequest(f"{ref.where} is empty", param=ref.where, code="invalid_image")
    return raw


async def _fetch(ref: ImageRef, settings: Settings) -> bytes:
    """GET the image, at most ``max_image_bytes`` within ``image_fetch_timeout`` seconds."""
    assert ref.url is not None
    url, limit, timeout = ref.url, settings.max_image_bytes, settings.image_fetch_timeout

    def get() -> bytes:
        request = urllib.request.Request(url, headers={"User-Agent": "trio-mlx"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data: bytes = response.read(limit + 1)
        return data

    try:
        with trio.fail_after(timeout):
            data = await trio.to_thread.run_sync(get, abandon_on_cancel=True)
    except trio.TooSlowError:
        raise InvalidRequest(
            f"{ref.where}: fetching the image took longer than {timeout:g} s",
            param=ref.where,
            code="image_fetch_failed",
        ) from None
    except Exception as exc:
        raise InvalidRequest(
            f"{ref.where}: cannot fetch the image ({type(exc).__name__}: {exc})"[:300],
            param=ref.where,
            code="image_fetch_failed",
        ) from None
    if len(data) > limit:
        raise _too_big(ref, f"more than {limit}", limit)
    return data


def joined_content(
    content: Any,
    where: str,
    part_text: Callable[[Any, str], str],
    part_image: Callable[[Any, str], ImageRef | None],
    parts: str,
) -> str | list[dict[str, Any]]:
    """:func:`joined_text`, but a part ``part_image`` reads as an image is kept: with
    one, the content is a list of text and image parts (adjacent text joined)."""
    if not isinstance(content, list):
        return joined_text(content, where, part_text, parts)
    out: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        ref = part_image(part, at)
        if ref is not None:
            out.append(image_part(ref))
            continue
        text = part_text(part, at)
        if out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + text}
        else:
            out.append({"type": "text", "text": text})
    if any(p["type"] == "image" for p in out):
        return out
    return "".join(p["text"] for p in out)
