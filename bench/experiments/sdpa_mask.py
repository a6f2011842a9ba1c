"""Decode-step attention on the GPU with and without the batch's padding mask.

mlx-lm's ``BatchKVCache`` always passes a boolean mask (from the rows' left
padding) to ``mx.fast.scaled_dot_product_attention``, even when no row is
padded. This times one single-query attention call, Llama-3.2-1B's shape
(32 query heads, 8 KV heads, head dim 64), B rows, keys and values as views
of a longer buffer (as the cache hands them over), 16 calls per evaluation
(one step's layers), for: no mask, a boolean mask, an additive mask, and on
CUDA trio-mlx's fused decode kernel at several warps per block (``trio_mlx._accel.decode_attention``), with its
largest difference from the boolean-mask call.
Run: ``python bench/experiments/sdpa_mask.py`` (numbers in design/performance.md).
"""

from __future__ import annotations

import time
from functools import partial

import mlx.core as mx


def timed(fn: object, rounds: int = 100, layers: int = 16) -> float:
    """Microseconds per call of ``fn``, ``layers`` calls per evaluation (one decode step's)."""
    for _ in range(10):
        mx.eval([fn() for _ in range(layers)])  # type: ignore[operator]
    start = time.perf_counter()
    for _ in range(rounds):
        mx.eval([fn() for _ in range(layers)])  # type: ignore[operator]
    return (time.perf_counter() - start) / rounds / layers * 1e6


def attend(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    """One decode step's attention over all rows."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=64**-0.5, mask=mask)


def main() -> None:
    print(mx.default_device(), mx.__version__)
    # (rows, keys, padding of each row): mixed short paddings, then one 4,096-key row
    # among 63 rows of ~300 keys (a long prompt arriving among running streams).
    cases = [
        (8, 384, [i % 17 for i in range(8)]),
        (64, 384, [i % 17 for i in range(64)]),
        (64, 1536, [i % 17 for i in range(64)]),
        (64, 4096, [0] + [4096 - 300 - i for i in range(63)]),
    ]
    for rows, length, paddings in cases:
        # The cache hands attention views of a buffer grown in steps of 256 keys.
        spare = 256 - length % 256 if length % 256 else 0
        q = mx.random.normal((rows, 32, 1, 64)).astype(mx.bfloat16)
        k = mx.random.normal((rows, 8, length + spare, 64)).astype(mx.bfloat16)
        v = mx.random.normal((rows, 8, length + spare, 64)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        k, v = k[..., :length, :], v[..., :length, :]
        padding = mx.array(paddings)
        keep = mx.arange(length)[None] >= padding[:, None]
        boolean = keep[:, None, None, :]
        additive = mx.where(boolean, 0.0, -mx.inf).astype(mx.bfloat16)
        mx.eval(boolean, additive)
        row = {
            name: timed(partial(attend, q, k, v, mask))
            for name, mask in (("none", None), ("bool", boolean), ("additive", additive))
        }
        if mx.cuda.is_available():
            from trio_mlx._accel import decode_attention as _decode_attention

            fused = partial(_decode_attention.decode_attention, q, k, v, padding, 64**-0.5)
            want = attend(q, k, v, boolean).astype(mx.float32)
            for warps in (None, 1, 4, 8, 16):
                _decode_attention.WARPS = warps
                row[f"kernel W={warps or 'auto'}"] = timed(fused)
                error = mx.abs(fused().astype(mx.float32) - want).max().item()
                print(
                    f"  kernel W={warps or 'auto'} vs boolean mask: max abs difference {error:.2e}"
                )
            _decode_attention.WARPS = None
        cells = ", ".join(f"{name} {us:.0f} us" for name, us in row.items())
        print(f"B={rows} kL={length}: {cells}", flush=True)


if __name__ == "__main__":
    main()
