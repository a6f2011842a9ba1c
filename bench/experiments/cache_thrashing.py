"""Whether MLX's CUDA caches turn many distinct shapes into a fatal error.

MLX's CUDA backend caches CUDA graphs by topology (``MLX_CUDA_GRAPH_CACHE_SIZE``)
and cuDNN attention plans by shape; while ``MLX_ENABLE_CACHE_THRASHING_CHECK``
is on, a cache whose misses pass a bound raises "Cache thrashing" from the
evaluation that missed. A server sees ever-new prefill shapes and batch
compositions, so this runs, each in a fresh process:

* ``graphs``: 1,024 graphs of distinct topology (a few dozen additions whose
  dependency edges follow the bits of the graph's number), MLX's defaults;
* ``cudnn``: cuDNN attention (``MLX_CUDA_USE_CUDNN_SDPA=1``) for 700 distinct
  prompt lengths;

each once with the check as MLX ships it and once with
``MLX_ENABLE_CACHE_THRASHING_CHECK=0``, and prints how far each got.
Run: ``python bench/experiments/cache_thrashing.py`` (numbers in design/performance.md).
"""

from __future__ import annotations

import os
import subprocess
import sys


def graphs() -> int:
    import mlx.core as mx

    a = mx.ones((8, 8))
    mx.eval(a)
    for n in range(1024):
        left, right = a + 1, a + 2
        for bit in range(10):
            if n >> bit & 1:
                left = left + a
            else:
                right = right + a
        mx.eval(left + right)
    return 1024


def cudnn() -> int:
    import mlx.core as mx

    done = 0
    for length in range(16, 16 + 700):
        q = mx.ones((1, 8, length, 64), dtype=mx.bfloat16)
        out = mx.fast.scaled_dot_product_attention(q, q, q, scale=0.125, mask="causal")
        mx.eval(out)
        done += 1
    return done


def child(which: str) -> None:
    try:
        done = {"graphs": graphs, "cudnn": cudnn}[which]()
        print(f"completed {done}", flush=True)
    except Exception as exc:
        print(f"raised {type(exc).__name__}: {str(exc)[:160]}", flush=True)


def main() -> None:
    for which, env in (("graphs", {}), ("cudnn", {"MLX_CUDA_USE_CUDNN_SDPA": "1"})):
        for check in (None, "0"):
            e = dict(os.environ, **env)
            e.pop("MLX_ENABLE_CACHE_THRASHING_CHECK", None)
            if check is not None:
                e["MLX_ENABLE_CACHE_THRASHING_CHECK"] = check
            label = f"{which}, check {'as shipped' if check is None else '=' + check}"
            print(f"{label}: ", end="", flush=True)
            subprocess.run([sys.executable, __file__, which], env=e, check=True, timeout=240)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        main()
