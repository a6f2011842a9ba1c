"""The MLX thread's CPU per token in steady decode: the batch lane against a bare loop.

``python bench/experiments/lane_vs_bare_host.py ROWS TOKENS [MODEL]`` (the
bundled model, or a bench model such as ``tiny``) decodes ROWS rows of TOKENS
tokens three times each way, alternating: mlx-lm's
``BatchGenerator.next_generated`` (the bare loop) and ``BatchLane.step``
bursts of 16 (the engine's lane, no actor, no Trio). It prints this thread's
CPU microseconds per generated token (``time.thread_time``: robust on a loaded
box) once every row decodes: after the bare loop's first two steps (it
prefills all ROWS in one pass), and after the lane's last prefill pass (it
admits ``prefill_batch_size`` rows a pass; until the ninth round its window
held those last passes, which made it look costlier). On the GPU that host
work is what paces a step, so a lane costlier than the bare loop here would
show as engine overhead there (numbers in design/performance.md).
"""

from __future__ import annotations

import random
import sys
import time

from bench.suite.loadgen import WORDS
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from trio_mlx import SamplingParams
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx.default_model import default_model_path


def main() -> None:
    rows, tokens = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        from bench.suite import models

        model, tokenizer = load(str(models.prepare(sys.argv[3]).path))
    else:
        model, tokenizer = load(str(default_model_path()))

    def prompt(i: int) -> list[int]:
        rng = random.Random(i)
        return list(tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(40))))

    def bare() -> tuple[float, int]:
        gen = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows)
        gen.insert([prompt(i) for i in range(rows)], max_tokens=[tokens] * rows)
        done = 0
        while done < 2 * rows:
            done += len(gen.next_generated())
        cpu, count = time.thread_time(), 0
        while responses := gen.next_generated():
            count += len(responses)
            if any(r.finish_reason for r in responses):
                break
        cpu = time.thread_time() - cpu
        gen.close()
        return cpu, count

    def lane() -> tuple[float, int]:
        batch = BatchLane(model, tokenizer, max_batch=rows)
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        specs = [RowSpec(i + 1, tuple(prompt(i)), params) for i in range(rows)]
        batch.step(StepPlan(specs, steps=2), seconds=10.0)
        while batch._waiting or batch._prefilling:  # every row decoding, as in the bare loop
            batch.step(StepPlan([], steps=1), seconds=10.0)
        cpu, count = time.thread_time(), 0
        while batch.rows:
            result = batch.step(StepPlan([], steps=16), seconds=10.0)
            count += sum(len(e.token_ids) for e in result.events)
            if any(e.finish_reason for e in result.events):
                break  # a row ended (EOS or max_tokens): the batch is no longer full
        cpu = time.thread_time() - cpu
        batch.close()
        return cpu, count

    for _ in range(3):
        for name, run in (("bare", bare), ("lane", lane)):
            cpu, count = run()
            print(f"{name} B={rows}: {1e6 * cpu / count:.1f} us/token over {count} tokens")


if __name__ == "__main__":
    main()
