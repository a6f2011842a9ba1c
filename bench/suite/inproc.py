"""In-process measurements, in a worker process of their own (one model load each).

``python -m bench.suite.inproc JSON`` runs the jobs the JSON names and prints one
JSON line per job result. Jobs:

* ``bare``: a bare mlx-lm ``BatchGenerator`` loop, B rows of the same prompts and
  ``max_tokens`` as the engine gets, greedy, no stop tokens;
* ``engine``: ``engine.generate`` with B concurrent consumers in one Trio task each;
* ``memory``: N mixed requests through the engine; RSS and MLX active/cache/peak memory;
* ``closed``: the bare references of the continuous-traffic part: a closed loop of B
  rows, either all inserted (and finishing) together, or with staggered finishes and
  each finished row replaced at once, as streaming clients do.
* ``structured``: ``engine.generate`` at each B with every row constrained to a JSON
  schema vs unconstrained, alternating; and the compile time of 20 schemas.
* ``multilora``: rows under several LoRA adapters (:mod:`bench.suite.multilora`).

Bare and engine runs alternate per B for ``rounds`` rounds and the best round of
each counts: load on a shared machine only ever slows a round down. The overhead
part also reports medians over the rounds of each engine run against the bare run
just before it: the throughput ratio, the CPU-per-token ratio, the engine's
Trio-thread CPU per token and its MLX thread's busy share.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.suite import embed, multilora, speculative
from bench.suite.jobs import emit, prompt_ids, prompt_text
from bench.suite.timing import rates


def _logits_processors(logit_bias: dict[int, float] | None) -> Any:
    if not logit_bias:
        return None
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(logit_bias=logit_bias)


def bare_run(
    model: Any, prompts: Sequence[Sequence[int]], max_tokens: int, logit_bias: Any
) -> dict[str, Any]:
    """One bare ``BatchGenerator`` run of ``prompts``; rates as in :mod:`bench.suite.timing`."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    batch = len(prompts)
    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        completion_batch_size=batch,
        logits_processors=_logits_processors(logit_bias),
    )
    rows: dict[int, list[tuple[float, int]]] = {}
    try:
        cpu = time.process_time()
        start = time.perf_counter()
        uids = gen.insert([list(p) for p in prompts], max_tokens=[max_tokens] * batch)
        rows = {uid: [] for uid in uids}
        done = 0
        while done < batch:
            responses = gen.next_generated()
            now = time.perf_counter()
            for r in responses:
                rows[r.uid].append((now, 1))
                done += r.finish_reason is not None
        mx.synchronize()
        cpu = time.process_time() - cpu
    finally:
        gen.close()
    result = rates(start, list(rows.values()))
    result["complete"] = all(len(row) == max_tokens for row in rows.values())
    result["cpu_s_per_token"] = cpu / max(1, result["tokens"])
    return result


async def engine_run(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    logit_bias: Any,
    schemas: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """B concurrent ``engine.generate`` consumers of ``prompts``; same rates as the bare loop.

    With ``schemas``, row i is constrained to ``schemas[i % len(schemas)]``.
    """
    import trio

    from trio_mlx import SamplingParams

    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logit_bias=logit_bias,
            json_schema=schemas[i % len(schemas)] if schemas else None,
        )
        for i in range(len(prompts))
    ]
    rows: list[list[tuple[float, int]]] = [[] for _ in prompts]

    async def consume(i: int) -> None:
        async with engine.generate(list(prompts[i]), params[i]) as stream:
            async for delta in stream:
                if delta.token_ids:
                    rows[i].append((time.perf_counter(), len(delta.token_ids)))

    busy = engine.statistics().worker_busy_seconds
    trio_cpu, cpu = time.thread_time(), time.process_time()
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(consume, i)
    elapsed = time.perf_counter() - start
    trio_cpu, cpu = time.thread_time() - trio_cpu, time.process_time() - cpu
    result = rates(start, rows)
    result["complete"] = all(sum(n for _, n in row) == max_tokens for row in rows)
    # The engine's own cost, which a busy shared machine shows least noisily: CPU
    # seconds per token (all threads), the Trio thread's CPU per token (actor,
    # routing, consumers) and the share of the wall time the MLX thread ran calls.
    tokens = max(1, result["tokens"])
    result["cpu_s_per_token"] = cpu / tokens
    result["trio_cpu_us_per_token"] = trio_cpu / tokens * 1e6
    result["worker_busy"] = (engine.statistics().worker_busy_seconds - busy) / elapsed
    return result


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    key = "decode_tok_s" if all(r["decode_tok_s"] for r in runs) else "e2e_tok_s"
    best = max(runs, key=lambda r: r[key])
    return {**best, "rounds": [r[key] for r in runs]}


