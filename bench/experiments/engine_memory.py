"""Memory held by the engine under sustained mixed traffic, with and without the prompt cache.

Runs ``--requests`` completions on the bundled model (random prompts of 5-60 words,
4-48 tokens each, ``--concurrency`` at a time) through ``open_engine`` in this
process and prints, every 250 requests, the process RSS, MLX's active / cache /
peak memory and what the prompt cache counts (``PromptCache.nbytes``). The
prompt cache must hold about what it counts: before finished rows' caches were
evaluated on store, MLX's active memory was 1.0-1.5 GB under a 36 MB count.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/experiments/engine_memory.py --cache-bytes 268435456
    ... --cache-bytes 0   # the prompt cache off
"""

from __future__ import annotations

import argparse
import gc
import random
from pathlib import Path

import trio

import trio_mlx


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def main(cache_bytes: int, requests: int, concurrency: int) -> None:
    import mlx.core as mx

    rng = random.Random(0)
    readme = Path(__file__).parents[2] / "README.md"
    words = (await trio.Path(readme).read_text()).split()
    mib = 2**20
    async with trio_mlx.open_engine(None, max_batch=32, prompt_cache_bytes=cache_bytes) as engine:
        done = 0
        limiter = trio.Semaphore(concurrency)

        async def one() -> None:
            nonlocal done
            async with limiter:
                prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 60)))
                params = trio_mlx.SamplingParams(max_tokens=rng.randrange(4, 48))
                await engine.complete(prompt, params)
                done += 1

        for _ in range(requests // 250):
            async with trio.open_nursery() as nursery:
                for _ in range(250):
                    nursery.start_soon(one)
            gc.collect()
            cache = engine._loaded.prompt_cache
            counted = f"{cache.nbytes / mib:.1f}" if cache is not None else "-"
            print(
                f"requests {done}: RSS {rss_mib():.0f} MiB, MLX active "
                f"{mx.get_active_memory() / mib:.1f} MiB, cache {mx.get_cache_memory() / mib:.1f} "
                f"MiB, peak {mx.get_peak_memory() / mib:.1f} MiB; prompt cache counts {counted} MiB",
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    trio.run(main, args.cache_bytes, args.requests, args.concurrency)
