"""Sibling projections stacked into one matmul: the decode step's time, with and without.

``trio_mlx._accel.fused_projections.install`` computes each layer's q/k/v, and
gate/up, as one matmul (three MLX operations fewer per layer and step). This
loads the model twice in one process (the engine's load-time settings and the
fused decode attention on both; the stacking on one), then times batched greedy
decode steps of each, alternating, at several batch sizes: pipelined as the
lane runs them (the next step queued before the last step's tokens are read).
It also checks the tokens: 48 greedy steps of 8 rows from the same prompts on
both copies, and counts the positions where they differ (bf16 matmuls of
another shape may round differently; float32 on the CPU is exact).

Run: ``python bench/experiments/fused_projections.py [MODEL] [B,B,...] [ROUNDS]``
(default ``llama-1b``, ``1,8,32,64,128``, 5); numbers in design/performance.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import mlx.core as mx
import mlx_lm
from bench.suite import models
from mlx_lm.models.cache import BatchKVCache

from trio_mlx._accel import _decode_attention, _fused_projections
from trio_mlx._accel import settings as _cuda_settings

STEPS = 64


def load(path: str, fused: bool) -> Any:
    model, _ = mlx_lm.load(path)
    stacked = _fused_projections.install(
        model, {} if fused else {"TRIO_MLX_FUSED_PROJECTIONS": "0"}
    )
    _decode_attention.install(model)
    print(f"{'fused' if fused else 'plain'}: {stacked} groups stacked", flush=True)
    return model


def prompts(rows: int, length: int = 96) -> Any:
    return mx.array([[(7 * r + 3 * i) % 3000 + 10 for i in range(length)] for r in range(rows)])


def decode(model: Any, rows: int, steps: int) -> tuple[float, list[list[int]]]:
    """ms per decode step (pipelined), and the greedy tokens."""
    cache = [BatchKVCache([r % 5 for r in range(rows)]) for _ in model.layers]
    logits = model(prompts(rows), cache=cache)[:, -1, :]
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    out: list[list[int]] = []
    start = time.perf_counter()
    for _ in range(steps):
        nxt = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        out.append(token.tolist())
        token = nxt
    mx.eval(token)
    return (time.perf_counter() - start) / steps * 1e3, out


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8,32,64,128").split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    _cuda_settings.apply()
    path = str(models.prepare(name).path)
    plain, fused = load(path, False), load(path, True)
    _, a = decode(plain, 8, 48)
    _, b = decode(fused, 8, 48)
    differ = sum(x != y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    first = next((i for i, (ra, rb) in enumerate(zip(a, b, strict=True)) if ra != rb), None)
    print(f"greedy tokens, 8 rows x 48 steps: {differ} differ (first differing step: {first})")
    for rows in batches:
        times: dict[str, list[float]] = {"plain": [], "fused": []}
        decode(plain, rows, 8), decode(fused, rows, 8)  # shapes seen once, outside the timing
        for _ in range(rounds):
            for label, model in (("plain", plain), ("fused", fused)):
                times[label].append(decode(model, rows, STEPS)[0])
        p, f = statistics.median(times["plain"]), statistics.median(times["fused"])
        print(
            f"B={rows}: ms/step plain {p:.2f} fused {f:.2f} (plain/fused {p / f:.3f}; "
            f"rounds plain {' '.join(f'{t:.2f}' for t in times['plain'])}, "
            f"fused {' '.join(f'{t:.2f}' for t in times['fused'])})",
            flush=True,
        )


if __name__ == "__main__":
    main()