def _paired(bare: list[dict[str, Any]], eng: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds, each engine run against the bare run just before it."""
    key = "decode_tok_s" if all(r["decode_tok_s"] for r in bare + eng) else "e2e_tok_s"
    return {
        "ratio": statistics.median(e[key] / b[key] for b, e in zip(bare, eng, strict=True)),
        "cpu_ratio": statistics.median(
            e["cpu_s_per_token"] / b["cpu_s_per_token"] for b, e in zip(bare, eng, strict=True)
        ),
        "trio_cpu_us_per_token": statistics.median(e["trio_cpu_us_per_token"] for e in eng),
        "worker_busy": statistics.median(e["worker_busy"] for e in eng),
    }


def overhead(job: dict[str, Any]) -> None:
    """Engine vs bare at each B, alternating, best of ``rounds``; prints one line per B."""
    import mlx_lm
    import trio

    import trio_mlx

    model, tokenizer = mlx_lm.load(job["model"])
    bias = {int(k): v for k, v in job["logit_bias"].items()} if job["logit_bias"] else None
    max_tokens, rounds = job["max_tokens"], job["rounds"]
    prompts_for = {b: prompt_ids(tokenizer, b, job["prompt_len"], seed=b) for b in job["batches"]}
    # Warm up the bare loop's kernels for every B before timing anything.
    for b in job["batches"]:
        bare_run(model, prompts_for[b], 4, bias)

    async def main() -> None:
        async with trio_mlx.open_engine(job["model"], max_batch=max(job["batches"])) as engine:
            for b in job["batches"]:
                await engine_run(engine, prompts_for[b], 4, bias)
            for b in job["batches"]:
                bare, eng = [], []
                for _ in range(rounds):
                    bare.append(bare_run(model, prompts_for[b], max_tokens, bias))
                    eng.append(await engine_run(engine, prompts_for[b], max_tokens, bias))
                emit(
                    {
                        "job": "overhead",
                        "batch": b,
                        "bare": _best(bare),
                        "engine": _best(eng),
                        "paired": _paired(bare, eng),
                    }
                )

    if job.get("engine", True):
        trio.run(main)
        return
    for b in job["batches"]:
        runs = [bare_run(model, prompts_for[b], max_tokens, bias) for _ in range(rounds)]
        emit({"job": "overhead", "batch": b, "bare": _best(runs), "engine": None})


def memory_now() -> dict[str, int]:
    import mlx.core as mx

    out = {
        "mlx_active": mx.get_active_memory(),
        "mlx_peak": mx.get_peak_memory(),
        # Freed buffers MLX keeps for reuse: on CUDA they are managed memory, which the
        # host may have touched, so they can show in the RSS.
        "mlx_cache": mx.get_cache_memory(),
    }
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def memory(job: dict[str, Any]) -> None:
    """``requests`` mixed requests (lengths, sampling, some serial), ``concurrency`` at a time."""
    import trio

    import trio_mlx
    from trio_mlx import SamplingParams

    bias = {int(k): v for k, v in job["logit_bias"].items()} if job["logit_bias"] else None
    total, marks = job["requests"], sorted({job["mark"], job["requests"]})
    snapshots: dict[str, Any] = {}
    rng = random.Random(0)
    done = 0

    async def worker(engine: Any, work: Any) -> None:
        nonlocal done
        async for i in work:
            words = rng.randint(4, job["max_prompt_words"])
            params = SamplingParams(
                max_tokens=rng.randint(4, job["max_tokens"]),
                temperature=rng.choice((0.0, 0.7)),
                seed=i if i % job["serial_every"] == 0 else None,
                logit_bias=bias,
            )
            async with engine.generate(prompt_text(rng, words), params) as stream:
                async for _ in stream:
                    pass
            done += 1
            if done in marks:
                snapshots[str(done)] = memory_now()

    async def main() -> None:
        send, receive = trio.open_memory_channel[int](0)
        async with trio_mlx.open_engine(job["model"], max_batch=job["concurrency"]) as engine:
            snapshots["0"] = memory_now()
            async with trio.open_nursery() as nursery:
                for _ in range(job["concurrency"]):
                    nursery.start_soon(worker, engine, receive.clone())
                async with send:
                    for i in range(total):
                        await send.send(i)
                        if i % max(1, total // 10) == 0:
                            print(f"memory: {i}/{total} requests", file=sys.stderr, flush=True)
                receive.close()

    start = time.perf_counter()
    trio.run(main)
    emit({"job": "memory", "snapshots": snapshots, "seconds": time.perf_counter() - start})


def closed_loop(job: dict[str, Any]) -> None:
    """Bare ``BatchGenerator`` closed loops of B rows: ``together`` and ``staggered``."""
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = mlx_lm.load(job["model"])
    if job.get("kernel"):  # optional: the bare loop with trio-mlx's decode attention
        from trio_mlx._accel.decode_attention import install

        install(model)
    length, max_tokens = job["prompt_len"], job["max_tokens"]
    pool = prompt_ids(tokenizer, 64, length, seed=7)
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [list(rng.choice(pool)) for _ in range(n)]

    def run(b: int, staggered: bool, seconds: float) -> dict[str, Any]:
        gen = BatchGenerator(model, completion_batch_size=b, prefill_batch_size=min(b, 16))
        first = [max_tokens - (i * max_tokens) // b for i in range(b)] if staggered else None
        gen.insert(prompts(b), max_tokens=first or [max_tokens] * b)
        pending = 0
        tokens = steps = 0
        start = time.perf_counter()
        try:
            while True:
                _, responses = gen.next()
                now = time.perf_counter()
                if now - start >= seconds:
                    break
                steps += 1
                tokens += len(responses)
                pending += sum(1 for r in responses if r.finish_reason)
                if pending and (staggered or pending == b):
                    gen.insert(prompts(pending), max_tokens=[max_tokens] * pending)
                    pending = 0
        finally:
            gen.close()
        wall = time.perf_counter() - start
        return {"tok_s": tokens / wall, "steps": steps, "step_ms": 1000 * wall / max(steps, 1)}

    # Every configuration once before anything is timed: on CUDA the first runs of a
    # process compile kernels (a "together" run right after one warm-up read 59 tok/s).
    for b in job["batches"]:
        for kind in ("together", "staggered"):
            run(b, kind == "staggered", job["warm_seconds"])
    for b in job["batches"]:
        out: dict[str, Any] = {"job": "closed", "batch": b}
        for kind in ("together", "staggered"):
            print(f"SAMPLE start {kind} {b}", flush=True)
            out[kind] = run(b, kind == "staggered", job["seconds"])
            print(f"SAMPLE stop {kind} {b}", flush=True)
        emit(out)


def engine_closed(job: dict[str, Any]) -> None:
    """``engine.generate`` closed loops of C consumers (no HTTP), for each planner variant."""
    from pathlib import Path

    import attrs
    import trio
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    import trio_mlx
    from trio_mlx import SamplingParams

    tokenizer = load_tokenizer(Path(job["model"]))
    pool = prompt_ids(tokenizer, 64, job["prompt_len"], seed=7)
    bias = {int(k): v for k, v in job["logit_bias"].items()} if job["logit_bias"] else None
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, logit_bias=bias)

    async def main() -> None:
        async with trio_mlx.open_engine(job["model"], max_batch=max(job["batches"])) as engine:
            actor = engine._actor
            for variant in job["variants"]:
                # A variant sets planner knobs (actor.planner: admit_*, burst_*; lane: removal_*, prefill_*).
                for key, value in variant.items():
                    lane_knob = key.startswith(("removal", "prefill"))
                    setattr(actor.lane if lane_knob else actor.planner, key, value)
                for b in job["batches"]:
                    tokens = 0
                    rng = random.Random(b)
                    before = engine.statistics()
                    start = time.perf_counter()
                    t0, t1 = start + job["warm"], start + job["seconds"]

                    async def consume(
                        i: int, rng: random.Random = rng, t0: float = t0, t1: float = t1, b: int = b
                    ) -> None:
                        nonlocal tokens
                        # Finishes staggered from the start, as streaming clients' are.
                        first = params.max_tokens - (i * params.max_tokens) // b
                        todo = attrs.evolve(params, max_tokens=first)
                        while time.perf_counter() < t1:
                            async with engine.generate(rng.choice(pool), todo) as stream:
                                todo = params
                                async for delta in stream:
                                    if t0 <= time.perf_counter() < t1:
                                        tokens += len(delta.token_ids)

                    async with trio.open_nursery() as nursery:
                        for i in range(b):
                            nursery.start_soon(consume, i)
                    wall = time.perf_counter() - start
                    after = engine.statistics()
                    emit({"job": "engine_closed", "batch": b, "variant": variant,
                          "tok_s": tokens / (job["seconds"] - job["warm"]),
                          "worker_busy": (after.worker_busy_seconds - before.worker_busy_seconds) / wall,
                          "admissions": getattr(after, "admissions", 0) - getattr(before, "admissions", 0),
                          "steps": after.steps - before.steps})  # fmt: skip

    trio.run(main)


def structured(job: dict[str, Any]) -> None:
    """Constrained vs unconstrained decode at each B (alternating, best of rounds), then compiles."""
    from pathlib import Path

    import trio
    from bench.suite.schemas import SCHEMAS, endless
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    import trio_mlx
    from trio_mlx._lanes.structured import GrammarCompiler

    tokenizer = load_tokenizer(Path(job["model"]))
    bias = {int(k): v for k, v in job["logit_bias"].items()} if job["logit_bias"] else None
    max_tokens, rounds = job["max_tokens"], job["rounds"]
    prompts_for = {b: prompt_ids(tokenizer, b, job["prompt_len"], seed=b) for b in job["batches"]}
    # Endless: no row can finish its value within max_tokens, so every row runs them all.
    schemas = [endless(s) for s in SCHEMAS]

    async def main() -> None:
        async with trio_mlx.open_engine(job["model"], max_batch=max(job["batches"])) as engine:
            for b in job["batches"]:
                await engine_run(engine, prompts_for[b], 4, bias)
                await engine_run(engine, prompts_for[b], 4, bias, schemas)
            for b in job["batches"]:
                free, constrained = [], []
                for _ in range(rounds):
                    free.append(await engine_run(engine, prompts_for[b], max_tokens, bias))
                    constrained.append(
                        await engine_run(engine, prompts_for[b], max_tokens, bias, schemas)
                    )
                emit({"job": "structured", "batch": b, "unconstrained": _best(free),
                      "constrained": _best(constrained)})  # fmt: skip

    trio.run(main)
    config = json.loads((Path(job["model"]) / "config.json").read_text())
    compiler = GrammarCompiler(tokenizer, config.get("vocab_size"))
    start = time.perf_counter()
    compiler.llg_tokenizer()
    setup = time.perf_counter() - start
    times = []
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiler.compile(trio_mlx.SamplingParams(json_schema=schema))
        times.append(time.perf_counter() - start)
    emit({"job": "structured_compile", "tokenizer_s": setup, "compile_s": times,
          "vocab": config.get("vocab_size")})  # fmt: skip


def main(argv: Sequence[str]) -> None:
    """Run the job given as a JSON argument."""
    job = json.loads(argv[0])
    kinds = {"overhead": overhead, "memory": memory, "structured": structured,
             "closed": closed_loop, "engine_closed": engine_closed,
             "multilora": multilora.job, "embed": embed.job,
             "spec": speculative.job}  # fmt: skip
    kinds[job["kind"]](job)


if __name__ == "__main__":
    main(sys.argv[1:])
