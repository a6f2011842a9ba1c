"""Greedy tokens with the fused decode attention on and off (run on CUDA).

``python bench/experiments/kernel_equality.py [MODEL]`` decodes the same mixed
rows greedily (prompts of 5 to 900 tokens, so the batch is left-padded) with
``TRIO_MLX_DECODE_KERNEL=0`` and with the kernel, each run in a process of its
own (the kernel is installed at load), two ways:

* *bare*: mlx-lm's ``BatchGenerator`` on the model, half the rows inserted at
  once and half 20 steps later: the same batches in every run, so any
  difference is the kernel's;
* *engine*: the engine with rows joining at staggered times, twice with the
  kernel off and once on: the engine's batches depend on timing, so the two
  runs without the kernel show how much that alone changes.

It prints how many rows produced the same tokens and where the others first
differ. MODEL defaults to the bundled model (float32 and trained: its argmax
rarely ties).
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


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    lengths = (5, 40, 300, 900)
    return [[rng.randrange(3, 3000) for _ in range(rng.choice(lengths))] for _ in range(ROWS)]


def _bare(model_path: str) -> list[list[int]]:
    """Greedy tokens from mlx-lm's ``BatchGenerator``, the same batches every run."""
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    from trio_mlx._accel.decode_attention import install

    model, _ = mlx_lm.load(model_path)
    install(model)
    prompts = _prompts()
    gen = BatchGenerator(model, completion_batch_size=ROWS, prefill_batch_size=ROWS)
    out: dict[int, list[int]] = {}
    half = ROWS // 2
    uids = gen.insert(prompts[:half], max_tokens=[TOKENS] * half)
    steps = 0
    try:
        while len(out) < ROWS or any(len(t) < TOKENS for t in out.values()):
            if steps == 20:
                uids += gen.insert(prompts[half:], max_tokens=[TOKENS] * (ROWS - half))
            responses = gen.next_generated()
            steps += 1
            for r in responses:
                out.setdefault(r.uid, []).append(r.token)
            if not responses and steps > 20:
                break
    finally:
        gen.close()
    return [out.get(uid, []) for uid in uids]


def _engine(model: str) -> list[list[int]]:
    """Every row's greedy tokens through the engine, rows joining at staggered times."""
    import trio

    from trio_mlx import SamplingParams, open_engine

    prompts = _prompts()
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


def _run(how: str, model: str, kernel: str) -> list[list[int]]:
    env = {**os.environ, "TRIO_MLX_DECODE_KERNEL": kernel}
    done = subprocess.run(
        [sys.executable, __file__, "--child", how, model], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    runs: list[list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return runs


def _compare(name: str, a: list[list[int]], b: list[list[int]]) -> None:
    same = 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x == y:
            same += 1
            continue
        pairs = enumerate(zip(x, y, strict=False))
        at = next((t for t, (p, q) in pairs if p != q), min(len(x), len(y)))
        print(f"  {name} row {i}: first difference at token {at} of {len(x)}/{len(y)}")
    lengths = sorted({len(r) for r in b})
    print(f"{name}: {same}/{len(a)} rows equal token for token; lengths {lengths}", flush=True)


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        how, model = sys.argv[2], sys.argv[3]
        print(json.dumps(_bare(model) if how == "bare" else _engine(model)))
        return
    from trio_mlx.default_model import default_model_path

    model = sys.argv[1] if len(sys.argv) > 1 else str(default_model_path())
    _compare("bare, kernel off vs on", _run("bare", model, "0"), _run("bare", model, "1"))
    off = _run("engine", model, "0")
    _compare("engine, off vs off", off, _run("engine", model, "0"))
    _compare("engine, off vs on", off, _run("engine", model, "1"))


if __name__ == "__main__":
    main()
