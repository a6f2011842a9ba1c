"""What ``mx.clear_cache()`` costs with a server's buffers in MLX's cache, and after it.

``python bench/experiments/clear_cache.py`` calls
:func:`trio_mlx._accel.pool.keep_memory` (the server's start-up), then for each
case allocates arrays (evaluated, then dropped: they wait in MLX's cache), and
times, synchronised: ``mx.clear_cache()``, then the same arrays allocated again
(what the steps after a clear meet), then allocated once more (from the cache).
mlx-lm's ``BatchGenerator`` clears every 512 decode steps; a served step that
took 1.5 s at 64 rows (design/performance.md, fourteenth round) is what this
looks for.
"""

from __future__ import annotations

import time


def timed(fn: object) -> float:
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    import mlx.core as mx

    from trio_mlx import _cuda_pool

    print(f"keep_memory: {_cuda_pool.keep_memory() or 'off'}", flush=True)
    # (count, elements): a decode step's many small buffers, and a 64-row batch's
    # keys and values at 4,096 positions (32 arrays of 64 x 8 x 4,096 x 64, bf16).
    cases = [
        ("2,000 x 64 KiB", 2000, 32 * 1024),
        ("10,000 x 64 KiB", 10000, 32 * 1024),
        ("32 x 256 MiB", 32, 64 * 8 * 4096 * 64),
        ("32 x 256 MiB + 5,000 x 64 KiB", -1, 0),
    ]
    for name, count, elements in cases:
        big = [64 * 8 * 4096 * 64] * 32 + [32 * 1024] * 5000
        shapes = big if count < 0 else [elements] * count

        def make(shapes: list[int] = shapes) -> None:
            arrays = [mx.zeros((n,), mx.bfloat16) for n in shapes]
            mx.eval(arrays)

        make()  # into the cache
        cached = mx.get_cache_memory() >> 20
        clear = timed(mx.clear_cache)
        after = timed(make)
        again = timed(make)
        print(f"{name}: {cached} MiB cached; clear_cache {clear:.1f} ms; "
              f"the same buffers after it {after:.1f} ms, then from the cache {again:.1f} ms",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
