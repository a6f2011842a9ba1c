"""Message content as text: a string, or a list of text parts joined.

The Responses and Messages parsers both take content as a string or a list of
parts; each says which parts are text (its own shapes and error wording) and
this joins them, naming the first part that is not text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trio_mlx import InvalidRequest

__all__ = ["joined_text"]


def joined_text(content: Any, where: str, part_text: Callable[[Any, str], str], parts: str) -> str:
    """``content`` as a string, or its ``parts`` (each read by ``part_text``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part_text(part, f"{where}[{i}]") for i, part in enumerate(content))
    raise InvalidRequest(f"{where} must be a string or a list of {parts}", param=where)
