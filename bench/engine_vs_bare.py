"""Decode throughput: the engine against a bare mlx-lm ``BatchGenerator`` loop.

Same random llama, same prompts, greedy, ``--tokens`` tokens per row, at
batch sizes B (default 1, 8, 32), side by side in one run. The engine runs B
concurrent ``engine.generate`` consumers; the bare loop inserts B rows into
one ``BatchGenerator`` and calls ``next()`` until they are done. Both count
the tokens actually generated (greedy, so the two produce the same ones).

Columns: the best tok/s of each over the runs, the median of the ratios of
back-to-back pairs (the engine run right after its bare run), the share of
wall time the engine's MLX thread spent in calls (the rest it waited for the
actor; MLX's own threads may still be computing the step queued with
``async_eval``), and the ratio of CPU seconds per token (all threads of the
process): the engine's extra work, which is what a busy shared machine shows
least noisily.

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
#: CPU seconds (all threads of this process) per generated token, per run.
CPU: dict[str, list[float]] = {"bare": [], "engine": []}
#: The engine's own work per token, in microseconds: the Trio thread's CPU time
#: (actor, routing, consumers) and the MLX thread's time outside
#: ``BatchGenerator.next()`` (detokenizing, stop strings, events).
OVERHEAD: dict[str, list[float]] = {"trio": [], "worker": []}


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
        cpu = time.process_time()
        start = time.perf_counter()
        gen.insert(rows, max_tokens=[tokens] * len(rows))
        count, live = 0, len(rows)
        while live:
            for response in gen.next_generated():
                count += 1
                if response.finish_reason is not None:
                    live -= 1
        out.append((count, time.perf_counter() - start))
        CPU["bare"].append((time.process_time() - cpu) / count)
        gen.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


async def engine(path: Path, rows: list[list[int]], tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) for B concurrent engine.generate consumers."""
    params = trio_mlx.SamplingParams(max_tokens=tokens)
    # max_batch=1 would send every request to the serial lane: keep the batch lane.
    async with trio_mlx.open_engine(path, max_batch=max(2, len(rows)), prompt_cache_bytes=0) as eng:

        async def one(row: list[int]) -> None:
            async with eng.generate(row, params) as stream:
                async for _delta in stream:
                    pass

        busy = eng.statistics().worker_busy_seconds
        lane = eng._actor.lane
        inside = lane.generator_seconds
        trio_cpu = time.thread_time()
        cpu = time.process_time()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for row in rows:
                nursery.start_soon(one, row)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        trio_cpu = time.thread_time() - trio_cpu
        stats = eng.statistics()
        generated = stats.generated_tokens
        BUSY.append((stats.worker_busy_seconds - busy) / elapsed)
        CPU["engine"].append(cpu / generated)
        worker = stats.worker_busy_seconds - busy - (lane.generator_seconds - inside)
        OVERHEAD["trio"].append(trio_cpu / generated * 1e6)
        OVERHEAD["worker"].append(worker / generated * 1e6)
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
            f" {'median paired ratio':>20} {'MLX thread busy':>16} {'CPU/token ratio':>16}"
            f" {'engine us/token (trio+mlx thread)':>34}"
            f"  (best of {args.repeats}; pairs run back to back)"
        )
        for batch in args.batches:
            rows = prompts(batch, args.prompt, vocab)
            bare_rates, engine_rates = [], []
            BUSY.clear()
            CPU["bare"].clear()
            CPU["engine"].clear()
            OVERHEAD["trio"].clear()
            OVERHEAD["worker"].clear()
            for _ in range(args.repeats):
                count, seconds = bare(path, rows, args.tokens)
                bare_rates.append(count / seconds)
                count, seconds = trio.run(engine, path, rows, args.tokens)
                engine_rates.append(count / seconds)
            paired = statistics.median(e / b for e, b in zip(engine_rates, bare_rates, strict=True))
            print(
                f"{batch:>4} {max(bare_rates):>11.1f} {max(engine_rates):>13.1f}"
                f" {max(engine_rates) / max(bare_rates):>11.3f} {paired:>20.3f}"
                f" {statistics.median(BUSY):>16.1%}"
                f" {statistics.median(CPU['engine']) / statistics.median(CPU['bare']):>16.3f}"
                f" {statistics.median(OVERHEAD['trio']):>20.1f} +"
                f" {statistics.median(OVERHEAD['worker']):>11.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
