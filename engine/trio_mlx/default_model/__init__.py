"""The default model bundled with trio-mlx, and its demo adapters.

``pydoc-llama`` is a ~3.5M-parameter mlx-lm ``llama`` trained by
``tools/train.py`` (in the repository) on ``pydoc_data.topics`` (the Python
documentation every CPython ships), so the server produces readable text on a
machine with no model downloads. ``adapters/shout`` is a LoRA adapter trained
by ``tools/train_adapter.py`` that makes it write in capitals.
``pydoc-llama-draft`` is its draft model for speculative decoding: one layer,
trained by ``tools/train.py --draft`` on the same text with the same tokenizer.
All are package data: ``pip install`` carries them. See
``design/default-model.md`` for how they were trained and how well they do.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ADAPTERS", "DRAFT", "default_adapter_path", "default_draft_path", "default_model_path"]

_HERE = Path(__file__).resolve().parent

#: Names of the adapters bundled for the default model.
ADAPTERS = ("shout",)
#: The bundled draft model's name: ``draft_model="pydoc-llama-draft"`` (or
#: ``--draft-model pydoc-llama-draft``) finds it where no such folder exists.
DRAFT = "pydoc-llama-draft"


def default_model_path() -> Path:
    """Return the directory of the bundled default model.

    ``mlx_lm.load(str(default_model_path()))`` loads it like any mlx-community
    model: ``config.json``, ``model.safetensors`` (float32) and a byte-level
    BPE ``tokenizer.json`` with a ChatML template; EOS ids are 0 and 2.
    """
    return _HERE / "pydoc-llama"


def default_draft_path() -> Path:
    """Return the directory of the bundled draft model (:data:`DRAFT`), which shares
    the default model's tokenizer files: ``EngineSettings(draft_model=...)``."""
    return _HERE / DRAFT


def default_adapter_path(name: str = "shout") -> Path:
    """Return the directory of the bundled adapter ``name`` for the default model.

    The directory is in mlx-lm's adapter format (``adapter_config.json`` and
    ``adapters.safetensors``), loadable with
    ``mlx_lm.load(path, adapter_path=...)`` or ``mlx_lm.tuner.utils.load_adapters``.

    Raises:
        ValueError: if ``name`` is not one of :data:`ADAPTERS`.
    """
    if name not in ADAPTERS:
        raise ValueError(f"no bundled adapter {name!r}; bundled: {', '.join(ADAPTERS)}")
    return _HERE / "adapters" / name
