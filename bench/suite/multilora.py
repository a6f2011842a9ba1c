"""Part 9: rows under several LoRA adapters in one batch.

Four random LoRA adapters (rank 8, ``q_proj`` and ``v_proj`` of every layer,
float32 weights as ``mlx_lm.lora`` saves them) are written once per run. Then,
in a worker process (:func:`job`):

* **rows**: decode tok/s through the engine (default method) at each B, rows
  spread evenly over 1, 2 and 4 mounted adapters, half base and half over 4,
  against all-base rows in the same engine (the 4 adapters mounted, unused),
  and all-base rows in an engine with no adapter mounted. Steady-state decode
  rate (:mod:`bench.suite.timing`), rounds interleaved, best round counts.
* **serial**: the same 8 requests over the 4 adapters through the batch lane and
  through the serial lane (an engine with ``max_batch=1``: each request alone,
  its adapter put on and taken off), end to end; and 8 base requests both ways, which bounds what batching can gain on
  the machine at all.
* **engine by method**: the rows over 4 adapters (and half base) again, the
  stack rebuilt with each of ``trio_mlx._adapters.multilora.METHODS`` in turn.
* **methods**: the model's decode step (a bare forward over a KV cache, one
  ``mx.eval`` per step) with the stacked layers of each
  ``trio_mlx._adapters.multilora.METHODS``, for the same row mixes, against the base
  model; milliseconds per step, the lower quartile of all rounds' steps. This
  is the per-step cost of the adapted layers alone, without the engine.

``python -m bench.suite --only multilora`` (CPU) or ``--profile gpu --only
multilora``; the section goes into ``results.md`` like the other parts.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.suite.jobs import emit, prompt_ids

ADAPTERS = 4
RANK = 8
#: Adapter rows per case: (label, adapters the adapted rows spread over, share of base rows).
CASES = [
    ("all base, 4 mounted", 0, 1.0),
    ("over 1 adapter", 1, 0.0),
    ("over 2 adapters", 2, 0.0),
    ("over 4 adapters", 4, 0.0),
    ("half base, half over 4", 4, 0.5),
]


def make_adapters(model_path: Path, folder: Path, count: int, rank: int = RANK) -> list[Path]:
    """``count`` random LoRA adapters on ``q_proj`` and ``v_proj`` of every layer, as mlx-lm
    saves them (one model load for all)."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(model_path))
    layers = len(model.layers)
    lora = {"rank": rank, "scale": 2.0, "dropout": 0.0}
    model.freeze()
    linear_to_lora_layers(model, layers, lora)
    shapes = [(k, v.shape) for k, v in tree_flatten(model.trainable_parameters())]
    del model
    paths = []
    for seed in range(count):
        mx.random.seed(seed)
        weights = {k: mx.random.normal(shape) * 0.05 for k, shape in shapes}
        out = folder / f"a{seed}"
        out.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out / "adapters.safetensors"), weights)
        config = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": lora}
        (out / "adapter_config.json").write_text(json.dumps(config))
        paths.append(out)
    return paths


def spread(rows: int, adapters: int, base_share: float) -> list[str | None]:
    """Row adapter names: ``base_share`` of the rows base, the rest round-robin over ``adapters``."""
    base = rows if not adapters else int(rows * base_share)
    return [None] * base + [f"a{i % adapters}" for i in range(rows - base)]


def slots(names: Sequence[str | None]) -> list[int]:
    """The stack slots of row names (``aK`` is the K+1-th mounted adapter, base is 0)."""
    return [0 if n is None else int(n[1:]) + 1 for n in names]


# The worker process's side.


async def _rows(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    names: Sequence[str | None],
    max_tokens: int,
    bias: dict[int, float] | None,
) -> dict[str, Any]:
    """Row i decodes ``prompts[i]`` under adapter ``names[i]``, all together; their rates."""
    import trio
    from bench.suite.timing import rates

    from trio_mlx import SamplingParams

    rows: list[list[tuple[float, int]]] = [[] for _ in prompts]

    async def consume(i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, logit_bias=bias, adapter=names[i])
        async with engine.generate(list(prompts[i]), params) as stream:
            async for delta in stream:
                if delta.token_ids:
                    rows[i].append((time.perf_counter(), len(delta.token_ids)))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(consume, i)
    result = rates(start, rows)
    result["complete"] = all(sum(n for _, n in row) == max_tokens for row in rows)
    return result


