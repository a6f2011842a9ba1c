"""A fused decode-step attention for padded batches on CUDA.

Theory of operation
===================

In a batch of rows that joined at different times, mlx-lm's ``BatchKVCache``
left-pads the shorter rows and gives attention a boolean mask built from that
padding, on every step and even when no row is padded. With an array mask,
MLX 0.32's CUDA attention for a single query is 2.5-8x slower than without
(``bench/experiments/sdpa_mask.py``: 400 against 157 us per call at 64 rows and
384 positions, 1,227 against 151 at 1,536), for every layer of every decode
step; the cost grows with the batch's longest row, so one long prompt slows
every stream.

The mask of a decode step says one thing per row: its keys start at its left
padding. :func:`decode_attention` takes exactly that (the cache's
``left_padding``) and runs one kernel per call: one warp per (row, query head)
walks the row's keys from its first real one, with an online softmax in
float32, so no mask is built or read and padded keys are never touched.

:func:`install` puts it in front of mlx-lm's ``scaled_dot_product_attention``
in the model's own module, for calls it can take (one query, a
``BatchKVCache``, no sinks, head dimension a multiple of 32 up to 256, the
CUDA backend); every other call goes to mlx-lm's as before. It is installed
only on CUDA (not Metal or the CPU) and can be turned off with
``TRIO_MLX_DECODE_KERNEL=0`` for side-by-side runs.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["decode_attention", "install"]

logger = logging.getLogger("trio_mlx")

#: The kernel's body: blocks are (query head, row); a block is one warp.
_SOURCE = """
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int lane = threadIdx.x;
    const int heads = gridDim.x;
    const int kv_heads = heads / GQA;
    const int length = klen[0];
    const int first = start[row];
    constexpr int E = D / 32;
    const float softmax_scale = scale[0];
    float qv[E];
    float acc[E];
    const size_t qo = ((size_t)row * heads + head) * D + lane * E;
    for (int e = 0; e < E; ++e) {
        qv[e] = static_cast<float>(q[qo + e]) * softmax_scale;
        acc[e] = 0.0f;
    }
    const size_t kv = ((size_t)row * kv_heads + head / GQA) * (size_t)length * D + lane * E;
    float best = __int_as_float(0xff800000);  // -infinity
    float total = 0.0f;
    for (int j = first; j < length; ++j) {
        const size_t at = kv + (size_t)j * D;
        float score = 0.0f;
        for (int e = 0; e < E; ++e) {
            score += qv[e] * static_cast<float>(k[at + e]);
        }
        for (int step = 16; step > 0; step >>= 1) {
            score += __shfl_xor_sync(0xffffffff, score, step);
        }
        const float top = fmaxf(best, score);
        const float shrink = __expf(best - top);
        const float weight = __expf(score - top);
        total = total * shrink + weight;
        for (int e = 0; e < E; ++e) {
            acc[e] = acc[e] * shrink + weight * static_cast<float>(v[at + e]);
        }
        best = top;
    }
    const float norm = total > 0.0f ? 1.0f / total : 0.0f;
    for (int e = 0; e < E; ++e) {
        out[qo + e] = static_cast<T>(acc[e] * norm);
    }
