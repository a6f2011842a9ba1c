"""Several LoRA adapters in one batch: stacked weights and a per-row adapter slot.

Every mounted plain LoRA adapter (mlx-lm's ``LoRALinear`` on linear layers,
what ``load_adapters`` makes of a ``fine_tune_type: lora`` adapter) is kept as
its per-layer ``lora_a``, ``lora_b`` and ``scale``. :class:`AdapterStack`
stacks them per adapted layer: slot 0 is the base, slot ``i`` the ``i``-th
mounted adapter. A layer no adapter of the stack touches is not wrapped.

While the batch lane runs a forward call with at least one adapted row, each
adapted layer is replaced by a multi-LoRA layer that adds
``(x @ A[i]) @ (scale[i] * B[i])`` to the base layer's output for every row
``i`` at once, with no Python loop over rows. The lane sets the rows' slots
right before each forward call (:meth:`AdapterStack.set_rows`); the stack turns
them into a :class:`RowPlan` once per distinct row set (the rows of a decode
batch change only when a row joins or leaves, so a plan serves many steps). How
the layer computes the update is the stack's ``method`` (:data:`METHODS`; the
per-step cost of each is measured by ``python -m bench.suite --only multilora``):

* ``gather`` (the default): ``mx.gather_mm`` per row over A and B zero-padded
  to the largest rank: two gathered matmuls and one add per layer, whatever the
  number of adapters; base rows use slot 0 (zeros).
* ``grouped``: the adapted rows, sorted by adapter once per plan; one pair of
  plain matmuls per adapter that has rows, over its rows only, with that
  adapter's own (unpadded) A and B; base rows cost nothing, but every adapter
  in the batch adds ops.
* ``sorted``: as ``gather`` over the adapted rows sorted by adapter, with
  ``sorted_indices=True``; base rows cost nothing.
* ``dense``: every adapter's A side by side (``in x n*r``) in one matmul, a 0/1
  mask keeps each row's own adapter's columns, one multiply-add with the B's
  stacked (``n*r x out``); every row pays for every mounted adapter.

Decode steps are small: on the measured CPU and model, the number of ops per
layer mattered more than the flops, which is why ``gather`` is the default.

On MLX's CUDA backend (0.32) ``mx.gather_mm`` faults on small shapes: a
misaligned address (a sticky error: the process's GPU context is lost) for
bfloat16 at ranks under 8 and float32 with 6 output columns, and an invalid
argument once captured in a CUDA graph (``examples/upstream/gather_mm_cuda.py``
reproduces it). There ``dense`` is the default and ``gather`` and ``sorted``
are built as ``dense`` (:func:`method_for_device`).

A forward call whose rows are all base sets no plan and the layer is the base
layer plus one attribute read. Outside those calls the model carries its base
modules only (the serial lane and the base checksum see the plain model).

All calls run on the MLX thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

__all__ = [
    "DEFAULT_METHOD",
    "METHODS",
    "AdapterLayers",
    "AdapterStack",
    "RowPlan",
    "method_for_device",
]

#: How a multi-LoRA layer computes its rows' updates (see the module's notes).
METHODS = ("grouped", "gather", "sorted", "dense")
DEFAULT_METHOD = "gather"
#: The methods that call ``mx.gather_mm``: not on CUDA (see the module's notes).
_GATHERING = ("gather", "sorted")


def method_for_device(method: str) -> str:
    """``method``, or ``dense`` where it would call MLX's CUDA ``gather_mm``."""
    import mlx.core as mx

    if method in _GATHERING and mx.default_device() != mx.cpu and mx.cuda.is_available():
        return "dense"
    return method


#: Row plans a stack keeps (a decode batch and a few prefill groups at a time).
_PLANS_KEPT = 8


@attrs.frozen
class AdapterLayers:
    """One plain LoRA adapter, as the batch lane uses it: per layer name, (A, B, scale)."""

    layers: Mapping[str, tuple[Any, Any, float]]


