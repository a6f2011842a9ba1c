"""The server's settings: one frozen value built by the CLI (or a test)."""

from __future__ import annotations

from pathlib import Path

import attrs

__all__ = ["Settings"]


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, not {value!r}")


def _to_dir(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen(kw_only=True)
class Settings:
    """How the HTTP layer behaves; the engine's own knobs live on the engine."""

    #: The model id clients see and send; None means the engine's ``model_id``.
    model_name: str | None = None
    #: Bearer token every endpoint but ``/health`` requires; None disables auth.
    api_key: str | None = attrs.field(default=None, repr=False)
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
    #: The most choices (``n``) and prompts one request may ask for.
    max_choices: int = attrs.field(default=16, validator=_positive)
