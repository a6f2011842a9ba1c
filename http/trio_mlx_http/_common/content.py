"""Message content as text: a string, or a list of text parts joined (images kept).

The Responses and Messages parsers both take content as a string or a list of
parts; each says which parts are text (its own shapes and error wording) and
this joins them, naming the first part that is not text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trio_mlx import InvalidRequest
from trio_mlx_http._common.images import ImageRef, image_part

__all__ = ["joined_content", "joined_text"]


def joined_text(content: Any, where: str, part_text: Callable[[Any, str], str], parts: str) -> str:
    """``content`` as a string, or its ``parts`` (each read by ``part_text``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part_text(part, f"{where}[{i}]") for i, part in enumerate(content))
    raise InvalidRequest(f"{where} must be a string or a list of {parts}", param=where)


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
