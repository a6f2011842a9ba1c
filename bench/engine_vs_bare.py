"""Decode throughput: the engine against a bare mlx-lm ``BatchGenerator`` loop.

Same random llama, same prompts, greedy, ``--tokens`` tokens per row, at
batch sizes B (default 1, 8, 32), side by side in one run. The engine runs B
concurrent ``engine.generate`` consumers; the bare loop inserts B rows into
one ``BatchGenerator`` and calls ``next()`` until they are done. Both count
the tokens actually generated (greedy, so the two produce the same ones).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/engine_vs_bare.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import trio

import trio_mlx
from trio_mlx.testing import make_random_llama

#: The MLX thread's busy fraction in each engine run: the rest is the engine's own overhead.
BUSY: list[float] = []


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def bare(path: Path, rows: list[list[int]], tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) for a bare BatchGenerator loop, on its own thread."""
    out: list[tuple[int, float]] = []

    def run() -> None:
        import mlx_lm
        from mlx_lm.generate import BatchGenerator

        model, tokenizer = mlx_lm.load(str(path))
        gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in tokenizer.eos_token_ids],
            completion_batch_size=len(rows),
            prefill_batch_size=min(len(rows), 8),
        )
        gen.insert(rows[:1], max_tokens=[4])  # warm up
        while gen.next_generated() or len(gen._generation_batch):
            pass
        start = time.perf_counter()
        gen.insert(rows, max_tokens=[tokens] * len(rows))
        count, live = 0, len(rows)
        while live:
            for response in gen.next_generated():
                count += 1
                if response.finish_reason is not None:
                    live -= 1
        out.append((count, time.perf_counter() - start))
        gen.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


async def engine(path: Path, rows: list[list[int]], tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) for B concurrent engine.generate consumers."""
    params = trio_mlx.SamplingParams(max_tokens=tokens)
    async with trio_mlx.open_engine(path, max_batch=len(rows), prompt_cache_bytes=0) as eng:

        async def one(row: list[int]) -> None:
            async with eng.generate(row, params) as stream:
                async for _delta in stream:
                    pass

        busy = eng.statistics().worker_busy_seconds
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for row in rows:
                nursery.start_soon(one, row)
        elapsed = time.perf_counter() - start
        stats = eng.statistics()
        generated = stats.generated_tokens
        BUSY.append((stats.worker_busy_seconds - busy) / elapsed)
    return generated, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, alternating")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        vocab = 2048
        path = make_random_llama(
            Path(tmp) / "bench-llama",
            vocab_size=vocab,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=512,
        )
        print(
            f"{'B':>4} {'bare tok/s':>11} {'engine tok/s':>13} {'best ratio':>11}"
            f" {'median paired ratio':>20} {'MLX thread busy':>16}"
            f"  (best of {args.repeats}; pairs run back to back)"
        )
        for batch in args.batches:
            rows = prompts(batch, args.prompt, vocab)
            bare_rates, engine_rates = [], []
            BUSY.clear()
            for _ in range(args.repeats):
                count, seconds = bare(path, rows, args.tokens)
                bare_rates.append(count / seconds)
                count, seconds = trio.run(engine, path, rows, args.tokens)
                engine_rates.append(count / seconds)
            paired = statistics.median(e / b for e, b in zip(engine_rates, bare_rates, strict=True))
            print(
                f"{batch:>4} {max(bare_rates):>11.1f} {max(engine_rates):>13.1f}"
                f" {max(engine_rates) / max(bare_rates):>11.3f} {paired:>20.3f}"
                f" {statistics.median(BUSY):>16.1%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