@attrs.frozen(eq=False)
class RowPlan:
    """How one forward call's rows map onto the stack's slots (built once per row set)."""

    #: The slot of every row, in the call's row order (0: base).
    slots: tuple[int, ...]
    #: ``slots`` as an array (``gather``, ``dense``).
    ids: Any
    #: The adapted rows' positions, sorted by slot (None: already in that order, no base row).
    order: Any
    #: The adapted rows' slots in sorted order (``sorted``).
    sorted_ids: Any
    #: (slot, start, stop) of each slot's run in the sorted adapted rows (``grouped``).
    groups: tuple[tuple[int, int, int], ...]
    #: Per row, its position in [sorted adapted rows, one zero row] (None: no base row
    #: and no reordering, the updates are already in row order).
    restore: Any
    #: Per mask width, the (rows, 1, width) 0/1 column mask of ``dense`` (filled lazily).
    masks: dict[tuple[int, int, Any], Any] = attrs.field(factory=dict)

    @classmethod
    def build(cls, slots: Sequence[int]) -> RowPlan:
        """The plan of a forward call whose rows have ``slots``."""
        import mlx.core as mx

        adapted = sorted((s, row) for row, s in enumerate(slots) if s)
        positions = [row for _, row in adapted]
        sorted_slots = [s for s, _ in adapted]
        groups = []
        start = 0
        for i, slot in enumerate(sorted_slots):
            if i + 1 == len(sorted_slots) or sorted_slots[i + 1] != slot:
                groups.append((slot, start, i + 1))
                start = i + 1
        in_place = positions == list(range(len(slots)))
        where = {row: i for i, row in enumerate(positions)}
        restore = [where.get(row, len(positions)) for row in range(len(slots))]
        return cls(
            slots=tuple(slots),
            ids=mx.array(list(slots), dtype=mx.uint32),
            order=None if in_place else mx.array(positions, dtype=mx.uint32),
            sorted_ids=mx.array(sorted_slots, dtype=mx.uint32),
            groups=tuple(groups),
            restore=None if in_place else mx.array(restore, dtype=mx.uint32),
        )

    def mask(self, adapters: int, rank: int, dtype: Any) -> Any:
        """``dense``'s column mask: row ``i`` keeps the ``rank`` columns of its own adapter."""
        import mlx.core as mx

        key = (adapters, rank, dtype)
        if key not in self.masks:
            columns = mx.arange(adapters * rank) // rank + 1
            mask = (self.ids[:, None] == columns[None, :]).astype(dtype)[:, None, :]
            mx.eval(mask)
            self.masks[key] = mask
        return self.masks[key]


@attrs.define(eq=False)
class _Current:
    """The plan of the forward call being built, shared by the stack's layers (None: all base)."""

    plan: RowPlan | None = None


def _restore(z: Any, plan: RowPlan) -> Any:
    """Updates of the sorted adapted rows, put back in row order (base rows: zeros)."""
    import mlx.core as mx

    if plan.restore is None:
        return z
    zero = mx.zeros((1, *z.shape[1:]), dtype=z.dtype)
    return mx.concatenate([z, zero])[plan.restore]


def _multi_lora_class() -> type[Any]:
    import mlx.core as mx
    import mlx.nn as nn

    class _MultiLoRALinear(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self, base: Any, method: str, weights: dict[str, Any], current: _Current):
            super().__init__()
            self.base = base
            self.method = method
            self.weights = weights
            self._current = current

        def __call__(self, x: Any) -> Any:
            y = self.base(x)
            plan = self._current.plan
            if plan is None:
                return y
            if self.method == "dense" and self.weights["b"].dtype == y.dtype:
                # One fused multiply-add where the dtypes allow it: fewer ops per layer.
                return mx.addmm(y, self._masked(x, plan), self.weights["b"])
            z = getattr(self, f"_{self.method}")(x, plan)
            return y + (z if z.dtype == y.dtype else z.astype(y.dtype))

        def _grouped(self, x: Any, plan: RowPlan) -> Any:
            xs = x if plan.order is None else x[plan.order]
            parts = []
            for slot, start, stop in plan.groups:
                a, b = self.weights["each"][slot]
                if a is None:
                    parts.append(mx.zeros((stop - start, *x.shape[1:-1], b), dtype=x.dtype))
                else:
                    parts.append((xs[start:stop] @ a) @ b)
            z = parts[0] if len(parts) == 1 else mx.concatenate(parts)
            return _restore(z, plan)

        def _gather(self, x: Any, plan: RowPlan) -> Any:
            a, b = self.weights["a"], self.weights["b"]
            return mx.gather_mm(mx.gather_mm(x, a, rhs_indices=plan.ids), b, rhs_indices=plan.ids)

        def _sorted(self, x: Any, plan: RowPlan) -> Any:
            a, b, ids = self.weights["a"], self.weights["b"], plan.sorted_ids
            xs = x if plan.order is None else x[plan.order]
            h = mx.gather_mm(xs, a, rhs_indices=ids, sorted_indices=True)
            return _restore(mx.gather_mm(h, b, rhs_indices=ids, sorted_indices=True), plan)

        def _masked(self, x: Any, plan: RowPlan) -> Any:
            w = self.weights
            h = x @ w["a"]
            return h * plan.mask(w["count"], w["rank"], h.dtype)

        def _dense(self, x: Any, plan: RowPlan) -> Any:
            return self._masked(x, plan) @ self.weights["b"]

    return _MultiLoRALinear


_CLASS: type[Any] | None = None


def _parent(model: Any, name: str) -> tuple[Any, Any]:
    """The module (or list) holding the layer at the dotted ``name``, and its key there."""
    *path, last = name.split(".")
    node = model
    for part in path:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, int(last) if isinstance(node, list) else last


