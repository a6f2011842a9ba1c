"""Named LoRA adapters over mlx-lm's ``load_adapters`` / ``remove_lora_layers``.

The base model stays plain. A request naming an adapter runs alone (serial
lane): the adapter's layers go on for that request and come off after it, so
batch rows never see them. Mounting checks the adapter by applying and
removing it once. All calls run on the MLX thread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from trio_mlx._errors import InvalidRequest, NotFound

__all__ = ["AdapterRegistry"]


@attrs.define(eq=False)
class AdapterRegistry:
    """Mounted adapters by name. Mutated only by exclusive jobs on the MLX thread."""

    _paths: dict[str, Path] = attrs.field(init=False, factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """Mounted adapter names, in mount order."""
        return tuple(self._paths)

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    @staticmethod
    def check_path(path: str | os.PathLike[str]) -> Path:
        """An adapter directory holding ``adapter_config.json`` and ``adapters.safetensors``."""
        folder = Path(path)
        for required in ("adapter_config.json", "adapters.safetensors"):
            if not (folder / required).is_file():
                raise InvalidRequest(f"{folder} is not an adapter directory (no {required})")
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"cannot read {folder}/adapter_config.json: {exc}") from None
        if not isinstance(config, dict) or config.get("fine_tune_type", "lora") == "full":
            # Full fine-tunes overwrite the base weights; they cannot be taken off again.
            raise InvalidRequest(f"{folder} is not a LoRA or DoRA adapter")
        return folder

    def mount(self, model: Any, name: str, path: Path) -> None:
        """Check the adapter against ``model`` and keep it under ``name``."""
        if name in self._paths:
            raise InvalidRequest(f"an adapter named {name!r} is already mounted", param="name")
        try:
            with self._applied(model, path):
                pass
        except InvalidRequest:
            raise
        except Exception as exc:
            raise InvalidRequest(f"cannot load adapter {name!r} from {path}: {exc}") from exc
        self._paths[name] = path

    def unmount(self, name: str) -> None:
        """Forget the adapter ``name``."""
        if name not in self._paths:
            raise NotFound(f"no adapter named {name!r} is mounted", param="adapter")
        del self._paths[name]

    @contextmanager
    def use(self, model: Any, name: str) -> Iterator[None]:
        """Apply the adapter ``name`` to ``model`` for the duration of the block."""
        if name not in self._paths:
            raise NotFound(f"no adapter named {name!r} is mounted", param="adapter")
        with self._applied(model, self._paths[name]):
            yield

    @staticmethod
    @contextmanager
    def _applied(model: Any, path: Path) -> Iterator[None]:
        from mlx_lm.tuner.utils import load_adapters, remove_lora_layers

        try:
            load_adapters(model, str(path))
            yield
        finally:
            remove_lora_layers(model)
