"""Sibling projections as one matmul: q/k/v, and gate/up, of every layer.

Theory of operation
===================

A decode step on the GPU is host-bound: MLX pays host time for every
operation it encodes, and the GPU idles while it does (design/performance.md:
about 285 operations per step of a 16-layer Llama, 10-30 us each). Three of
a Llama layer's seven matmuls read the same input as a sibling: ``q_proj``,
``k_proj`` and ``v_proj`` all take the normed hidden state, and so do
``gate_proj`` and ``up_proj``. :func:`install` stacks each such group's
weights into one matrix, so the first member called computes every member's
output in one matmul and the others take theirs from it: three operations
fewer per layer and step, on any model whose modules use these names.

It leaves the model as it was for everything else:

* Each member keeps its own ``weight`` (and ``bias``, ``scales``,
  ``biases``), now a view of its rows of the stacked matrix: the parameters,
  their names, values and the memory they take are what they were, so
  checksums, adapters and ``load_weights`` see the plain model.
* A member computes the group's matmul only when the group is *intact*: every
  member still holds the arrays it was given (nothing replaced a weight), and
  every member is called with the input itself, directly or through mlx-lm's
  ``LoRALinear`` or the multi-LoRA layer (both call their base layer on the
  same input). A member wrapped by anything else (a DoRA layer computes with
  the weight, not the layer) turns the group off for that call: each member
  then runs its own matmul over its view, as a plain ``Linear`` would.
* The other members' outputs wait in the group's *stash*, keyed by the input
  array itself (identity, not value), and leave it when taken; a call with any
  other input computes afresh. So a stash never serves a stale or foreign
  input, and it holds at most one layer's outputs between calls.
* Some models do not call every sibling: Gemma 3n's KV-shared layers call
  ``q_proj`` alone while they have a cache. There the stacked matmul would
  compute outputs nobody takes, and the stash would hold them until the next
  call. So :func:`install` runs one forward pass over a two-token prompt with
  a fresh cache and unstacks every group that left outputs behind.

Only exact ``nn.Linear`` and ``nn.QuantizedLinear`` members of one kind,
shape of input and dtype are stacked (quantized ones with equal group size,
bits and mode); anything else (a distributed shard, a fused ``qkv_proj``
already) is left alone. All calls run on the MLX thread.
``TRIO_MLX_FUSED_PROJECTIONS=0`` turns it off, for side-by-side runs.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["GROUPS", "install"]

logger = logging.getLogger("trio_mlx")

#: Sibling modules that read the same input (mlx-lm's names, in call order).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: The parameters a member may hold, stacked along the output rows.
_ARRAYS = ("weight", "bias", "scales", "biases")
#: A quantized member's settings, equal across a group.
_SETTINGS = ("group_size", "bits", "mode")


class _Group:
    """One stacked group (a plain object: its arrays are not model parameters)."""

    def __init__(self, parent: Any, names: tuple[str, ...], members: list[Any]) -> None:
        import mlx.core as mx

        self.parent = parent
        self.names = names
        self.members = members
        keys = [k for k in _ARRAYS if k in members[0]]
        stacked = {k: mx.concatenate([m[k] for m in members]) for k in keys}
        mx.eval(stacked)
        #: A module of the members' own type over the stacked arrays (not in the model's tree).
        self.whole = copy.copy(members[0])
        self.whole.update(stacked)
        bounds = [0]
        for m in members:
            bounds.append(bounds[-1] + m["weight"].shape[0])
        self.bounds = bounds
        #: Each member's arrays: views of its rows of the stacked ones.
        self.views = [{k: stacked[k][a:b] for k in keys} for a, b in itertools.pairwise(bounds)]
        mx.eval(self.views)
        for m, views in zip(members, self.views, strict=True):
            m.update(views)
        #: The input the stash answers for, and member index -> its output.
        self.stash_input: Any = None
        self.stash: dict[int, Any] = {}
        #: The members' classes before stacking (:meth:`unstack` restores them).
        self.kinds = [type(m) for m in members]

    def unstack(self) -> None:
        """Make the members plain layers again (their weights stay views: same values)."""
        for member, kind in zip(self.members, self.kinds, strict=True):
            member.__class__ = kind
            del member._fusion, member._fusion_index
        self.stash_input, self.stash = None, {}

    def intact(self) -> bool:
        """Whether every member holds its views and will be called with the input itself."""
        for member, name, views in zip(self.members, self.names, self.views, strict=True):
            for key, view in views.items():
                if member.get(key) is not view:
                    return False
            holder = self.parent.get(name)
            if holder is member:
                continue
            if getattr(holder, "base", None) is member:  # the multi-LoRA layer
                continue
            if _is_lora(holder) and holder.linear is member:
                continue
            return False
        return True

    def outputs(self, x: Any) -> list[Any]:
        """Every member's output for ``x``: one matmul, split along the last axis."""
        import mlx.core as mx

        y = self.whole(x)
        parts: list[Any] = mx.split(y, self.bounds[1:-1], axis=-1)  # type: ignore[assignment]
        return parts


