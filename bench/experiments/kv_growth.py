"""What a 64-row batch's first growth past 4,096 positions costs, in a fresh process.

    python bench/experiments/kv_growth.py [--one SCENARIO] [--rows 64] [--length 4096]

The served long-prompt stall (design/performance.md, fifteenth round) is one
eager decode step at a full 4,096-position buffer, 64 rows: mlx-lm's
``BatchKVCache`` then grows every layer's keys and values by 256 positions
(``mx.concatenate`` of the old buffer and new zeros). This builds llama-1b's
cache shape (16 layers, 8 KV heads, dim 64, bf16) filled to ``length``, then
times single-token ``update_and_fetch`` steps across the growth, split into
building the graph, queueing it (``mx.async_eval``) and waiting for it. Each
scenario runs in its own process (the first growth is the one that matters):

* ``plain``: MLX's allocator as it is;
* ``keep``: after :func:`trio_mlx._cuda_pool.keep_memory` (the server's start-up).

Each process grows twice: a first set of caches, then a second, fresh set.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any


def grow(label: str, rows: int, length: int, steps: int = 3) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    layers, heads, dim = 16, 8, 64
    caches: list[Any] = [BatchKVCache(left_padding=[0] * rows) for _ in range(layers)]
    prompt = mx.zeros((rows, heads, length, dim), dtype=mx.bfloat16)
    mx.eval([c.update_and_fetch(prompt, prompt) for c in caches])
    del prompt
    one = mx.ones((rows, heads, 1, dim), dtype=mx.bfloat16)
    mx.synchronize()
    for step in range(steps):
        before = caches[0].keys.shape[2]
        t0 = time.perf_counter()
        outs = [c.update_and_fetch(one, one) for c in caches]
        t1 = time.perf_counter()
        mx.async_eval(outs)  # type: ignore[no-untyped-call]
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        print(
            f"{label} step {step}: buffer {before} -> {caches[0].keys.shape[2]}; built "
            f"{(t1 - t0) * 1e3:.1f} ms, queued {(t2 - t1) * 1e3:.1f} ms, waited "
            f"{(t3 - t2) * 1e3:.1f} ms; active {mx.get_active_memory() >> 20} MiB, cached "
            f"{mx.get_cache_memory() >> 20} MiB, peak {mx.get_peak_memory() >> 20} MiB",
            flush=True,
        )


def one(scenario: str, rows: int, length: int) -> None:
    import mlx.core as mx

    if scenario == "keep":
        from trio_mlx import _cuda_pool

        print(f"keep_memory: {_cuda_pool.keep_memory()}", flush=True)
    mx.eval(mx.zeros((8,)))
    grow(f"{scenario} first", rows, length)
    grow(f"{scenario} second", rows, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=["plain", "keep"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    args = parser.parse_args()
    if args.one:
        one(args.one, args.rows, args.length)
        return
    for scenario in ("plain", "keep"):
        subprocess.run(
            [sys.executable, __file__, "--one", scenario, "--rows", str(args.rows),
             "--length", str(args.length)],
            check=False,
        )  # fmt: skip


if __name__ == "__main__":
    main()
