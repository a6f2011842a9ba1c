"""One row decoding alone: where the time per token goes, by cache and loop.

``python bench/experiments/solo_decode.py [MODEL] [TOKENS] [ROUNDS]`` (MODEL a
``bench.suite.models`` name, default ``llama-1b``; ``default`` is the bundled
model) decodes one greedy row of TOKENS tokens, ROUNDS times each way,
alternating in one process, and prints milliseconds per token after the first 8:

* ``plain``: the model over mlx-lm's ``KVCache`` list, pipelined like
  ``generate_step`` (the next forward queued before this token is read back);
* ``batch1``: the same loop over a one-row ``BatchKVCache`` (array offsets and
  a boolean mask, as the batch lane's caches are);
* ``bare``: mlx-lm's ``BatchGenerator`` with one row;
* ``lane``: the engine's ``BatchLane`` in bursts of 16 steps (no actor, no Trio);
* ``lane_batched``: the same with ``solo_decode=False`` (the row stays a one-row batch).

With the fused decode attention and stacked projections installed on the model,
as the engine's loader does. It tells whether a one-row batch pays for being
a batch, and how much of that the lane adds.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import mlx.core as mx
from bench.suite import models
from bench.suite.inproc import prompt_ids
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from trio_mlx import SamplingParams
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.records import RowSpec, StepPlan

WARM = 8


def _bias(tokenizer: Any) -> dict[int, float]:
    return dict.fromkeys(tokenizer.eos_token_ids or [], -100.0)


def _loop(model: Any, prompt: list[int], tokens: int, cache: list[Any], bias: Any) -> float:
    def step(y: Any) -> Any:
        logits = model(y[None], cache=cache)[:, -1, :]
        if bias is not None:
            logits = logits + bias
        return mx.argmax(logits, axis=-1)

    y = step(mx.array(prompt))
    mx.async_eval(y)
    start = 0.0
    for n in range(tokens):
        if n == WARM:
            start = time.perf_counter()
        nxt = step(y)
        mx.async_eval(nxt)
        y.item()
        y = nxt
    y.item()
    return (time.perf_counter() - start) / (tokens - WARM) * 1e3


def plain(model: Any, prompt: list[int], tokens: int, bias: Any) -> float:
    return _loop(model, prompt, tokens, make_prompt_cache(model), bias)


def batch1(model: Any, prompt: list[int], tokens: int, bias: Any) -> float:
    return _loop(model, prompt, tokens, [BatchKVCache([0]) for _ in model.layers], bias)


def bare(model: Any, prompt: list[int], tokens: int, eos: dict[int, float]) -> float:
    from mlx_lm.sample_utils import make_logits_processors

    gen = BatchGenerator(
        model, completion_batch_size=1, logits_processors=make_logits_processors(logit_bias=eos)
    )
    try:
        gen.insert([prompt], max_tokens=[tokens])
        n, start = 0, 0.0
        while n < tokens:
            got = gen.next_generated()
            n += len(got)
            if n >= WARM and not start:
                start, first = time.perf_counter(), n
    finally:
        gen.close()
    return (time.perf_counter() - start) / (n - first) * 1e3


def lane(
    model: Any, tokenizer: Any, prompt: list[int], tokens: int, eos: Any, solo: bool = True
) -> float:
    ln = BatchLane(model, tokenizer, max_batch=8, solo_decode=solo)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logit_bias=eos)
    res = ln.step(StepPlan([RowSpec(1, tuple(prompt), params)], steps=WARM), seconds=30.0)
    n = sum(len(e.token_ids) for e in res.events)
    start, first = time.perf_counter(), n
    while ln.rows:
        res = ln.step(StepPlan([], steps=16), seconds=30.0)
        n += sum(len(e.token_ids) for e in res.events)
    ln.close()
    return (time.perf_counter() - start) / (n - first) * 1e3


def lane_batched(model: Any, tokenizer: Any, prompt: list[int], tokens: int, eos: Any) -> float:
    """``lane`` with the row kept as a one-row batch (``solo_decode=False``)."""
    return lane(model, tokenizer, prompt, tokens, eos, solo=False)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    if name == "default":
        from trio_mlx.default_model import default_model_path

        path = str(default_model_path())
    else:
        path = str(models.prepare(name).path)
    from trio_mlx._start.loading import LoadSettings, load

    loaded = load(path, LoadSettings(max_batch=8))
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = prompt_ids(tokenizer, 1, 64, seed=1)[0]
    eos = _bias(tokenizer) if name == "default" else None
    bias = None
    if eos:
        bias = mx.zeros((model.args.vocab_size,))
        bias[mx.array(list(eos))] = -100.0
    times: dict[str, list[float]] = {
        k: [] for k in ("plain", "batch1", "bare", "lane", "lane_batched")
    }
    for _ in range(rounds):
        times["plain"].append(plain(model, prompt, tokens, bias))
        times["batch1"].append(batch1(model, prompt, tokens, bias))
        times["bare"].append(bare(model, prompt, tokens, eos or {}))
        times["lane"].append(lane(model, tokenizer, prompt, tokens, eos))
        times["lane_batched"].append(lane_batched(model, tokenizer, prompt, tokens, eos))
        print(" ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()), flush=True)
    print(f"{name}, one row, {tokens} tokens, ms per token (median of {rounds}):")
    for k, v in times.items():
        print(f"  {k:12s} {statistics.median(v):.3f}  (min {min(v):.3f})")


if __name__ == "__main__":
    main()
