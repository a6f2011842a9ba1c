"""Decode-step attention on the GPU with and without the batch's padding mask.

mlx-lm's ``BatchKVCache`` always passes a boolean mask (from the rows' left
padding) to ``mx.fast.scaled_dot_product_attention``, even when no row is
padded. This times one single-query attention call, Llama-3.2-1B's shape
(32 query heads, 8 KV heads, head dim 64), B rows, per call with an eval each
(host cost included), for: no mask, a boolean mask, an additive mask, and on
CUDA trio-mlx's fused decode kernel (``trio_mlx._decode_attention``), with its
largest difference from the boolean-mask call.
Run: ``python bench/experiments/sdpa_mask.py`` (numbers in design/performance.md).
"""

from __future__ import annotations

import time
from functools import partial

import mlx.core as mx


def timed(fn: object, rounds: int = 200) -> float:
    """Microseconds per call of ``fn`` (evaluated each time), after a warm-up."""
    for _ in range(20):
        mx.eval(fn())  # type: ignore[operator]
    start = time.perf_counter()
    for _ in range(rounds):
        mx.eval(fn())  # type: ignore[operator]
    return (time.perf_counter() - start) / rounds * 1e6


def attend(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None) -> mx.array:
    """One decode step's attention over all rows."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=64**-0.5, mask=mask)


def main() -> None:
    print(mx.default_device(), mx.__version__)
    for rows, length in ((8, 384), (64, 384), (64, 1536)):
        q = mx.random.normal((rows, 32, 1, 64)).astype(mx.bfloat16)
        k = mx.random.normal((rows, 8, length, 64)).astype(mx.bfloat16)
        v = mx.random.normal((rows, 8, length, 64)).astype(mx.bfloat16)
        padding = mx.array([i % 17 for i in range(rows)])
        keep = mx.arange(length)[None] >= padding[:, None]
        boolean = keep[:, None, None, :]
        additive = mx.where(boolean, 0.0, -mx.inf).astype(mx.bfloat16)
        mx.eval(q, k, v, boolean, additive)
        row = {
            name: timed(partial(attend, q, k, v, mask))
            for name, mask in (("none", None), ("bool", boolean), ("additive", additive))
        }
        if mx.cuda.is_available():
            from trio_mlx._decode_attention import decode_attention

            fused = partial(decode_attention, q, k, v, padding, 64**-0.5)
            row["kernel"] = timed(fused)
            error = mx.abs(fused().astype(mx.float32) - attend(q, k, v, boolean).astype(mx.float32))
            print(f"  kernel vs boolean mask: max abs difference {error.max().item():.2e}")
        cells = ", ".join(f"{name} {us:.0f} us" for name, us in row.items())
        print(f"B={rows} kL={length}: {cells}", flush=True)


if __name__ == "__main__":
    main()
