"""Fixes to mlx-lm model classes that the batch lane needs, applied at load.

A fix changes one model class's behaviour on a batched call only and leaves
every single-row call (the serial lane, ``mlx_lm.generate``) as it was. Each
is installed by swapping the affected modules' class for a subclass, so the
model's weights and structure stay mlx-lm's.

* gemma2's attention: with grouped query heads it reshapes the scores to
  (batch, kv heads, repeats, queries, keys) and adds the mask as given. A
  single row's mask is (queries, keys) and broadcasts; a batch's is
  (batch, 1, queries, keys), which lines its batch axis up with the KV heads
  and fails every batched request (mlx-lm's own ``batch_generate`` fails the
  same way). The fix gives a 4-D mask the repeats axis.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["install"]

log = logging.getLogger(__name__)


def _gemma2_attention(base: type[Any]) -> type[Any]:
    import mlx.core as mx

    class BatchMaskAttention(base):  # type: ignore[misc]
        def __call__(self, x: Any, mask: Any = None, cache: Any = None) -> Any:
            if self.repeats > 1 and isinstance(mask, mx.array) and mask.ndim == 4:
                mask = mx.expand_dims(mask, 2)
            return super().__call__(x, mask, cache)

    return BatchMaskAttention


#: (mlx-lm module, class name) -> the fixed subclass's builder.
_FIXES = {("mlx_lm.models.gemma2", "Attention"): _gemma2_attention}


def install(model: Any) -> int:
    """Apply the fixes ``model``'s classes need; return how many modules were fixed."""
    built: dict[type[Any], type[Any]] = {}
    fixed = 0
    for _name, module in model.named_modules():
        cls = type(module)
        fix = _FIXES.get((cls.__module__, cls.__name__))
        if fix is None:
            continue
        if cls not in built:
            built[cls] = fix(cls)
            log.info("batched attention masks fixed for %s.%s", cls.__module__, cls.__name__)
        module.__class__ = built[cls]
        fixed += 1
    return fixed
