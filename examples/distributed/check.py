"""Run under ``mlx.launch``: greedy completions from a model sharded over the ranks.

    mlx.launch -n 2 --backend ring examples/distributed/check.py MODEL OUT.json

Rank 0 serves the requests through ``open_engine`` and writes their token ids
(and decode timings with ``--bench``) to OUT.json; the other ranks follow.
Run without ``mlx.launch``, the same script computes the same outputs in one
process, for comparison (``tests/test_distributed.py`` does both).
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
from trio_mlx.distributed import follow, follower_rank

#: Prompts as token ids: the outputs do not depend on a tokenizer's text handling.
PROMPTS = [[1, 5, 9, 13], [2, 7], [3, 3, 3, 3, 3, 3], [11, 4, 8], [6], [10, 12, 14, 16, 18]]
MAX_TOKENS = 12


GREEDY = trio_mlx.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


async def tokens_of(engine: Any, prompt: list[int], params: Any) -> list[int]:
    return list((await engine.complete(prompt, params)).token_ids)


async def cancel_after(engine: Any, prompt: list[int], params: Any, seen: int = 3) -> None:
    """Stream ``prompt`` and walk away after ``seen`` tokens (the engine cancels it)."""
    async with engine.generate(prompt, params) as stream:
        got = 0
        async for delta in stream:
            got += len(delta.token_ids)
            if got >= seen:
                break


async def completions(engine: Any) -> dict[str, Any]:
    """Greedy outputs of every kind of work the engine mirrors, in a fixed order."""
    out: dict[str, Any] = {}
    batched: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        batched[i] = await tokens_of(engine, PROMPTS[i], GREEDY)

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    out["batched"] = batched
    # A batch row cancelled after a few tokens: the batch goes on without it.
    await cancel_after(engine, PROMPTS[0], trio_mlx.SamplingParams(max_tokens=200))
    out["after_cancel"] = await tokens_of(engine, PROMPTS[1], GREEDY)
    # The serial lane: a seed, a quantized KV cache (greedy, so comparable).
    seeded = trio_mlx.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=3)
    quantized = trio_mlx.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, kv_bits=8, kv_group_size=32
    )
    out["serial"] = [
        await tokens_of(engine, PROMPTS[2], seeded),
        await tokens_of(engine, PROMPTS[3], quantized),
    ]
    # A serial generation cancelled mid-way, then another one.
    await cancel_after(engine, PROMPTS[4], trio_mlx.SamplingParams(max_tokens=200, seed=1))
    out["after_serial_cancel"] = await tokens_of(engine, PROMPTS[5], seeded)
    # Preemption: a serial request arrives while long rows decode; they are
    # parked (drain_timeout is short), it runs alone, they resume.
    long = trio_mlx.SamplingParams(max_tokens=160, temperature=0.0)
    rows: list[list[int]] = [[] for _ in range(3)]
    started = trio.Event()

    async def row(i: int) -> None:
        async with engine.generate(PROMPTS[i], long) as stream:
            async for delta in stream:
                rows[i].extend(delta.token_ids)
                if i == 0 and len(rows[i]) >= 2:
                    started.set()

    preempting: list[int] = []

    async def interloper() -> None:
        await started.wait()
        preempting.extend(await tokens_of(engine, PROMPTS[3], seeded))

    before = engine.statistics().preemptions
    async with trio.open_nursery() as nursery:
        for i in range(len(rows)):
            nursery.start_soon(row, i)
        nursery.start_soon(interloper)
    out["preempted_rows"] = rows
    out["preempting"] = preempting
    out["preemptions"] = engine.statistics().preemptions - before
    # The prompt cache: the second identical prompt reuses the first one's KV cache.
    prompt = PROMPTS[5] * 4
    first = await engine.complete(prompt, GREEDY)
    second = await engine.complete(prompt, GREEDY)
    out["repeat"] = [list(first.token_ids), list(second.token_ids)]
    out["repeat_cached"] = second.result.cached_tokens
    # Sampled rows run too (their tokens depend on float rounding, so only
    # their count is compared).
    sampled = trio_mlx.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9)
    out["sampled_lengths"] = [len(await tokens_of(engine, PROMPTS[i], sampled)) for i in range(2)]
    out["staggered"] = await staggered(engine)
    return out


async def staggered(engine: Any) -> list[list[int]]:
    """Prompts arrive while a row decodes: a short one, then a long one (with
    ``--prefill-stall``, rank 0's planner has timed both kinds of step by then and cuts
    the long one into chunks from its own clock: every rank must cut alike)."""
    decoding = trio_mlx.SamplingParams(max_tokens=48, temperature=0.0)
    tokens: list[int] = []
    short: list[int] = []
    late: list[int] = []
    async with engine.generate(PROMPTS[0], decoding) as stream:
        async for delta in stream:
            tokens.extend(delta.token_ids)
            if len(tokens) >= 8 and not short:
                short = await tokens_of(engine, PROMPTS[1] * 3, GREEDY)
            if len(tokens) >= 16 and not late:
                late = await tokens_of(engine, [t for p in PROMPTS for t in p] * 6, GREEDY)
    return [tokens, short, late]


async def refusals(engine: Any) -> list[str]:
    """What distributed mode refuses, with its messages (one process: only the unknown adapter)."""
    refused = []
    try:
        await engine.complete(PROMPTS[0], trio_mlx.SamplingParams(max_tokens=2, adapter="x"))
    except trio_mlx.TrioMLXError as exc:
        refused.append(f"{type(exc).__name__}: {exc}")
    try:
        await engine.run_exclusive(lambda model, tokenizer: None)
    except trio_mlx.InvalidRequest as exc:
        refused.append(f"{type(exc).__name__}: {exc}")
    return refused


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
        # No row may end on its own before the follower leaves: EOS is banned.
        no_eos = {int(i): -100.0 for i in engine.tokenizer.eos_token_ids}
        try:
            await engine.complete(
                prompt, trio_mlx.SamplingParams(max_tokens=200, logit_bias=no_eos)
            )
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
        seconds = time.perf_counter() - start
        report = {"errors": errors, "state": state, "seconds": seconds}
        await trio.Path(out).write_text(json.dumps(report))


async def main(
    model: str, out: str, do_bench: bool, parallel: str, idle: float, stall: float | None
) -> None:
    async with trio_mlx.open_engine(
        model, max_batch=8, drain_timeout=0.02, parallel=parallel, prefill_stall=stall
    ) as engine:
        result = await completions(engine)
        result["refused"] = await refusals(engine)
        if idle:
            # Longer than the followers' timeout: rank 0's heartbeats keep them.
            await trio.sleep(idle)
            result["after_idle"] = await tokens_of(engine, PROMPTS[0], GREEDY)
        result["statistics"] = {
            key: getattr(engine.statistics(), key)
            for key in (
                "state",
                "drains",
                "preemptions",
                "steps",
                "cached_prompt_tokens",
                "prompt_token_seconds",
            )
        }
        if do_bench:
            result["tok_s"] = {str(b): await bench(engine, b) for b in (1, 8)}
    await trio.Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--parallel", default="auto", choices=("auto", "tensor", "pipeline"))
    parser.add_argument("--follower-leaves-after", type=int, default=0, metavar="N")
    parser.add_argument("--leader-leaves-after", type=int, default=0, metavar="N")
    parser.add_argument("--follower-stalls", action="store_true")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds to idle mid-way")
    parser.add_argument("--prefill-stall", type=float, default=None, help="open_engine's")
    args = parser.parse_args()
    if follower_rank() is not None:
        if args.follower_stalls:
            # Test only: the follower joins the group, then never loads nor answers.
            import mlx.core as mx

            mx.distributed.init()
            time.sleep(60)
            sys.exit(4)
        if args.follower_leaves_after:
            # Test only: the follower vanishes after N lane commands, mid-generation.
            from trio_mlx._dist.leader import Channel

            receive, count = Channel.receive, [0]

            def leaving(self: Channel) -> Any:
                count[0] += 1
                if count[0] > args.follower_leaves_after:
                    os._exit(0)
                return receive(self)

            Channel.receive = leaving  # type: ignore[method-assign]
        sys.exit(follow(args.model))
    if args.leader_leaves_after:
        # Test only: rank 0 vanishes after N messages; the followers must not wait forever.
        from trio_mlx._dist.leader import Channel

        send, sent = Channel.send, [0]

        def vanishing(self: Channel, obj: Any) -> None:
            sent[0] += 1
            if sent[0] > args.leader_leaves_after:
                os._exit(0)
            send(self, obj)

        Channel.send = vanishing  # type: ignore[method-assign]
    if args.follower_leaves_after:
        trio.run(lose_follower, args.model, args.out)
    else:
        trio.run(
            main, args.model, args.out, args.bench, args.parallel, args.idle, args.prefill_stall
        )
