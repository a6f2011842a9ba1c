"""kv_bits on CUDA: attention over a quantized KV cache, dequantized first.

mlx-lm's quantized attention multiplies the queries straight into the packed
keys and values (``mx.quantized_matmul``). MLX's CUDA backend has no kernel for
many of the shapes that makes (mlx-cuda 0.32.4, on the H200: head size 32 at any
length; head size 64 for a 540-token prompt of four query heads a KV head, "No
implementation for problem shape"), and a kv_bits request failed in its step.
On CUDA the keys and values are dequantized and attention runs in MLX's fused
kernel instead: the cache keeps its quantized size between steps, and each step
pays one dequantization of what it reads. Elsewhere nothing changes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dequantized_attention", "install"]


def dequantized_attention(
    queries: Any,
    q_keys: tuple[Any, Any, Any],
    q_values: tuple[Any, Any, Any],
    scale: float,
    mask: Any,
    group_size: int = 64,
    bits: int = 8,
) -> Any:
    """mlx-lm's ``quantized_scaled_dot_product_attention``, over dequantized keys and values."""
    import mlx.core as mx

    keys = mx.dequantize(*q_keys, group_size=group_size, bits=bits).astype(queries.dtype)
    values = mx.dequantize(*q_values, group_size=group_size, bits=bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def install(cuda: bool) -> None:
    """On CUDA, make mlx-lm's attention over a quantized cache use :func:`dequantized_attention`.

    mlx-lm's ``scaled_dot_product_attention`` (every model's attention) looks the
    quantized function up in its module at each call, so one assignment serves
    every model and both lanes.
    """
    if not cuda:
        return
    from mlx_lm.models import base

    base.quantized_scaled_dot_product_attention = dequantized_attention
