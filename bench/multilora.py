"""Decode throughput with rows under several LoRA adapters in one batch (issue 17).

For B rows (B = 8 and 32) decoding together in one engine, rows spread evenly
over 0 (all base), 1, 2 and 4 mounted adapters, plus half base / half over 4
adapters; and 8 adapter requests (over 4 adapters) through the batch lane
against the same 8 through the serial lane (an engine with ``max_batch=1``:
each request runs alone with its adapter put on and taken off, the path every
adapter request took before). Four random rank-8 LoRA adapters on every
layer's q_proj and v_proj are mounted in every run, so "all base" includes
whatever mounted-but-unused adapters cost.

tok/s is generated tokens over wall time from submission to the last row's
end (prompts of a few tokens: prefill is a small share). Best of ``--repeats``.

    python -m bench.multilora --model random-25m --out bench/results/cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from bench.suite.models import prepare

import trio_mlx
from trio_mlx import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "import os, sys"]


def make_adapter(model_path: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter (q_proj and v_proj of every layer), small enough to stay sane."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(model_path))
    layers = len(model.layers)
    lora = {"rank": rank, "scale": 2.0, "dropout": 0.0}
    model.freeze()
    linear_to_lora_layers(model, layers, lora)
    mx.random.seed(seed)
    weights = {
        k: mx.random.normal(v.shape) * 0.05 for k, v in tree_flatten(model.trainable_parameters())
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": lora}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


async def _run(
    model: Path,
    adapters: list[Path],
    names: list[str | None],
    max_batch: int,
    tokens: int,
    logit_bias: dict[int, float] | None,
) -> float:
    async with trio_mlx.open_engine(model, max_batch=max_batch, prompt_cache_bytes=0) as engine:
        for i, path in enumerate(adapters):
            await engine.mount_adapter(f"a{i}", path)
        # Warm up: one short request per adapter and the base.
        for name in [None, *(f"a{i}" for i in range(len(adapters)))]:
            await engine.complete("Hi", SamplingParams(max_tokens=2, adapter=name))
        generated = 0

        async def one(i: int, name: str | None) -> None:
            nonlocal generated
            params = SamplingParams(max_tokens=tokens, logit_bias=logit_bias, adapter=name)
            result = await engine.complete(PROMPTS[i % len(PROMPTS)], params)
            generated += len(result.token_ids)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i, name in enumerate(names):
                nursery.start_soon(one, i, name)
        elapsed = time.perf_counter() - start
        stats = engine.statistics()
        if max_batch > 1 and stats.requests["serial:finished"]:
            raise RuntimeError("a batch-lane run used the serial lane")
    return generated / elapsed


def _spread(rows: int, adapters: int, base_share: float = 0.0) -> list[str | None]:
    base = int(rows * base_share) if adapters else rows
    return [None] * base + [f"a{i % adapters}" for i in range(rows - base)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random-25m")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu"))
    args = parser.parse_args()
    model = prepare(args.model)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [make_adapter(model.path, Path(tmp) / f"a{i}", seed=i) for i in range(4)]

        def measure(label: str, names: list[str | None], max_batch: int) -> float:
            best = max(
                trio.run(
                    _run, model.path, adapters, names, max_batch, args.tokens, model.logit_bias
                )
                for _ in range(args.repeats)
            )
            rows.append({"case": label, "rows": len(names), "max_batch": max_batch, "tok_s": best})
            print(f"{label:40s} {best:9.1f} tok/s", flush=True)
            return best

        for batch in (8, 32):
            base = measure(f"B={batch} all base", _spread(batch, 0), batch)
            for k in (1, 2, 4):
                got = measure(f"B={batch} over {k} adapter(s)", _spread(batch, k), batch)
                rows[-1]["vs_all_base"] = got / base
            got = measure(f"B={batch} half base, half over 4", _spread(batch, 4, 0.5), batch)
            rows[-1]["vs_all_base"] = got / base
        batched = measure("8 adapter requests, batch lane", _spread(8, 4), 8)
        serial = measure("8 adapter requests, serial lane", _spread(8, 4), 1)
        rows[-2]["vs_serial"] = batched / serial
    result = {
        "model": args.model,
        "tokens_per_request": args.tokens,
        "machine": platform.machine(),
        "adapters": "4 random LoRA, rank 8, q_proj+v_proj on every layer",
        "results": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multilora.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Several LoRA adapters in one batch ({args.model}, {args.tokens} tokens a row)",
        "",
        "| case | tok/s | vs all base | vs serial |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        ratio = f"{row['vs_all_base']:.2f}x" if "vs_all_base" in row else ""
        serial_ratio = f"{row['vs_serial']:.2f}x" if "vs_serial" in row else ""
        lines.append(f"| {row['case']} | {row['tok_s']:.1f} | {ratio} | {serial_ratio} |")
    (args.out / "multilora.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
