"""How often a batch's greedy answers equal each request's alone: ``python -m tools.gpu_agreement``.

On the CPU the engine's batched greedy tokens equal each row's alone exactly (the tests
assert it). On a GPU, TF32 matmuls and bfloat16 weights round differently at different
batch shapes, so the promise there is a measured agreement rate. This tool measures it
for the bundled model: 48 questions sent at once through the engine (one batch), each
compared with the same question through the engine alone and with mlx-lm's own
``generate`` (one at a time, greedy). ``--dtype bfloat16`` casts the weights first.
Run it once per setting of ``MLX_ENABLE_TF32`` (MLX reads it at start-up); it prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio

import trio_mlx
from tools.instruct import TRAIN_TEMPLATES, topics
from trio_mlx import SamplingParams, default_model_path

__all__ = ["main", "questions"]


def questions(count: int) -> list[str]:
    """``count`` questions, one topic each, phrasings taken in turn."""
    every = topics()
    return [
        TRAIN_TEMPLATES[i % len(TRAIN_TEMPLATES)].format(s=every[i % len(every)].subjects[0])
        for i in range(count)
    ]


def _model_in(dtype: str, scratch: Path) -> Path:
    source = default_model_path()
    if dtype == "float32":
        return source
    target = scratch / f"pydoc-llama-{dtype}"
    shutil.copytree(source, target)
    weights = mx.load(str(source / "model.safetensors"))
    assert isinstance(weights, dict)
    cast = {name: array.astype(getattr(mx, dtype)) for name, array in weights.items()}
    mx.save_safetensors(str(target / "model.safetensors"), cast, metadata={"format": "mlx"})
    return target


async def _engine_answers(
    path: Path, asked: Sequence[str], tokens: int
) -> tuple[list[str], list[str]]:
    params = SamplingParams(max_tokens=tokens)
    batched: dict[int, str] = {}
    async with trio_mlx.open_engine(path) as engine:

        async def ask(i: int) -> None:
            chat = [{"role": "user", "content": asked[i]}]
            batched[i] = (await engine.complete(chat, params)).text

        async with trio.open_nursery() as nursery:
            for i in range(len(asked)):
                nursery.start_soon(ask, i)
        alone = [
            (await engine.complete([{"role": "user", "content": q}], params)).text for q in asked
        ]
    return [batched[i] for i in range(len(asked))], alone


def _mlx_lm_answers(path: Path, asked: Sequence[str], tokens: int) -> list[str]:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, wrapper, *_ = load(str(path))
    tokenizer: Any = wrapper
    answers = []
    for question in asked:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        text = generate(model, tokenizer, prompt, max_tokens=tokens, sampler=make_sampler(0.0))
        answers.append(text)
    return answers


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: one JSON line of agreement counts."""
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_agreement")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--count", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    asked = questions(args.count)
    with tempfile.TemporaryDirectory() as scratch:
        path = _model_in(args.dtype, Path(scratch))
        batched, alone = trio.run(_engine_answers, path, asked, args.tokens)
        reference = _mlx_lm_answers(path, asked, args.tokens)
    agree = {
        "batch_vs_engine_alone": sum(a == b for a, b in zip(batched, alone, strict=True)),
        "batch_vs_mlx_lm_generate": sum(a == b for a, b in zip(batched, reference, strict=True)),
        "engine_alone_vs_mlx_lm_generate": sum(
            a == b for a, b in zip(alone, reference, strict=True)
        ),
    }
    print(json.dumps({
        "device": str(mx.default_device()),
        "tf32": os.environ.get("MLX_ENABLE_TF32", "default"),
        "dtype": args.dtype, "questions": args.count, "tokens": args.tokens, **agree,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
