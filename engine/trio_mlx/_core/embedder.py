"""Embeddings' parts outside the MLX thread: the pooling a model asks for, the inputs'
checks, normalizing, truncation, a request's progress.

How a model pools: the ``embedding_pooling`` setting when given, else what a
sentence-transformers folder says (``modules.json`` names its ``Pooling``
module, whose ``config.json`` sets ``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens`` or ``pooling_mode_cls_token``), else none: a chat
model is not an embedder until the operator says how to pool it. Every vector
is L2-normalized; ``dimensions`` keeps the first that many values (Matryoshka)
and normalizes again.

:class:`EmbedWork` is one request's progress through the steps that carry its
inputs (Trio thread only).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from trio_mlx._errors import InvalidRequest

__all__ = [
    "EmbedWork",
    "check_dimensions",
    "configured_pooling",
    "embed_tokens",
    "finish",
    "normalize",
]

_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def configured_pooling(folder: str | Path) -> str | None:
    """The pooling a sentence-transformers model folder configures (None: none it says)."""
    root = Path(folder)
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    for module in modules if isinstance(modules, list) else ():
        if not isinstance(module, dict) or not str(module.get("type", "")).endswith("Pooling"):
            continue
        try:
            config = json.loads((root / str(module.get("path", "")) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        for key, mode in _MODES.items():
            if isinstance(config, dict) and config.get(key) is True:
                return mode
    return None


def normalize(vector: Any) -> Any:
    """``vector`` scaled to unit L2 length (a zero vector stays zero)."""
    import numpy as np

    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def finish(vector: Any, dimensions: int | None) -> Any:
    """A pooled vector as served: truncated to ``dimensions`` (None: all), then normalized."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return normalize(vector)


def check_dimensions(dimensions: int | None, *, supported: bool, width: int | None) -> None:
    """Refuse a ``dimensions`` the model cannot truncate to."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise InvalidRequest("dimensions must be a positive integer", param="dimensions")
    if not supported:
        raise InvalidRequest(
            "this model does not support dimensions (Matryoshka truncation); the server "
            "enables it with embedding_matryoshka",
            param="dimensions",
            code="dimensions_unsupported",
        )
    if width is not None and dimensions > width:
        raise InvalidRequest(
            f"dimensions {dimensions} is more than the model's {width}", param="dimensions"
        )


async def embed_tokens(
    inputs: Any,
    limit: int,
    tokenize: Callable[[Any], Awaitable[list[int]]],
) -> list[list[int]]:
    """Each input's tokens through ``tokenize`` (the engine's prompt encoder); every
    refusal names ``input``: no inputs, more than ``limit``, a bad, empty or over-long one."""
    if isinstance(inputs, str | bytes) or not isinstance(inputs, Sequence) or not inputs:
        raise InvalidRequest("input must be a non-empty list of inputs", param="input")
    if len(inputs) > limit:
        raise InvalidRequest(
            f"{len(inputs)} inputs, more than the {limit} one request may have",
            param="input",
            code="too_many_inputs",
        )
    tokens = []
    for index, item in enumerate(inputs):
        if not isinstance(item, str) and not (
            isinstance(item, Sequence)
            and not isinstance(item, bytes)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        ):
            raise InvalidRequest(
                f"input {index} must be a string or a list of token ids", param="input"
            )
        try:
            tokens.append(await tokenize(item))
        except InvalidRequest as exc:
            message = exc.message.replace("the prompt", f"input {index}")
            raise InvalidRequest(message, param="input", code=exc.code) from None
    return tokens


@attrs.define(eq=False)
class EmbedWork:
    """One embedding request's inputs and the vectors that came back so far."""

    id: int
    inputs: tuple[tuple[int, ...], ...]
    #: The next input no step has carried yet.
    planned: int = 0
    vectors: list[Any] = attrs.field(init=False)
    received: int = 0

    def __attrs_post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)

    @property
    def unplanned(self) -> bool:
        """Whether some input has not been carried by a step yet."""
        return self.planned < len(self.inputs)

    @property
    def in_flight(self) -> bool:
        """Whether a step carries inputs whose vectors have not come back."""
        return self.received < self.planned

    @property
    def complete(self) -> bool:
        """Whether every input's vector came back."""
        return self.received == len(self.inputs)

    def receive(self, index: int, vector: Any) -> None:
        """An input's pooled vector came back."""
        if self.vectors[index] is None:
            self.received += 1
        self.vectors[index] = vector
