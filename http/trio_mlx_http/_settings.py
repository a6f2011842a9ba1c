"""The server's settings: one frozen value built by the CLI (or a test)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

__all__ = ["Settings"]


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, not {value!r}")


def _key(_instance: object, _attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and not value.strip():
        raise ValueError("api_key must not be empty (None serves without authentication)")


def _positive_or_none(_instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{attribute.name} must be > 0 or None, not {value!r}")


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _to_dir(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen(kw_only=True)
class Settings:
    """How the HTTP layer behaves; the engine's own knobs live on the engine."""

    #: The model id clients see and send; None means the engine's ``model_id``.
    model_name: str | None = None
    #: Bearer token every endpoint but ``/health`` requires; None disables auth.
    api_key: str | None = attrs.field(default=None, repr=False, validator=_key)
    #: ``POST /v1/adapters`` mounts only adapters inside this folder; None disables it.
    adapter_dir: Path | None = attrs.field(default=None, converter=_to_dir)
    #: Request bodies above this many bytes get a 413 before they are read whole.
    max_body_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive)
    #: The ``Access-Control-Allow-Origin`` value to send; None sends no CORS headers.
    cors_origin: str | None = None
    #: Defaults for requests that leave these out (mlx_lm.server's defaults).
    max_tokens: int = attrs.field(default=512, validator=_positive)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    #: Default KV-cache quantization for requests that leave ``kv_bits`` out (serial lane).
    kv_bits: int | None = None
    kv_group_size: int = 64
    #: Default chat template arguments (``--chat-template-args``); a request's own win.
    chat_template_args: dict[str, Any] = attrs.field(factory=dict)
    #: Other names the served model answers to as ``model`` (not listed in ``/v1/models``).
    model_aliases: tuple[str, ...] = attrs.field(default=(), converter=_names)
    #: ``--served-model-name``: each listed in ``/v1/models``; one holding ``*``, ``?`` or
    #: ``[`` is a shell-style pattern (``claude-*``) that every matching name answers to.
    served_model_names: tuple[str, ...] = attrs.field(default=(), converter=_names)
    #: The reasoning markers: None takes the tokenizer's (``think_start``/``think_end``),
    #: False keeps reasoning in the content, a pair names them.
    reasoning_markers: tuple[str, str] | bool | None = None
    #: Seconds a stream may stay silent (queued, or in a long prefill) before it
    #: sends a keep-alive; None sends none.
    sse_keepalive: float | None = attrs.field(default=15.0, validator=_positive_or_none)
    #: Images in requests (a vision model's): ``http(s)`` image URLs are fetched only
    #: when allowed; the most images a request holds, each at most so many bytes; the
    #: seconds one URL may take to fetch.
    allow_image_urls: bool = False
    max_images: int = attrs.field(default=8, validator=_positive)
    max_image_bytes: int = attrs.field(default=20 * 1024 * 1024, validator=_positive)
    image_fetch_timeout: float = attrs.field(default=10.0, validator=_positive_or_none)
    #: The most choices (``n``) and prompts one request may ask for.
    max_choices: int = attrs.field(default=16, validator=_positive)