def _best(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return {**max(runs, key=lambda r: r[key] or 0), "rounds": [r[key] for r in runs]}


def _engine_part(job: dict[str, Any], adapters: list[Path], tokenizer: Any) -> None:
    import trio

    import trio_mlx

    bias = {int(k): v for k, v in job["logit_bias"].items()} if job["logit_bias"] else None
    batches, tokens, rounds = job["batches"], job["max_tokens"], job["rounds"]
    prompts = {b: prompt_ids(tokenizer, b, job["prompt_len"], seed=b) for b in batches}
    serial_n = job["serial_requests"]
    serial_prompts = prompt_ids(tokenizer, serial_n, job["prompt_len"], seed=serial_n)

    async def mount(engine: Any) -> Any:
        for i, path in enumerate(adapters):
            await engine.mount_adapter(f"a{i}", path)
        return engine

    async def main() -> None:
        model, most = job["model"], max(batches)
        # prompt_cache_bytes=0: every round computes its prompts (the same ones each round).
        async with (
            trio_mlx.open_engine(model, max_batch=most, prompt_cache_bytes=0) as plain,
            trio_mlx.open_engine(model, max_batch=most, prompt_cache_bytes=0) as lora,
            trio_mlx.open_engine(model, max_batch=1, prompt_cache_bytes=0) as alone,
        ):
            await mount(lora)
            await mount(alone)
            # Warm up every (engine, B, adapter) path before timing anything.
            for b in batches:
                await _rows(plain, prompts[b], [None] * b, 4, bias)
                for _, k, share in CASES:
                    await _rows(lora, prompts[b], spread(b, k, share), 4, bias)
            await _rows(alone, serial_prompts[:2], [None, "a0"], 2, bias)
            for b in batches:
                runs: dict[str, list[dict[str, Any]]] = {}
                for _ in range(rounds):
                    runs.setdefault("no adapter mounted", []).append(
                        await _rows(plain, prompts[b], [None] * b, tokens, bias)
                    )
                    for label, k, share in CASES:
                        runs.setdefault(label, []).append(
                            await _rows(lora, prompts[b], spread(b, k, share), tokens, bias)
                        )
                for label, got in runs.items():
                    emit({"job": "multilora_rows", "batch": b, "case": label,
                          "result": _best(got, "decode_tok_s")})  # fmt: skip
            serial: dict[str, list[dict[str, Any]]] = {}
            for _ in range(rounds):
                for name, share in (("adapter", 0.0), ("base", 1.0)):
                    names = spread(serial_n, ADAPTERS, share)
                    for lane, engine in (("batch", lora), ("serial", alone)):
                        serial.setdefault(f"{name}:{lane}", []).append(
                            await _rows(engine, serial_prompts, names, tokens, bias)
                        )
            lanes = alone.statistics().requests
            if lanes.get("batch:finished", 0):
                raise RuntimeError("the max_batch=1 engine ran a request in the batch lane")
            for key, got in serial.items():
                name, lane = key.split(":")
                emit({"job": "multilora_serial", "requests": name, "lane": lane,
                      "rows": serial_n, "result": _best(got, "e2e_tok_s")})  # fmt: skip
            if job["methods"]:
                await _by_method(lora, adapters, prompts, job, bias)

    trio.run(main)


async def _by_method(
    engine: Any,
    adapters: list[Path],
    prompts: dict[int, list[list[int]]],
    job: dict[str, Any],
    bias: dict[int, float] | None,
) -> None:
    """Engine decode tok/s of the rows over 4 adapters (and half base) under each method.

    The registry's method applies to the stacks it builds next, so the last
    adapter is mounted again after each change (reaching into the engine's
    registry: a measurement knob, not an API).
    """

    from trio_mlx._adapters.multilora import DEFAULT_METHOD

    name, path = f"a{len(adapters) - 1}", adapters[-1]

    async def restack(method: str) -> None:
        engine._registry.method = method
        await engine.unmount_adapter(name)
        await engine.mount_adapter(name, path)

    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for _ in range(job["rounds"]):
        for method in job["methods"]:
            await restack(method)
            for b, rows in prompts.items():
                for label, k, share in CASES[3:]:
                    names = spread(b, k, share)
                    got = await _rows(engine, rows, names, job["max_tokens"], bias)
                    runs.setdefault((b, label, method), []).append(got)
    await restack(DEFAULT_METHOD)
    for (b, label, method), got in runs.items():
        emit({"job": "multilora_engine_methods", "batch": b, "case": label, "method": method,
              "result": _best(got, "decode_tok_s")})  # fmt: skip


def _step_ms(
    model: Any, rows: int, row_slots: list[int], stack: Any, job: dict[str, Any]
) -> list[float]:
    """Milliseconds of each decode step of ``rows`` rows (a fresh KV cache), ``stack`` on or None."""
    from contextlib import nullcontext

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.random.randint(3, 500, (rows, job["prompt_len"]), key=mx.random.key(rows))
    with stack.on(model) if stack is not None else nullcontext():

        def step(inputs: Any) -> Any:
            if stack is not None:
                stack.set_rows(row_slots)
            out = mx.argmax(model(inputs, cache=cache)[:, -1:], axis=-1)
            mx.eval(out)
            return out

        last = step(tokens)
        for _ in range(2):
            last = step(last)
        times = []
        for _ in range(job["steps"]):
            start = time.perf_counter()
            last = step(last)
            times.append((time.perf_counter() - start) * 1000)
        return times


def _quartile(times: list[float]) -> float:
    """The lower quartile: a step's cost on a machine that other work slows down at times."""
    return sorted(times)[len(times) // 4]


def _methods_part(job: dict[str, Any], adapters: list[Path]) -> None:
    import mlx_lm

    from trio_mlx._adapters.registry import AdapterRegistry

    model, _ = mlx_lm.load(job["model"])
    stacks = {}
    for method in job["methods"]:
        registry = AdapterRegistry()
        registry.method = method
        for i, path in enumerate(adapters):
            registry.mount(model, f"a{i}", registry.check_path(path))
        stacks[method] = registry.stack
        try:
            _step_ms(model, 2, [1, 2], registry.stack, {**job, "steps": 1})
        except Exception as exc:
            del stacks[method]
            emit({"job": "multilora_error", "part": f"method {method}",
                  "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
    for b in job["batches"]:
        cases = [(label, slots(spread(b, k, share))) for label, k, share in CASES[1:]]
        configs: list[tuple[str, str | None]] = [("base model", None)]
        configs += [(label, m) for label, _ in cases for m in stacks]
        steps: dict[tuple[str, str | None], list[float]] = {}
        row_slots = dict(cases)
        for _ in range(job["rounds"]):
            for label, method in configs:
                stack = stacks[method] if method is not None else None
                times = _step_ms(model, b, row_slots.get(label, [0] * b), stack, job)
                steps.setdefault((label, method), []).extend(times)
        for (label, method), times in steps.items():
            emit({"job": "multilora_methods", "batch": b, "case": label, "method": method,
                  "ms": _quartile(times), "median_ms": sorted(times)[len(times) // 2]})  # fmt: skip


def job(job: dict[str, Any]) -> None:
    """The worker's side of the part: the engine runs, then the per-method step costs.

    A part that fails (say, a method an MLX backend lacks a kernel for) is
    reported as an ``multilora_error`` record; the other part still runs.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(Path(job["model"]), Path(tmp), ADAPTERS)
        parts = [("methods", lambda: _methods_part(job, paths))] if job["methods"] else []
        if job.get("engine", True):
            tokenizer = load_tokenizer(Path(job["model"]))
            parts.insert(0, ("engine", lambda: _engine_part(job, paths, tokenizer)))
        for name, run in parts:
            try:
                run()
            except Exception as exc:  # reported, never replaced by made-up numbers
                emit({"job": "multilora_error", "part": name,
                      "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip


# The suite's side.


def collect(records: list[dict[str, Any]], model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The part's results from the worker's records."""
    from trio_mlx._adapters.multilora import DEFAULT_METHOD

    rows = [r for r in records if r["job"] == "multilora_rows"]
    serial = [r for r in records if r["job"] == "multilora_serial"]
    methods = [r for r in records if r["job"] == "multilora_methods"]
    errors = [r for r in records if r["job"] == "multilora_error"]
    engine_methods = [r for r in records if r["job"] == "multilora_engine_methods"]
    return {"model": model, "settings": settings, "default_method": DEFAULT_METHOD,
            "rows": rows, "serial": serial, "engine_methods": engine_methods,
            "methods": methods, "errors": errors}  # fmt: skip


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _x(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _engine_methods_md(data: dict[str, Any], base: dict[int, Any]) -> list[str]:
    records = data.get("engine_methods") or []
    if not records:
        return []
    methods = list(dict.fromkeys(r["method"] for r in records))
    rate = {(r["batch"], r["case"], r["method"]): r["result"]["decode_tok_s"] for r in records}
    lines = [
        "",
        "The same engine, the stack rebuilt with each method in turn (rounds interleaved): "
        "decode tok/s, and in brackets against the all-base rows above.",
        "",
        "| B | rows | " + " | ".join(methods) + " |",
        "| ---: | --- | " + " | ".join("---:" for _ in methods) + " |",
    ]
    for b, case in dict.fromkeys((r["batch"], r["case"]) for r in records):
        cells = [f"{_num(rate[b, case, m])} ({_x(rate[b, case, m], base.get(b))})" for m in methods]
        lines.append(f"| {b} | {case} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict[str, Any]) -> list[str]:
    """The part's section of ``results.md``."""
    data = results.get("multilora")
    if not data:
        return []
    s = data["settings"]
    lines = [f"## 9. Several LoRA adapters in one batch on `{data['model']}`", ""]
    lines += [
        f"{ADAPTERS} random LoRA adapters (rank {RANK}, q_proj and v_proj of every layer) "
        f"mounted; {s['max_tokens']} tokens a row, {s['prompt_len']}-token prompts, best of "
        f"{s['rounds']} interleaved rounds; the stacked layers compute with the "
        f"`{data['default_method']}` method. Decode tok/s in the steady state. Goal: "
        ">= 0.7x of all base at B=32 over 4 adapters.",
        "",
        "| B | rows | decode tok/s | vs all base | rounds |",
        "| ---: | --- | ---: | ---: | --- |",
    ]
    base = {
        r["batch"]: r["result"]["decode_tok_s"]
        for r in data["rows"]
        if r["case"] == "all base, 4 mounted"
    }
    for r in data["rows"]:
        got = r["result"]["decode_tok_s"]
        rounds = ", ".join(_num(x) for x in r["result"]["rounds"])
        lines.append(
            f"| {r['batch']} | {r['case']} | {_num(got)} | {_x(got, base.get(r['batch']))} | "
            f"{rounds} |"
        )
    if data["serial"]:
        by = {(r["requests"], r["lane"]): r["result"]["e2e_tok_s"] for r in data["serial"]}
        n = data["serial"][0]["rows"]
        lines += [
            "",
            f"{n} requests submitted together, end to end (prompts included): through the "
            "batch lane, and through the serial lane (`max_batch=1`: one at a time, the "
            f"adapter put on and taken off for each). Goal: adapter requests batch >= 4x "
            "serial. The base row is the ceiling: what batching these requests gains "
            "without any adapter on this machine.",
            "",
            "| requests | batch lane tok/s | serial lane tok/s | batch/serial |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, label in (("adapter", f"{n} over {ADAPTERS} adapters"), ("base", f"{n} base")):
            b, a = by.get((name, "batch")), by.get((name, "serial"))
            lines.append(f"| {label} | {_num(b)} | {_num(a)} | {_x(b, a)} |")
    lines += _engine_methods_md(data, base)
    if data["methods"]:
        methods = list(dict.fromkeys(r["method"] for r in data["methods"] if r["method"]))
        ms = {(r["batch"], r["case"], r["method"]): r["ms"] for r in data["methods"]}
        lines += [
            "",
            "Per-step cost of the adapted layers alone: ms per decode step of a bare forward "
            f"(KV cache, {s['steps']} steps x {s['rounds']} rounds, one eval each) with each "
            "method's stacked layers, and the base model; the lower quartile of the steps "
            "(steps other work on the machine slowed down fall above it), lower is better.",
            "",
            "| B | rows | base model | " + " | ".join(methods) + " |",
            "| ---: | --- | ---: | " + " | ".join("---:" for _ in methods) + " |",
        ]
        for b in dict.fromkeys(r["batch"] for r in data["methods"]):
            plain = ms.get((b, "base model", None))
            for label, _, _ in CASES[1:]:
                cells = []
                for m in methods:
                    value = ms.get((b, label, m))
                    cells.append("-" if value is None else f"{value:.2f} ({_x(plain, value)})")
                lines.append(f"| {b} | {label} | {plain:.2f} | " + " | ".join(cells) + " |")
        lines += ["", "(in brackets: base model step time / this one; 1.00x = free)"]
    for error in data.get("errors", []):
        lines += ["", f"Not run: the {error['part']} part failed: `{error['error']}`"]
    return [*lines, ""]
