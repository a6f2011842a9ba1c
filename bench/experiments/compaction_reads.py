"""Compaction and prompt-batch splits: mlx-lm's per-layer reads against the lane's one read.

``python bench/experiments/compaction_reads.py [MODEL] [ROWS] [ROUNDS]`` (default the
bundled model, 150 rows, 3 rounds) loads the model as the engine does and runs a churn
through the batch lane: up to 24 rows decoding, up to 4 arriving per step with random
prompts (20-80 tokens, every tenth 600) and lengths (16-96 tokens), 128 prompt tokens
prefilled per step, until ``ROWS`` rows have finished. It runs twice per round, once
with the lane's ``filter_caches``, ``extract_row`` and split, and once with mlx-lm's
``BatchKVCache.filter`` and ``extract`` (whose ``tolist`` per layer waits for the
decode step still running) and its ``split`` (a deep copy of the prompt batch's caches,
then two filters), with dead rows removed at once (``removal_delay`` 0, the CPU's
setting) and after up to 16 steps (the GPU's). It prints tok/s, the host time per
compaction and per partial split of the prompt batch (median, mean), and checks that
every row's tokens are the same both ways.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from bench.suite import models

from trio_mlx import SamplingParams
from trio_mlx._lanes import batch
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx._start.loading import LoadSettings, load


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "default"
    total = int(sys.argv[2]) if len(sys.argv) > 2 else 150
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    loaded = load(str(models.prepare(name).path), LoadSettings(max_batch=32))
    lanes_own = batch.plain_batch
    compact = BatchLane._compact
    prompt_class = batch.prompt_class()
    split = prompt_class.split
    spent: list[float] = []
    splits: list[float] = []

    def timed(lane: BatchLane) -> None:
        t0 = time.perf_counter()
        compact(lane)
        spent.append(time.perf_counter() - t0)

    def timed_split(prompts: Any, indices: list[int]) -> Any:
        t0 = time.perf_counter()
        moved = split(prompts, indices)
        if prompts.uids:  # rows were left behind: a partial split
            splits.append(time.perf_counter() - t0)
        return moved

    BatchLane._compact = timed  # type: ignore[method-assign]
    prompt_class.split = timed_split

    def run(one_read: bool, delay: int) -> tuple[dict[int, list[int]], float]:
        batch.plain_batch = lanes_own if one_read else (lambda caches: False)
        rng = random.Random(0)
        lane = BatchLane(loaded.model, loaded.tokenizer, 32, prefill_budget=128)
        lane.removal_delay = delay
        out: dict[int, list[int]] = {}
        arrived = 0
        t0 = time.perf_counter()
        while arrived < total or lane.rows:
            specs = []
            while lane.rows + len(specs) < 24 and arrived < total and len(specs) < 4:
                n = 600 if arrived % 10 == 9 else rng.randint(20, 80)
                prompt = tuple(rng.randint(1, 200) for _ in range(n))
                params = SamplingParams(max_tokens=rng.randint(16, 96), temperature=0.0)
                specs.append(RowSpec(arrived, prompt, params))
                arrived += 1
            for e in lane.step(StepPlan(specs)).events:
                out.setdefault(e.id, []).extend(e.token_ids)
        return out, time.perf_counter() - t0

    print(f"{name}: {total} rows, up to 24 decoding", flush=True)
    want: dict[int, Any] = {}
    for rnd in range(rounds):
        for delay in (0, 16):
            for one_read in (True, False):
                spent.clear()
                splits.clear()
                out, wall = run(one_read, delay)
                if delay in want:
                    assert out == want[delay], "the rows' tokens differ"
                want[delay] = out
                tokens = sum(len(v) for v in out.values())
                print(
                    f"  round {rnd} removal_delay {delay:2d} "
                    f"{'one read' if one_read else 'mlx-lm  '}: {tokens / wall:,.0f} tok/s, "
                    f"{len(spent)} compactions, {statistics.median(spent) * 1e3:.2f} ms median, "
                    f"{statistics.mean(spent) * 1e3:.2f} ms mean; {len(splits)} partial splits, "
                    f"{statistics.median(splits or [0]) * 1e3:.2f} ms median, "
                    f"{statistics.mean(splits or [0]) * 1e3:.2f} ms mean",
                    flush=True,
                )


if __name__ == "__main__":
    main()
