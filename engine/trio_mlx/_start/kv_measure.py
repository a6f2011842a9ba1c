"""What a row's KV cache costs, measured on the model's own caches at load (MLX thread).

:func:`measure` makes one cache the way mlx-lm does for a request
(``make_prompt_cache``: the model's ``make_cache`` where it has one), runs a
few tokens through the model into it, and reads each layer's ``nbytes``: a
layer with keys costs its bytes over the positions it allocated, per token
(up to its window when it rotates); a layer without (recurrent state) costs
its bytes per row. :func:`memory_limit` and :func:`weight_bytes` are what the
default budget starts from (:func:`trio_mlx._memory.default_limit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from trio_mlx._memory import KVProfile

__all__ = ["measure", "memory_limit", "weight_bytes"]

#: Tokens run through the model to make every layer allocate its cache.
_PROBE_TOKENS = 4


def _layers(cache: Iterable[Any]) -> Iterable[Any]:
    """Each layer's cache, with ``CacheList`` (several caches in one layer) opened."""
    for layer in cache:
        inner = getattr(layer, "caches", None)
        if isinstance(inner, list | tuple):
            yield from _layers(inner)
        else:
            yield layer


def _positions(keys: Any) -> int:
    """Positions a layer allocated (quantized keys are a tuple of arrays)."""
    first = keys[0] if isinstance(keys, list | tuple) else keys
    return int(first.shape[-2])


def profile_of(cache: Sequence[Any]) -> KVProfile:
    """The profile of a cache that has seen a few tokens."""
    per_token = per_row = 0
    windows: dict[int, int] = {}
    for layer in _layers(cache):
        size = int(layer.nbytes)
        keys = getattr(layer, "keys", None)
        if keys is None:
            per_row += size  # no positions: state of a fixed size (ArraysCache)
            continue
        cost = -(-size // max(1, _positions(keys)))
        window = getattr(layer, "max_size", None)
        if isinstance(window, int) and window > 0:
            windows[window] = windows.get(window, 0) + cost
        else:
            per_token += cost
    return KVProfile(per_token=per_token, windows=tuple(sorted(windows.items())), per_row=per_row)


def measure(model: Any, token: int) -> KVProfile:
    """Run a few copies of ``token`` through ``model`` into a fresh cache; its profile."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    # nbytes reads shapes: the cache need not be evaluated, only allocated by the call.
    mx.eval(model(mx.array([[token] * _PROBE_TOKENS]), cache=cache))
    return profile_of(cache)


def memory_limit() -> int:
    """The bytes MLX says this process may use: its memory limit (on the CPU and CUDA,
    80% of the machine's or the GPU's memory unless set lower), no more than a Metal
    GPU's recommended working set where MLX reports one."""
    import mlx.core as mx

    limits = [int(mx.get_memory_limit())]
    info_of = getattr(mx, "device_info", None)
    info = info_of() if callable(info_of) else {}
    for key in ("max_recommended_working_set_size", "memory_size"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            limits.append(value)
    return min(limits)


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())
    return sum(int(array.nbytes) for _, array in leaves)
