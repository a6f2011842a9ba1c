"""Named LoRA and DoRA adapters, put on the base model for one request and taken off after.

The base model stays plain. A request naming an adapter runs alone (serial
lane): the adapter's layers go on for that request and come off after it, so
batch rows never see them. All calls run on the MLX thread.

Only what can be taken off again, and whose weights say everything the layers
hold, is accepted: every adapted layer needs both matrices from the adapter
(mlx-lm draws ``lora_a`` at random when it wraps a layer, so a missing one would
give another model at every use), of the layer's shapes, finite, under a finite
scale of at most :data:`MAX_SCALE`; anything else is
:class:`~trio_mlx.InvalidAdapter` at mount, naming what is wrong.

Only what can be taken off again is accepted. mlx-lm's ``linear_to_lora_layers``
wraps layers (LoRA or DoRA linear, switch-linear and embedding layers, or a
model's own ``to_lora``); mlx-lm's ``remove_lora_layers`` unwraps only
``LoRALinear``, so a DoRA adapter stayed on the model for good. Here taking off
is generic: every module the adapter replaced is put back, by identity, from a
record taken just before it went on. A full fine-tune (it rewrites the base
weights) or an unknown ``fine_tune_type`` is refused with the type named.

Checks: after each use, the model's modules are the base's own objects again;
after the mount check and after an unmount, a checksum of every base parameter
equals the one taken when the first adapter was mounted. A mismatch raises
:class:`BaseModelChanged` (the server answers 500 and logs it) instead of
serving a silently altered model.

An adapter's weights are read once, at mount, and kept in memory: a file that
changes or vanishes later does not matter.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from trio_mlx._adapters.multilora import DEFAULT_METHOD, AdapterLayers, AdapterStack
from trio_mlx._errors import (
    AdapterConflict,
    GenerationFailed,
    InvalidAdapter,
    InvalidRequest,
    NotFound,
)

__all__ = ["AdapterRegistry", "BaseModelChanged"]

#: ``fine_tune_type`` values whose layers this module can put on and take off.
REMOVABLE_TYPES = ("lora", "dora")
#: The leaves an adapter's weights may set (mlx-lm's LoRA and DoRA parameters).
_ADAPTER_LEAVES = frozenset({"lora_a", "lora_b", "m"})
#: The leaves every adapted layer must have from the adapter: mlx-lm draws ``lora_a``
#: at random when it wraps a layer (DoRA's ``m`` is computed from the base weight).
_REQUIRED_LEAVES = ("lora_a", "lora_b")
#: The largest LoRA scale accepted (trained adapters use 1 to a few tens).
MAX_SCALE = 1e3


class BaseModelChanged(GenerationFailed):
    """Taking an adapter off did not give the base model back (500)."""

    default_code = "base_model_changed"


@attrs.frozen
class _Adapter:
    """A mounted adapter: its config and its weights, held in memory."""

    path: Path
    fine_tune_type: str
    num_layers: int
    lora_parameters: Mapping[str, Any]
    weights: tuple[tuple[str, Any], ...]
    #: Unique to this mount (the prompt cache keys rows computed under it by it).
    mount: int = 0
    #: Its layers as the batch lane stacks them (None: it runs in the serial lane).
    batch: AdapterLayers | None = None
    #: Why it cannot join the batch (None when it can).
    serial_reason: str | None = None


def _read_config(folder: Path) -> dict[str, Any]:
    for required in ("adapter_config.json", "adapters.safetensors"):
        if not (folder / required).is_file():
            raise InvalidRequest(f"{folder} is not an adapter directory (no {required})")
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read {folder}/adapter_config.json: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"{folder}/adapter_config.json is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in REMOVABLE_TYPES:
        raise InvalidRequest(
            f"{folder} is a {kind!r} adapter; only {' and '.join(REMOVABLE_TYPES)} adapters "
            "can be mounted (they can be taken off the base model again)",
            param="path",
            code="adapter_type_unsupported",
        )
    return config


def checksum(model: Any) -> tuple[float, float]:
    """Sum and absolute sum of every parameter of ``model`` (float32), in one evaluation."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    flat: list[Any] = tree_flatten(model.parameters())  # type: ignore[assignment]
    values = [pair[1] for pair in flat]
    total: Any = mx.array(0.0)
    absolute: Any = mx.array(0.0)
    for value in values:
        as_float = value.astype(mx.float32)
        total = total + mx.sum(as_float)
        absolute = absolute + mx.sum(mx.abs(as_float))
    mx.eval(total, absolute)
    return float(total.item()), float(absolute.item())


