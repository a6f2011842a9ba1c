"""What a buffer of a size not met before costs on CUDA, with and without the kept pool.

``python bench/experiments/pool_alloc.py [GIB ...]`` runs, for each GIB (default
``off 0 24``; ``off`` is MLX's own allocator), a fresh process that calls
:func:`trio_mlx._accel.pool.keep_memory` with ``TRIO_MLX_CUDA_POOL_GIB=GIB`` and
then times, synchronised, the zeroed keys and values of a 64-row batch (32
arrays, 16 layers of Llama-3.2-1B's shape) at 3,072, 3,584, 4,096 and 4,608
positions, each size twice, then the first size again after the others. A
fresh size is what a long prompt's join meets (design/performance.md, eighth
round); the second time of each size is MLX's own cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def child() -> None:
    import mlx.core as mx

    from trio_mlx import _cuda_pool

    done = _cuda_pool.keep_memory()
    print(f"  keep_memory: {done or 'off'}", flush=True)
    sizes = [3072, 3584, 4096, 4608]
    for positions in sizes + sizes[:1]:
        times = []
        for _ in range(2):
            mx.synchronize()
            t0 = time.perf_counter()
            arrays = [mx.zeros((64, 8, positions, 64), mx.bfloat16) for _ in range(32)]
            mx.eval(arrays)
            mx.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            del arrays
        gib = 32 * 64 * 8 * positions * 64 * 2 / 2**30
        print(f"  {positions} positions ({gib:.1f} GiB): first {times[0]:.1f} ms, "
              f"again {times[1]:.1f} ms", flush=True)  # fmt: skip


def main() -> None:
    if sys.argv[1:] == ["child"]:
        child()
        return
    for gib in sys.argv[1:] or ["off", "0", "24"]:
        print(f"TRIO_MLX_CUDA_POOL_GIB={gib}", flush=True)
        env = dict(os.environ, TRIO_MLX_CUDA_POOL_GIB=gib)
        subprocess.run([sys.executable, __file__, "child"], env=env, check=True)


if __name__ == "__main__":
    main()