"""

_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        import mlx.core as mx

        _KERNEL = mx.fast.cuda_kernel(
            name="trio_mlx_decode_attention",
            input_names=["q", "k", "v", "start", "klen", "scale"],
            output_names=["out"],
            source=_SOURCE,
        )
    return _KERNEL


def decode_attention(queries: Any, keys: Any, values: Any, start: Any, scale: float) -> Any:
    """Attention of one query per row over keys ``start[row]:`` (CUDA only).

    ``queries`` is (rows, heads, 1, dim), ``keys`` and ``values`` (rows,
    kv_heads, length, dim), ``start`` (rows,) int: the first real key of each
    row. The same as ``mx.fast.scaled_dot_product_attention`` with the mask
    ``arange(length) >= start[:, None]``.
    """
    import mlx.core as mx

    rows, heads, _, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    (out,) = _kernel()(
        inputs=[
            queries,
            keys,
            values,
            start if start.dtype == mx.int32 else start.astype(mx.int32),
            _scalar(length, "int32"),
            _scalar(scale, "float32"),
        ],
        template=[("T", queries.dtype), ("D", dim), ("GQA", heads // kv_heads)],
        grid=(32 * heads, rows, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )
    return out


@functools.lru_cache(maxsize=16)
def _scalar(value: float, dtype: str) -> Any:
    """A one-element array, made once: every layer of a step passes the same length and scale."""
    import mlx.core as mx

    return mx.array([value], dtype=getattr(mx, dtype))


def _works() -> bool:
    """Whether the kernel compiles here and agrees with MLX's masked attention."""
    import mlx.core as mx

    try:
        # Keyed draws: the check leaves the global random state (seeded requests) alone.
        kq, kk, kv = mx.random.split(mx.random.key(0), 3)
        q = mx.random.normal((3, 8, 1, 64), key=kq).astype(mx.bfloat16)
        k = mx.random.normal((3, 2, 40, 64), key=kk).astype(mx.bfloat16)
        v = mx.random.normal((3, 2, 40, 64), key=kv).astype(mx.bfloat16)
        start = mx.array([0, 7, 39])
        mask = (mx.arange(40)[None] >= start[:, None])[:, None, None, :]
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        got = decode_attention(q, k, v, start, 0.125)
        return bool(mx.allclose(got, want, atol=3e-2, rtol=3e-2).item())
    except Exception:  # a JIT compile failure, say: mlx-lm's own path then
        logger.warning("the fused decode attention is off: it failed its check", exc_info=True)
        return False


@functools.cache
def _batch_cache() -> type:
    """mlx-lm's ``BatchKVCache``, imported once (``_takes`` runs per layer per step)."""
    from mlx_lm.models.cache import BatchKVCache

    return BatchKVCache


def _takes(queries: Any, keys: Any, values: Any, cache: Any, sinks: Any) -> bool:
    """Whether :func:`decode_attention` can answer this call."""
    dim = queries.shape[-1]
    return (
        sinks is None
        and type(cache) is _batch_cache()
        and queries.shape[2] == 1
        and dim % 32 == 0
        and dim <= 256
        and values.shape[-1] == dim
        and queries.shape[1] % keys.shape[1] == 0
    )


def install(model: Any) -> bool:
    """Route the model's single-query batch attention through the kernel; True if it is.

    Only on MLX's CUDA backend, not when ``TRIO_MLX_DECODE_KERNEL`` is ``0``, and
    only once the kernel has compiled and matched MLX's masked attention on a
    small padded batch (else a warning, and mlx-lm's path as before). The
    first real call of each head shape is checked again against mlx-lm's call.
    """
    import mlx.core as mx

    if os.environ.get("TRIO_MLX_DECODE_KERNEL", "1") == "0" or not mx.cuda.is_available():
        return False
    if not _works():
        return False
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return False
    inner = getattr(module, "scaled_dot_product_attention", None)
    if inner is None or getattr(inner, "trio_mlx_decode", False):
        return inner is not None
    original: Callable[..., Any] = inner
    #: (head dim, query heads per KV head, dtype) -> whether the kernel matched there.
    verified: dict[tuple[int, int, Any], bool] = {}

    def attention(
        queries: Any,
        keys: Any,
        values: Any,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> Any:
        if not _takes(queries, keys, values, cache, sinks):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        shape = (queries.shape[-1], queries.shape[1] // keys.shape[1], queries.dtype)
        known = verified.get(shape)
        if known is False:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
        fused = decode_attention(queries, keys, values, cache.left_padding, scale)
        if known is None:
            # The first call of each shape is checked against mlx-lm's own (one sync, once).
            plain = original(queries, keys, values, cache=cache, scale=scale, mask=mask)
            verified[shape] = bool(mx.allclose(fused, plain, atol=3e-2, rtol=3e-2).item())
            if not verified[shape]:
                logger.warning("the fused decode attention is off for %s: it disagreed", shape)
                return plain
        return fused

    attention.trio_mlx_decode = True  # type: ignore[attr-defined]
    module.scaled_dot_product_attention = attention  # type: ignore[attr-defined]
    return True
