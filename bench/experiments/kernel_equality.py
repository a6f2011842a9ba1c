"""Greedy tokens with the fused decode attention on and off (run on CUDA).

``python bench/experiments/kernel_equality.py [MODEL]`` runs the same mixed
batch twice through the engine, greedy: rows of different prompt lengths,
joining at staggered times (so the batch is left-padded), once with
``TRIO_MLX_DECODE_KERNEL=0`` and once with the kernel, each in a process of
its own (the kernel is installed at load). It prints how many rows produced
the same tokens and, for any that did not, where they first differ.
MODEL defaults to the bundled model (float32, trained: its argmax rarely ties).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Any

ROWS = 48
TOKENS = 96


def _generate(model: str) -> list[list[int]]:
    """Every row's greedy tokens, rows joining at staggered times."""
    import trio

    from trio_mlx import SamplingParams, open_engine

    rng = random.Random(3)
    prompts = [
        [rng.randrange(3, 3000) for _ in range(rng.choice((5, 40, 300, 900)))] for _ in range(ROWS)
    ]
    out: list[list[int]] = [[] for _ in prompts]

    async def row(engine: Any, i: int) -> None:
        await trio.sleep(0.02 * (i % 12))
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
        async with engine.generate(prompts[i], params) as stream:
            async for delta in stream:
                out[i].extend(delta.token_ids)

    async def main() -> None:
        async with open_engine(model, max_batch=ROWS) as engine, trio.open_nursery() as nursery:
            for i in range(ROWS):
                nursery.start_soon(row, engine, i)

    trio.run(main)
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(_generate(sys.argv[2])))
        return
    from trio_mlx.default_model import default_model_path

    model = sys.argv[1] if len(sys.argv) > 1 else str(default_model_path())
    runs = {}
    for flag in ("0", "1"):
        env = {**os.environ, "TRIO_MLX_DECODE_KERNEL": flag}
        done = subprocess.run(
            [sys.executable, __file__, "--child", model], env=env, capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        runs[flag] = json.loads(done.stdout.strip().splitlines()[-1])
    same = 0
    for i, (off, on) in enumerate(zip(runs["0"], runs["1"], strict=True)):
        if off == on:
            same += 1
            continue
        at = next(
            (t for t, (a, b) in enumerate(zip(off, on, strict=False)) if a != b),
            min(len(off), len(on)),
        )
        print(f"row {i}: first difference at token {at} of {len(off)}/{len(on)}")
    lengths = sorted({len(r) for r in runs["1"]})
    print(f"{same}/{ROWS} rows equal token for token; lengths {lengths}")


if __name__ == "__main__":
    main()
