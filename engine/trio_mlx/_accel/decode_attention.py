"""A fused decode-step attention for padded batches on CUDA.

Theory of operation
===================

In a batch of rows that joined at different times, mlx-lm's ``BatchKVCache``
left-pads the shorter rows and gives attention a boolean mask built from that
padding, on every step and even when no row is padded. With an array mask,
MLX 0.32's CUDA attention for a single query is 2-9x slower than without
(287 against 62 us per call at 64 rows and 384 positions, 804 against 86 at 1,536; design/performance.md), for every
layer of every decode step; the cost grows with the batch's longest row, so
one long prompt slows every stream.

The mask of a decode step says one thing per row: its keys start at its left
padding. :func:`decode_attention` takes exactly that (the cache's
``left_padding``) and runs one kernel per call, so no mask is built or read
and padded keys are never touched. A block is one (row, KV head) pair: its
warps split the row's keys between them (a long row is walked by several
warps at once, not one), each key and value is read once for all the query
heads that share it, the softmax is online in float32, and the warps' partial
sums are merged in shared memory. It reads the cache's keys and values where
they lie (views into a larger buffer) instead of a contiguous copy of each.

:func:`install` puts it in front of mlx-lm's ``scaled_dot_product_attention``
in the model's own module, for calls it can take (one query, a
``BatchKVCache`` or the traced step's ``TracedCache``, whose ``stop`` it passes
on; no sinks, head dimension a multiple of 32 up to 256, the CUDA backend);
every other call goes to mlx-lm's as before. It is installed
only on CUDA (not Metal or the CPU) and can be turned off with
``TRIO_MLX_DECODE_KERNEL=0`` for side-by-side runs.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["decode_attention", "install"]

logger = logging.getLogger("trio_mlx")

#: The kernel's body. A block is one (KV head, row) pair and ``W`` warps: each
#: warp walks every ``W``-th key of the row from its left padding on, for all
#: ``G`` query heads that share the KV head (each key and value is read once
#: for the group), with an online softmax in float32; the warps' partial sums
#: are then merged through shared memory. Inputs are read through their
#: strides: the cache's keys and values arrive as views of its larger buffer,
#: and a row-contiguous copy of them would cost two more kernels per layer.
_SOURCE = """
    constexpr int E = D / 32;
    const int W = blockDim.x / 32;  // at most WMAX, which sizes the merge buffers
    const int kv_head = blockIdx.x;
    const int row = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int heads = gridDim.x * G;
    const int length = LENGTH;
    const int first = start[row * start_strides[0]];
    const float softmax_scale = scale[0];
    float qv[G][E];
    float acc[G][E];
    float best[G];
    float total[G];
    for (int g = 0; g < G; ++g) {
        const int64_t at = row * q_strides[0] + (kv_head * G + g) * q_strides[1]
            + (int64_t)(lane * E) * q_strides[3];
        for (int e = 0; e < E; ++e) {
            qv[g][e] = static_cast<float>(q[at + e * q_strides[3]]) * softmax_scale;
            acc[g][e] = 0.0f;
        }
        best[g] = __int_as_float(0xff800000);  // -infinity
        total[g] = 0.0f;
    }
    const int64_t kb = row * k_strides[0] + kv_head * k_strides[1] + (int64_t)(lane * E) * k_strides[3];
    const int64_t vb = row * v_strides[0] + kv_head * v_strides[1] + (int64_t)(lane * E) * v_strides[3];
    for (int j = first + warp; j < length; j += W) {
        float kk[E];
        float vv[E];
        for (int e = 0; e < E; ++e) {
            kk[e] = static_cast<float>(k[kb + j * k_strides[2] + e * k_strides[3]]);
            vv[e] = static_cast<float>(v[vb + j * v_strides[2] + e * v_strides[3]]);
        }
        float score[G];
        for (int g = 0; g < G; ++g) {
            score[g] = 0.0f;
            for (int e = 0; e < E; ++e) {
                score[g] += qv[g][e] * kk[e];
            }
        }
        for (int step = 16; step > 0; step >>= 1) {
            for (int g = 0; g < G; ++g) {
                score[g] += __shfl_xor_sync(0xffffffff, score[g], step);
            }
        }
        for (int g = 0; g < G; ++g) {
            const float top = fmaxf(best[g], score[g]);
            const float shrink = __expf(best[g] - top);
            const float weight = __expf(score[g] - top);
            total[g] = total[g] * shrink + weight;
            for (int e = 0; e < E; ++e) {
                acc[g][e] = acc[g][e] * shrink + weight * vv[e];
            }
            best[g] = top;
        }
    }
    __shared__ float merged_best[WMAX][G];
    __shared__ float merged_total[WMAX][G];
    __shared__ float merged_acc[WMAX][G][D];
    for (int g = 0; g < G; ++g) {
        for (int e = 0; e < E; ++e) {
            merged_acc[warp][g][lane * E + e] = acc[g][e];
        }
        if (lane == 0) {
            merged_best[warp][g] = best[g];
            merged_total[warp][g] = total[g];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += 32 * W) {
        const int g = i / D;
        const int d = i % D;
        float top = __int_as_float(0xff800000);
        for (int w = 0; w < W; ++w) {
            top = fmaxf(top, merged_best[w][g]);
        }
        float sum = 0.0f;
        float value = 0.0f;
        for (int w = 0; w < W; ++w) {
            // A warp that saw no key holds -infinity: it weighs nothing.
            const float weight = merged_total[w][g] > 0.0f ? __expf(merged_best[w][g] - top) : 0.0f;
            sum += merged_total[w][g] * weight;
            value += merged_acc[w][g][d] * weight;
        }
        out[((int64_t)row * heads + kv_head * G + g) * D + d] =
            static_cast<T>(sum > 0.0f ? value / sum : 0.0f);
    }
"""


@functools.cache
def _kernel(stopped: bool) -> Any:
    """The kernel over every key of the arrays, or (``stopped``) over the first ``stop[0]``."""
    import mlx.core as mx

    return mx.fast.cuda_kernel(
        name="trio_mlx_decode_attention" + ("_stopped" if stopped else ""),
        input_names=["q", "k", "v", "start", "scale", *(["stop"] if stopped else [])],
        output_names=["out"],
        source=_SOURCE.replace("LENGTH", "stop[0]" if stopped else "k_shape[2]"),
        ensure_row_contiguous=False,
    )


def decode_attention(
    queries: Any, keys: Any, values: Any, start: Any, scale: float, stop: Any = None
) -> Any:
    """Attention of one query per row over keys ``start[row]:stop`` (CUDA only).

    ``queries`` is (rows, heads, 1, dim), ``keys`` and ``values`` (rows,
    kv_heads, length, dim), any strides; ``start`` (rows,) int: the first real
    key of each row; ``stop`` (None: ``length``) a one-element int32 array: the
    keys past it are not read (a buffer's unwritten tail, whose length stays
    fixed from step to step). The same as ``mx.fast.scaled_dot_product_attention``
    with the mask ``(arange(length) >= start[:, None]) & (arange(length) < stop)``.
    """
    import mlx.core as mx

    rows, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    most = _max_warps(group, dim)
    warps = _warps(rows * kv_heads, group, dim)
    (out,) = _kernel(stop is not None)(
        inputs=[
            queries,
            keys,
            values,
            start if start.dtype == mx.int32 else start.astype(mx.int32),
            _scalar(scale, "float32"),
            *([] if stop is None else [stop]),
        ],
        template=[("T", queries.dtype), ("D", dim), ("G", group), ("WMAX", most)],
        grid=(32 * warps * kv_heads, rows, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(rows, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )
    return out


#: Set to force the warps per block (the experiments' knob); None: :func:`_warps` decides.
WARPS: int | None = None

#: Static shared memory a block may use (the CUDA limit without opting in is 48 KiB).
_SHARED_BYTES = 48 * 1024


def _warps(blocks: int, group: int, dim: int) -> int:
    """Warps per block: more when there are few blocks, as many as shared memory holds."""
    return min(WARPS or (8 if blocks >= 256 else 16), _max_warps(group, dim))


@functools.cache
def _max_warps(group: int, dim: int) -> int:
    """The most warps a block of this head shape may have: its merge buffers, sized
    for them, fit in shared memory. A template argument of the kernel, where the
    warps themselves are not: the row count picks the warps, and a new template
    is a new NVRTC compile in the step that meets it, in every process (MLX does
    not keep custom kernels on disk): the H200's long-prompt stall, 1.5-2.9 s."""
    warps = 16
    while warps > 1 and warps * group * (dim + 2) * 4 > _SHARED_BYTES:
        warps //= 2
    return warps


@functools.lru_cache(maxsize=16)
def _scalar(value: float, dtype: str) -> Any:
    """A one-element array, made once: every layer of every step passes the same scale."""
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


#: The most query-head elements a lane holds (group size x dim / 32); beyond it, mlx-lm's.
_REGISTERS = 32


@functools.cache
def _cache_types() -> tuple[type, type]:
    """The caches the kernel serves, imported once (``_takes`` runs per layer per step):
    mlx-lm's ``BatchKVCache`` and the traced step's (which carries ``stop``)."""
    from mlx_lm.models.cache import BatchKVCache

    from trio_mlx._accel.traced_decode import TracedCache

    return BatchKVCache, TracedCache


def _takes(queries: Any, keys: Any, values: Any, cache: Any, sinks: Any) -> bool:
    """Whether :func:`decode_attention` can answer this call."""
    dim = queries.shape[-1]
    return (
        sinks is None
        and type(cache) in _cache_types()
        and queries.shape[2] == 1
        and dim % 32 == 0
        and dim <= 256
        and values.shape[-1] == dim
        and queries.shape[1] % keys.shape[1] == 0
        # Each lane keeps a query and a sum per head of the group: bounded registers.
        and (queries.shape[1] // keys.shape[1]) * (dim // 32) <= _REGISTERS
    )


def install(model: Any, switches: Mapping[str, str] | None = None) -> bool:
    """Route the model's single-query batch attention through the kernel; True if it is.

    Only on MLX's CUDA backend, not when ``TRIO_MLX_DECODE_KERNEL`` is ``0`` in
    ``switches`` (default: the process's environment), and
    only once the kernel has compiled and matched MLX's masked attention on a
    small padded batch (else a warning, and mlx-lm's path as before). The
    first real call of each head shape is checked again against mlx-lm's call.
    """
    import mlx.core as mx

    switches = os.environ if switches is None else switches
    if switches.get("TRIO_MLX_DECODE_KERNEL", "1") == "0" or not mx.cuda.is_available():
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
        fused = decode_attention(
            queries, keys, values, cache.left_padding, scale, stop=getattr(cache, "stop", None)
        )
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
