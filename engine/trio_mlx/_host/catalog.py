"""What a :class:`~trio_mlx.ModelHost` can load: models by name, with their weights' size.

A model is named as an engine names it (its folder's name; the bundled model's is
``pydoc-llama``). ``--model-dir`` lists every subfolder holding a ``config.json``. The
weights' bytes on disk are what the host counts against ``max_model_memory`` before a
model loads (a Hub id not yet downloaded counts 0 until it has loaded once).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from trio_mlx._errors import InvalidRequest, NotFound
from trio_mlx._start.loading import resolve_model

__all__ = ["ModelEntry", "catalog"]


@attrs.frozen
class ModelEntry:
    """A model the host may load."""

    #: The name requests use (the folder's name).
    name: str
    #: The folder (or Hugging Face id) the engine loads.
    path: str
    #: Bytes of its weight files (``*.safetensors``) on disk; 0 when not known.
    weight_bytes: int


def weight_files_bytes(path: str) -> int:
    """Bytes of the ``*.safetensors`` files in the folder ``path`` (0: none, or no folder)."""
    folder = Path(path)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file())


def catalog(
    models: Sequence[str | os.PathLike[str] | None], model_dir: str | os.PathLike[str] | None
) -> dict[str, ModelEntry]:
    """The models ``models`` (``None``: the bundled one) and ``model_dir``'s subfolders
    name, in that order, by name. A name given twice, a missing folder or an empty
    listing raises :class:`~trio_mlx.InvalidRequest` (or :class:`~trio_mlx.NotFound`)."""
    paths = [resolve_model(model) for model in models]
    if model_dir is not None:
        folder = Path(model_dir)
        if not folder.is_dir():
            raise NotFound(f"model_dir {os.fspath(model_dir)!r} is not a folder", param="model_dir")
        found = sorted(p for p in folder.iterdir() if (p / "config.json").is_file())
        if not found:
            raise InvalidRequest(
                f"model_dir {os.fspath(model_dir)!r} has no model folders (none with a config.json)",
                param="model_dir",
            )
        paths += [str(p) for p in found]
    if not paths:
        raise InvalidRequest("a model host needs at least one model", param="models")
    entries: dict[str, ModelEntry] = {}
    for path in paths:
        name = Path(path).name
        if name in entries:
            raise InvalidRequest(
                f"two models are named {name!r} ({entries[name].path} and {path}); "
                "give each folder its own name",
                param="models",
            )
        entries[name] = ModelEntry(name, path, weight_files_bytes(path))
    return entries