def _is_lora(module: Any) -> bool:
    """Whether ``module`` is mlx-lm's ``LoRALinear`` (which calls its layer on the input).

    By name: importing ``mlx_lm.tuner`` costs a second and a half at load.
    """
    kind = type(module)
    return kind.__name__ == "LoRALinear" and kind.__module__ == "mlx_lm.tuner.lora"


class _Member:
    """Mixed into a member's class: serve the group's stash, or compute the group's matmul."""

    _fusion: _Group
    _fusion_index: int

    def __call__(self, x: Any) -> Any:
        group, index = self._fusion, self._fusion_index
        if group.stash_input is x and index in group.stash:
            out = group.stash.pop(index)
            if not group.stash:
                group.stash_input = None
            return out
        if not group.intact():
            return super().__call__(x)  # type: ignore[misc]
        outs = group.outputs(x)
        group.stash_input = x
        group.stash = {i: out for i, out in enumerate(outs) if i != index}
        return outs[index]


_CLASSES: dict[type, type] = {}


def _member_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Fused{base.__name__}", (_Member, base), {})
    return _CLASSES[base]


def _stackable(members: list[Any]) -> bool:
    import mlx.nn as nn

    kind = type(members[0])
    plain = (nn.Linear, nn.QuantizedLinear)  # type: ignore[attr-defined]
    if kind not in plain or any(type(m) is not kind for m in members):
        return False
    keys = [k for k in _ARRAYS if k in members[0]]
    first = members[0]
    for m in members:
        if [k for k in _ARRAYS if k in m] != keys:
            return False
        if any(getattr(m, s, None) != getattr(first, s, None) for s in _SETTINGS):
            return False
        w = m["weight"]
        if (
            w.ndim != 2
            or w.shape[1] != first["weight"].shape[1]
            or w.dtype != first["weight"].dtype
        ):
            return False
    return True


def install(model: Any, environ: Mapping[str, str] | None = None) -> int:
    """Stack every sibling group of ``model`` (see the module's notes); the number stacked.

    ``TRIO_MLX_FUSED_PROJECTIONS=0`` in ``environ`` (default: the process's)
    leaves the model alone.
    """
    env = os.environ if environ is None else environ
    if env.get("TRIO_MLX_FUSED_PROJECTIONS", "1") == "0":
        return 0
    groups: list[_Group] = []
    for _, module in model.named_modules():
        for names in GROUPS:
            members = [module.get(name) for name in names]
            if any(m is None for m in members) or not _stackable(members):
                continue
            group = _Group(module, names, members)
            for index, member in enumerate(members):
                member.__class__ = _member_class(type(member))
                member._fusion = group
                member._fusion_index = index
            groups.append(group)
    if groups:
        groups = _called_whole(model, groups)
    if groups:
        logger.info("stacked %d groups of sibling projections into one matmul each", len(groups))
    return len(groups)


def _called_whole(model: Any, groups: list[_Group]) -> list[_Group]:
    """The groups whose every member a forward pass calls; the others are unstacked again."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    try:
        mx.eval(model(mx.array([[0, 0]]), cache=make_prompt_cache(model)))
    except Exception as exc:  # a model this probe cannot drive: leave it as it was
        logger.warning("sibling projections left unstacked: the probe pass failed: %s", exc)
        for group in groups:
            group.unstack()
        return []
    kept = []
    for group in groups:
        if group.stash:
            group.unstack()
        else:
            kept.append(group)
    return kept
