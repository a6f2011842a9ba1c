"""The batch lane with its decode step traced against the model's own: tokens and step time.

``python bench/experiments/traced_lane.py [MODEL] [ROWS] [TOKENS]`` (default
``llama-1b``, 32 rows, 96 tokens) loads the model as the engine does, then runs
the same greedy rows (chat-sized prompts, admitted together) through two
lanes, the model's own decode step and the traced one
(:mod:`trio_mlx._accel.traced_decode`), alternating twice. It prints each run's
median step time once every row decodes, the traced lane's traced and eager
step counts, and how many rows' tokens equal the other lane's (bf16 on a GPU:
fused kernels may round differently, so a row can part after some tokens; the
first differing position is printed).
"""

from __future__ import annotations

import statistics
import sys
import time

from bench.suite import models
from bench.suite.inproc import prompt_ids

from trio_mlx import SamplingParams
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx._start.loading import LoadSettings, load


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    loaded = load(str(models.prepare(name).path), LoadSettings(max_batch=rows))
    prompts = prompt_ids(loaded.tokenizer, rows, 100, seed=5)
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    specs = [RowSpec(i, tuple(p), params) for i, p in enumerate(prompts)]

    def run(traced: bool) -> tuple[dict[int, list[int]], float, BatchLane]:
        lane = BatchLane(loaded.model, loaded.tokenizer, rows, traced_decode=traced)
        lane.prefill_budget = loaded.lane.prefill_budget
        out: dict[int, list[int]] = {}
        gaps = []
        plan = StepPlan(specs)
        while plan.inserts or lane.rows:
            t0 = time.perf_counter()
            result = lane.step(plan)
            gap = time.perf_counter() - t0
            plan = StepPlan()
            for e in result.events:
                out.setdefault(e.id, []).extend(e.token_ids)
            if len(out) == rows and all(len(v) < tokens for v in out.values()):
                gaps.append(gap)
        return out, statistics.median(gaps[2:]), lane

    print(f"{name}: {rows} rows, {tokens} tokens each, prompts of 100 words", flush=True)
    for rnd in range(2):
        got, t_traced, lane = run(True)
        want, t_eager, _ = run(False)
        same = sum(got[i] == want[i] for i in range(rows))
        parted = [
            next(j for j, (a, b) in enumerate(zip(got[i], want[i], strict=True)) if a != b)
            for i in range(rows)
            if got[i] != want[i]
        ]
        traced = lane.traced
        counts = f"{traced.traced_steps} traced, {traced.eager_steps} eager" if traced else "off"
        print(
            f"  round {rnd}: eager {t_eager * 1e3:.2f} ms/step, traced {t_traced * 1e3:.2f} "
            f"(x{t_eager / t_traced:.2f}; {counts}); rows equal {same} of {rows}"
            + (f", the others part at tokens {sorted(parted)}" if parted else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
