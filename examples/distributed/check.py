"""Run under ``mlx.launch``: greedy completions from a model sharded over the ranks.

    mlx.launch -n 2 --backend ring examples/distributed/check.py MODEL OUT.json

Rank 0 serves the requests through ``open_engine`` and writes their token ids
(and decode timings with ``--bench``) to OUT.json; the other ranks follow.
``reference`` computes the same outputs in one process, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import trio

import trio_mlx
from trio_mlx._distributed import follow, follower_rank

#: Prompts as token ids: the outputs do not depend on a tokenizer's text handling.
PROMPTS = [[1, 5, 9, 13], [2, 7], [3, 3, 3, 3, 3, 3], [11, 4, 8], [6], [10, 12, 14, 16, 18]]
MAX_TOKENS = 12


async def completions(engine: Any) -> dict[str, Any]:
    params = trio_mlx.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    batched: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        done = await engine.complete(PROMPTS[i], params)
        batched[i] = list(done.token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    # A request cancelled after a few tokens: the batch goes on without it.
    async with engine.generate(PROMPTS[0], trio_mlx.SamplingParams(max_tokens=200)) as stream:
        seen = 0
        async for delta in stream:
            seen += len(delta.token_ids)
            if seen >= 3:
                break
    after = list((await engine.complete(PROMPTS[1], params)).token_ids)
    return {"batched": batched, "after_cancel": after}


async def bench(engine: Any, batch: int, tokens: int = 64) -> float:
    params = trio_mlx.SamplingParams(max_tokens=tokens, temperature=0.0)
    start = time.perf_counter()
    total = 0

    async def one(i: int) -> None:
        nonlocal total
        done = await engine.complete(PROMPTS[i % len(PROMPTS)], params)
        total += len(done.token_ids)

    async with trio.open_nursery() as nursery:
        for i in range(batch):
            nursery.start_soon(one, i)
    return total / (time.perf_counter() - start)


async def lose_follower(model: str, out: str) -> None:
    """The follower leaves mid-generation: every request must end with an error, quickly."""
    errors: list[str] = []
    start = time.perf_counter()

    async def one(engine: Any, prompt: list[int]) -> None:
        try:
            await engine.complete(prompt, trio_mlx.SamplingParams(max_tokens=200))
            errors.append("finished")
        except trio_mlx.TrioMLXError as exc:
            errors.append(type(exc).__name__)

    async with trio_mlx.open_engine(model, max_batch=8) as engine:
        async with trio.open_nursery() as nursery:
            for prompt in PROMPTS:
                nursery.start_soon(one, engine, prompt)
        state = engine.statistics().state
        # Written before leaving the engine: its MLX thread is stuck in a
        # collective, and the watchdog ends the process (status 1) shortly.
        with open(out, "w") as f:
            seconds = time.perf_counter() - start
            json.dump({"errors": errors, "state": state, "seconds": seconds}, f)


async def main(model: str, out: str, do_bench: bool) -> None:
    async with trio_mlx.open_engine(model, max_batch=8) as engine:
        result = await completions(engine)
        refused = []
        for params in (trio_mlx.SamplingParams(max_tokens=2, seed=1),):
            try:
                await engine.complete(PROMPTS[0], params)
            except trio_mlx.InvalidRequest as exc:
                refused.append(str(exc))
        result["refused"] = refused
        if do_bench:
            result["tok_s"] = {str(b): await bench(engine, b) for b in (1, 8)}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--follower-leaves-after", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if follower_rank() is not None:
        if args.follower_leaves_after:
            # Test only: the follower vanishes after N lane commands, mid-generation.
            from trio_mlx._distributed import Channel

            receive, count = Channel.receive, [0]

            def leaving(self: Channel) -> Any:
                count[0] += 1
                if count[0] > args.follower_leaves_after:
                    os._exit(0)
                return receive(self)

            Channel.receive = leaving  # type: ignore[method-assign]
        sys.exit(follow(args.model))
    if args.follower_leaves_after:
        trio.run(lose_follower, args.model, args.out)
    trio.run(main, args.model, args.out, args.bench)
