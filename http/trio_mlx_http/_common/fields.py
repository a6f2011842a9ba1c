"""Request fields checked the same way on every API: typed reads, refusals, text content.

Every parser reads a field with :func:`get_field` (absent and ``null`` alike
are None; a value of another type is 400 naming the field). The Responses and
Messages parsers refuse a body's fields with :func:`check_fields` from three
tables of their own: honoured, ignored (cannot change the output) and refused
unless at the default (a predicate per field, :func:`never` for none); anything
else is an unknown field, refused too. Both take content as a string or a list
of parts (:func:`joined_text`), each saying which parts are text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trio_mlx import InvalidRequest

__all__ = ["check_fields", "get_field", "joined_text", "never", "unsupported"]


def get_field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``body[name]`` if present and not null, checked against ``kind``; else None."""
    value = body.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise InvalidRequest(f"{name} must be {what}, not {value!r:.80}", param=name)
    return value


def never(_value: Any) -> bool:
    """A refused field's default test when no value but null is its default."""
    return False


def unsupported(name: str, detail: str = "") -> InvalidRequest:
    """The 400 of a known field (or key) this server does not support."""
    more = f" ({detail})" if detail else ""
    return InvalidRequest(
        f"{name} is not supported by this server{more}; leave it out",
        param=name,
        code="unsupported_parameter",
    )


def check_fields(
    body: Mapping[str, Any],
    honoured: frozenset[str],
    ignored: frozenset[str],
    refused: Mapping[str, Callable[[Any], bool]],
) -> None:
    """Refuse every field that is neither honoured nor harmless (``null`` is absent)."""
    for name, value in body.items():
        if value is None or name in honoured or name in ignored:
            continue
        is_default = refused.get(name)
        if is_default is None:
            raise InvalidRequest(
                f"unknown field {name!r:.80}: the server does not support it "
                "(it is not ignored, since it might change the output)",
                param=str(name)[:80],
                code="unsupported_parameter",
            )
        if not is_default(value):
            raise unsupported(name)


def joined_text(content: Any, where: str, part_text: Callable[[Any, str], str], parts: str) -> str:
    """``content`` as a string, or its ``parts`` (each read by ``part_text``) joined,
    naming the first part that is not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part_text(part, f"{where}[{i}]") for i, part in enumerate(content))
    raise InvalidRequest(f"{where} must be a string or a list of {parts}", param=where)