@attrs.define(eq=False)
class AdapterRegistry:
    """Mounted adapters by name. Mutated only by exclusive jobs on the MLX thread."""

    _adapters: dict[str, _Adapter] = attrs.field(init=False, factory=dict)
    #: Most adapters mounted at once (None: no bound); one more is refused (409).
    max_loras: int | None = None
    #: The base model's checksum, taken before the first adapter ever went on.
    _base: tuple[float, float] | None = attrs.field(init=False, default=None)
    _mounts: int = attrs.field(init=False, default=0)
    #: The batchable adapters, stacked for the batch lane (rebuilt at mount and unmount).
    stack: AdapterStack = attrs.field(init=False, factory=AdapterStack)
    #: How the stacked layers compute their rows' updates (``_multilora.METHODS``);
    #: the benchmark compares them, stacks built after a change use it.
    method: str = DEFAULT_METHOD

    @property
    def names(self) -> tuple[str, ...]:
        """Mounted adapter names, in mount order."""
        return tuple(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def serial_reason(self, name: str) -> str | None:
        """Why the mounted adapter ``name`` cannot batch (None: it can; NotFound if unmounted)."""
        if name not in self._adapters:
            raise NotFound(f"no adapter named {name!r} is mounted", param="adapter")
        return self._adapters[name].serial_reason

    def check_room(self) -> None:
        """Refuse (409) a mount beyond ``max_loras``."""
        if self.max_loras is not None and len(self._adapters) >= self.max_loras:
            raise AdapterConflict(
                f"{len(self._adapters)} adapters are mounted, the most this engine takes "
                f"(max_loras={self.max_loras}); unmount one first",
                param="name",
                code="too_many_adapters",
            )

    @staticmethod
    def check_path(path: str | os.PathLike[str]) -> Path:
        """A LoRA or DoRA adapter directory (``adapter_config.json`` and ``adapters.safetensors``)."""
        folder = Path(path)
        _read_config(folder)
        return folder

    def mount(self, model: Any, name: str, path: Path) -> None:
        """Read the adapter at ``path``, check it on ``model`` (on, then off), keep it as ``name``."""
        if name in self._adapters:
            raise InvalidRequest(f"an adapter named {name!r} is already mounted", param="name")
        self.check_room()
        if self._base is None:
            self._base = checksum(model)
        adapter = self._load(path)
        base = dict(model.named_modules())
        try:
            with self._applied(model, adapter):
                batch, reason = _batch_layers(model, base, adapter)
        except (InvalidRequest, BaseModelChanged):
            raise
        except Exception as exc:
            raise InvalidRequest(f"cannot load adapter {name!r} from {path}: {exc}") from exc
        finally:
            self._verify(model, f"after the mount check of {name!r}")
        self._mounts += 1
        self._adapters[name] = attrs.evolve(
            adapter, mount=self._mounts, batch=batch, serial_reason=reason
        )
        self._restack(model)

    def _restack(self, model: Any) -> None:
        self.stack = AdapterStack.build(
            model,
            [(n, a.mount, a.batch) for n, a in self._adapters.items() if a.batch is not None],
            self.method,
        )

    def unmount(self, model: Any, name: str) -> None:
        """Forget the adapter ``name``, after checking that the base model is the base."""
        if name not in self._adapters:
            raise NotFound(f"no adapter named {name!r} is mounted", param="adapter")
        del self._adapters[name]
        self._restack(model)
        self._verify(model, f"at the unmount of {name!r}")

    @contextmanager
    def use(self, model: Any, name: str) -> Iterator[None]:
        """Put the adapter ``name`` on ``model`` for the duration of the block."""
        if name not in self._adapters:
            raise NotFound(f"no adapter named {name!r} is mounted", param="adapter")
        with self._applied(model, self._adapters[name]):
            yield

    def _verify(self, model: Any, when: str) -> None:
        if self._base is not None and checksum(model) != self._base:
            raise BaseModelChanged(f"the base model's parameters changed {when}")

    @staticmethod
    def _load(path: Path) -> _Adapter:
        import mlx.core as mx

        config = _read_config(path)
        try:
            weights: dict[str, Any] = dict(mx.load(str(path / "adapters.safetensors")))  # type: ignore[arg-type]
            mx.eval(list(weights.values()))  # in memory now, not read from disk later
            num_layers = int(config["num_layers"])
            lora_parameters = dict(config["lora_parameters"])
        except Exception as exc:
            raise InvalidRequest(f"cannot read the adapter at {path}: {exc}") from None
        bad = [key for key in weights if key.rsplit(".", 1)[-1] not in _ADAPTER_LEAVES]
        if bad:
            raise InvalidRequest(
                f"the adapter at {path} sets {bad[0]!r}, not an adapter parameter", param="path"
            )
        _check_scale(path, lora_parameters)
        _check_finite(path, weights)
        return _Adapter(
            path,
            config.get("fine_tune_type", "lora"),
            num_layers,
            lora_parameters,
            tuple(weights.items()),
        )

    @staticmethod
    @contextmanager
    def _applied(model: Any, adapter: _Adapter) -> Iterator[None]:
        from mlx.utils import tree_flatten, tree_unflatten
        from mlx_lm.tuner.utils import linear_to_lora_layers

        base = dict(model.named_modules())
        try:
            linear_to_lora_layers(
                model,
                adapter.num_layers,
                dict(adapter.lora_parameters),
                use_dora=adapter.fine_tune_type == "dora",
            )
            shapes = dict(tree_flatten(model.parameters()))
            for key, value in adapter.weights:
                if key not in shapes or shapes[key].shape != value.shape:
                    raise InvalidAdapter(
                        f"the adapter at {adapter.path} does not fit this model ({key!r}"
                        + (
                            f": shape {tuple(value.shape)}, the layer's {tuple(shapes[key].shape)})"
                            if key in shapes
                            else ")"
                        ),
                        param="path",
                    )
            given = {key for key, _value in adapter.weights}
            missing = sorted(
                key
                for key in shapes
                if key.rsplit(".", 1)[-1] in _REQUIRED_LEAVES and key not in given
            )
            if missing:
                raise InvalidAdapter(
                    f"the adapter at {adapter.path} has no {missing[0]!r} ({len(missing)} "
                    "adapted matrices missing): every adapted layer needs both lora_a and lora_b",
                    param="path",
                )
            model.load_weights(list(adapter.weights), strict=False)
            yield
        finally:
            replaced = [
                (name, base[name])
                for name, module in model.named_modules()
                if name in base and module is not base[name]
            ]
            if replaced:
                model.update_modules(tree_unflatten(replaced))
            now = dict(model.named_modules())
            if now.keys() != base.keys() or any(now[k] is not base[k] for k in base):
                raise BaseModelChanged(
                    f"the adapter at {adapter.path} could not be taken off the base model"
                )


def _check_scale(path: Path, lora_parameters: Mapping[str, Any]) -> None:
    if "scale" not in lora_parameters:
        return  # mlx-lm refuses it, naming the key
    scale = lora_parameters["scale"]
    if (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not math.isfinite(scale)
        or abs(scale) > MAX_SCALE
    ):
        raise InvalidAdapter(
            f"the adapter at {path} has scale {scale!r}; it must be a finite number "
            f"within [-{MAX_SCALE:g}, {MAX_SCALE:g}]",
            param="path",
        )


def _check_finite(path: Path, weights: Mapping[str, Any]) -> None:
    import mlx.core as mx

    for key, value in weights.items():
        if not mx.issubdtype(value.dtype, mx.floating):
            raise InvalidAdapter(
                f"the adapter at {path} holds {key!r} as {value.dtype}, not floating point",
                param="path",
            )
        if not bool(mx.all(mx.isfinite(value)).item()):
            raise InvalidAdapter(
                f"the adapter at {path} holds NaN or infinite values in {key!r}", param="path"
            )


def _batch_layers(
    model: Any, base: Mapping[str, Any], adapter: _Adapter
) -> tuple[AdapterLayers | None, str | None]:
    """The adapter's (A, B, scale) per layer while it is on ``model``, or why it cannot batch.

    Batchable: every module it replaced is mlx-lm's plain ``LoRALinear`` around
    the base's own ``Linear`` or ``QuantizedLinear``.
    """
    import mlx.nn as nn
    from mlx_lm.tuner.lora import LoRALinear

    if adapter.fine_tune_type != "lora":
        return None, f"a {adapter.fine_tune_type} adapter"
    layers: dict[str, tuple[Any, Any, float]] = {}
    for name, module in model.named_modules():
        if name not in base or module is base[name]:
            continue
        if type(module) is not LoRALinear or module.linear is not base[name]:
            return None, f"an adapter with {type(module).__name__} layers"
        if not isinstance(base[name], nn.Linear | nn.QuantizedLinear):  # type: ignore[attr-defined]
            return None, f"an adapter on a {type(base[name]).__name__}"
        layers[name] = (module.lora_a, module.lora_b, float(module.scale))
    return AdapterLayers(layers), None
