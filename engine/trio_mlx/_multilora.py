"""Several LoRA adapters in one batch: stacked weights and a per-row adapter index.

Every mounted plain LoRA adapter (mlx-lm's ``LoRALinear`` on linear layers,
what ``load_adapters`` makes of a ``fine_tune_type: lora`` adapter) is kept as
its per-layer ``lora_a``, ``lora_b`` and ``scale``. :class:`AdapterStack`
stacks them per adapted layer: slot 0 is the base (zeros), slot ``i`` the
``i``-th mounted adapter, A and B zero-padded to the largest rank. A layer no
adapter of the stack touches is not wrapped.

While the batch lane runs a forward call with at least one adapted row, each
adapted layer is replaced by a :class:`MultiLoRALinear` that computes
``base(x) + scale[i] * (x @ A[i]) @ B[i]`` for every row ``i`` at once with
``mx.gather_mm`` (no Python loop over rows); the row indices come from
:class:`RowIndex`, set by the lane right before each forward call. A forward
call whose rows are all base sets no index and the layer is the base layer plus
one attribute read. Outside those calls the model carries its base modules
only (the serial lane and the base checksum see the plain model).

All calls run on the MLX thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

__all__ = ["AdapterLayers", "AdapterStack", "RowIndex", "multi_lora_linear"]


@attrs.frozen
class AdapterLayers:
    """One plain LoRA adapter, as the batch lane uses it: per layer name, (A, B, scale)."""

    layers: Mapping[str, tuple[Any, Any, float]]


@attrs.define(eq=False)
class RowIndex:
    """The adapter slot of every row of the forward call being built (None: all base)."""

    ids: Any = None


def _multi_lora_class() -> type[Any]:
    import mlx.core as mx
    import mlx.nn as nn

    class _MultiLoRALinear(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self, base: Any, a: Any, b: Any, scales: Any, index: RowIndex) -> None:
            super().__init__()
            self.base = base
            self.stack_a = a
            self.stack_b = b
            self.scales = scales
            self._index = index

        def __call__(self, x: Any) -> Any:
            y = self.base(x)
            ids = self._index.ids
            if ids is None:
                return y
            z = mx.gather_mm(
                mx.gather_mm(x, self.stack_a, rhs_indices=ids), self.stack_b, rhs_indices=ids
            )
            scale = self.scales[ids].astype(z.dtype).reshape(-1, *([1] * (z.ndim - 1)))
            return y + (scale * z).astype(x.dtype)

    return _MultiLoRALinear


_CLASS: type[Any] | None = None


def _parent(model: Any, name: str) -> tuple[Any, Any]:
    """The module (or list) holding the layer at the dotted ``name``, and its key there."""
    *path, last = name.split(".")
    node = model
    for part in path:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, int(last) if isinstance(node, list) else last


def multi_lora_linear(base: Any, a: Any, b: Any, scales: Any, index: RowIndex) -> Any:
    """A linear layer plus every stacked adapter's low-rank update, chosen per row."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _multi_lora_class()
    return _CLASS(base, a, b, scales, index)


@attrs.define(eq=False)
class AdapterStack:
    """The mounted plain LoRA adapters, stacked per layer; rebuilt at each mount and unmount."""

    #: Adapter name -> slot (1-based; 0 is the base).
    slots: dict[str, int] = attrs.field(factory=dict)
    #: Adapter name -> a number unique to this mount (prompt cache keys use it).
    mounts: dict[str, int] = attrs.field(factory=dict)
    #: Layer name -> its MultiLoRALinear (holding the base module).
    modules: dict[str, Any] = attrs.field(factory=dict)
    index: RowIndex = attrs.field(factory=RowIndex)
    #: (parent module or list, key, stacked layer, base layer) for each adapted layer.
    _sites: list[tuple[Any, Any, Any, Any]] = attrs.field(factory=list)

    @classmethod
    def build(cls, model: Any, adapters: Sequence[tuple[str, int, AdapterLayers]]) -> AdapterStack:
        """Stack ``adapters`` (name, mount number, layers) for ``model`` (its base modules)."""
        import mlx.core as mx

        stack = cls()
        stack.slots = {name: slot for slot, (name, _, _) in enumerate(adapters, start=1)}
        stack.mounts = {name: mount for name, mount, _ in adapters}
        if not adapters:
            return stack
        base = dict(model.named_modules())
        names = sorted({layer for _, _, a in adapters for layer in a.layers})
        for layer in names:
            entries = [a.layers.get(layer) for _, _, a in adapters]
            present = [e for e in entries if e is not None]
            rank = max(e[0].shape[1] for e in present)
            in_dims, out_dims = present[0][0].shape[0], present[0][1].shape[1]
            dtype = present[0][0].dtype
            a_rows = [mx.zeros((1, in_dims, rank), dtype=dtype)]
            b_rows = [mx.zeros((1, rank, out_dims), dtype=dtype)]
            scales = [0.0]
            for entry in entries:
                if entry is None:
                    a_rows.append(mx.zeros((1, in_dims, rank), dtype=dtype))
                    b_rows.append(mx.zeros((1, rank, out_dims), dtype=dtype))
                    scales.append(0.0)
                    continue
                a, b, scale = entry
                pad = rank - a.shape[1]
                a_rows.append(mx.pad(a, [(0, 0), (0, pad)])[None])
                b_rows.append(mx.pad(b, [(0, pad), (0, 0)])[None])
                scales.append(float(scale))
            stack.modules[layer] = multi_lora_linear(
                base[layer],
                mx.concatenate(a_rows),
                mx.concatenate(b_rows),
                mx.array(scales, dtype=mx.float32),
                stack.index,
            )
        mx.eval([(m.stack_a, m.stack_b, m.scales) for m in stack.modules.values()])
        for layer, module in stack.modules.items():
            parent, key = _parent(model, layer)
            stack._sites.append((parent, key, module, base[layer]))
        return stack

    @contextmanager
    def on(self, model: Any) -> Iterator[None]:
        """The stacked layers on ``model`` for the block; its base modules back after.

        A swap is one item assignment per adapted layer in its parent (what
        ``update_modules`` ends up doing, without walking the whole model), so
        it can happen around every decode step.
        """
        for parent, key, module, _base in self._sites:
            parent[key] = module
        try:
            yield
        finally:
            self.index.ids = None
            for parent, key, _module, base in self._sites:
                parent[key] = base

    def set_rows(self, slots: Sequence[int]) -> None:
        """The adapter slot of each row of the next forward call, in the call's row order."""
        import mlx.core as mx

        self.index.ids = mx.array(list(slots), dtype=mx.uint32) if any(slots) else None