def _stack_dtype(base: Any, method: str) -> Any:
    """The dtype of a layer's stacked A and B: the one the base layer computes in (its
    weight's, or a quantized layer's scales'), except where MLX's CPU ``gather_mm``
    takes float32 only."""
    import mlx.core as mx

    dtype = getattr(base, "scales", base.weight).dtype
    if not mx.issubdtype(dtype, mx.floating):
        return mx.float32
    on_cpu = mx.default_device() == mx.cpu
    return mx.float32 if method in ("gather", "sorted") and on_cpu else dtype


def _layer_weights(
    entries: Sequence[tuple[Any, Any, float] | None], method: str, dtype: Any
) -> dict[str, Any]:
    """What ``method`` needs of one layer's adapters (``entries``: slot 1.., None: untouched).

    Each adapter's scale is folded into its B once here (``(x A)(s B)``, not
    ``s ((x A) B)``): one op less per layer and step. A and B are kept in the
    ``dtype`` (:func:`_stack_dtype`; mlx-lm saves adapters in float32, and against
    a bfloat16 model mixed dtypes would add two casts per layer and step). In
    float32 the two forms differ in the last bits only; the batch-vs-alone
    token tests hold with it.
    """
    import mlx.core as mx

    present = [e for e in entries if e is not None]
    in_dims, out_dims = present[0][0].shape[0], present[0][1].shape[1]
    if method == "grouped":
        each: list[tuple[Any, Any]] = [(None, out_dims)]
        each += [
            (None, out_dims) if e is None else (e[0].astype(dtype), (e[1] * e[2]).astype(dtype))
            for e in entries
        ]
        return {"each": each}
    rank = max(e[0].shape[1] for e in present)
    a_rows, b_rows = [], []
    for entry in entries:
        if entry is None:
            a_rows.append(mx.zeros((in_dims, rank), dtype=dtype))
            b_rows.append(mx.zeros((rank, out_dims), dtype=dtype))
            continue
        a, b, scale = entry
        pad = rank - a.shape[1]
        a_rows.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
        b_rows.append(mx.pad((b * scale).astype(dtype), [(0, pad), (0, 0)]))
    if method == "dense":
        return {
            "a": mx.concatenate(a_rows, axis=1),
            "b": mx.concatenate(b_rows, axis=0),
            "count": len(entries),
            "rank": rank,
        }
    return {
        "a": mx.stack([mx.zeros((in_dims, rank), dtype=dtype), *a_rows]),
        "b": mx.stack([mx.zeros((rank, out_dims), dtype=dtype), *b_rows]),
    }


@attrs.define(eq=False)
class AdapterStack:
    """The mounted plain LoRA adapters, stacked per layer; rebuilt at each mount and unmount."""

    #: Adapter name -> slot (1-based; 0 is the base).
    slots: dict[str, int] = attrs.field(factory=dict)
    #: Adapter name -> a number unique to this mount (prompt cache keys use it).
    mounts: dict[str, int] = attrs.field(factory=dict)
    #: Layer name -> its multi-LoRA layer (holding the base module).
    modules: dict[str, Any] = attrs.field(factory=dict)
    method: str = DEFAULT_METHOD
    _current: _Current = attrs.field(factory=_Current)
    _plans: dict[tuple[int, ...], RowPlan] = attrs.field(factory=dict)
    #: (parent module or list, key, stacked layer, base layer) for each adapted layer.
    _sites: list[tuple[Any, Any, Any, Any]] = attrs.field(factory=list)

    @classmethod
    def build(
        cls,
        model: Any,
        adapters: Sequence[tuple[str, int, AdapterLayers]],
        method: str = DEFAULT_METHOD,
    ) -> AdapterStack:
        """Stack ``adapters`` (name, mount number, layers) for ``model`` (its base modules)."""
        import mlx.core as mx

        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, not {method!r}")
        global _CLASS
        if _CLASS is None:
            _CLASS = _multi_lora_class()
        method = method_for_device(method)
        stack = cls(method=method)
        stack.slots = {name: slot for slot, (name, _, _) in enumerate(adapters, start=1)}
        stack.mounts = {name: mount for name, mount, _ in adapters}
        if not adapters:
            return stack
        base = dict(model.named_modules())
        for layer in sorted({layer for _, _, a in adapters for layer in a.layers}):
            entries = [a.layers.get(layer) for _, _, a in adapters]
            weights = _layer_weights(entries, method, _stack_dtype(base[layer], method))
            stack.modules[layer] = _CLASS(base[layer], method, weights, stack._current)
        mx.eval([m.parameters() for m in stack.modules.values()])
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
            self._current.plan = None
            for parent, key, _module, base in self._sites:
                parent[key] = base

    def set_rows(self, slots: Sequence[int]) -> None:
        """The adapter slot of each row of the next forward call, in the call's row order."""
        key = tuple(slots)
        if not any(key):
            self._current.plan = None
            return
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            plan = self._plans[key] = RowPlan.build(key)
        self._current.plan = plan
