"""Whether the traced decode step stalls when its keys and values come in as views.

``python bench/experiments/strided_trace.py [MODEL]`` (default ``llama-1b``)
loads the model as the engine does and runs its traced decode step
(:mod:`trio_mlx._accel.traced_decode`) over 64-row batches made by hand, each step
timed in three parts, synchronised: the step's graph built (the traced call), queued
(``mx.async_eval``: MLX's encoding, kernels compiled, buffers allocated) and
run (``mx.eval``). The keys and values are either
contiguous buffers or views that start 256 positions into a larger buffer
(what ``filter_caches`` leaves when the rows' shared left padding it trims is
a multiple of the cache's step, so that no padding to the step copies them),
passed as they are or through ``mx.contiguous`` first. A served step that
queued for 2.35 s with no new trace (design/performance.md, fourteenth round)
is what this looked for: on the H200 the views queued in 3.3 ms, so they are
not its cause.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench.suite import models

from trio_mlx._accel import traced_decode as _traced_decode
from trio_mlx._start.loading import LoadSettings, load


def caches(layers: int, rows: int, length: int, heads: int, dim: int, view: bool) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    out = []
    extra = 256 if view else 0
    for _ in range(layers):
        c = BatchKVCache(left_padding=[0] * rows)
        k = mx.zeros((rows, heads, length + extra, dim), mx.bfloat16)
        v = mx.zeros((rows, heads, length + extra, dim), mx.bfloat16)
        mx.eval(k, v)
        c.keys, c.values = (k[..., extra:, :], v[..., extra:, :]) if view else (k, v)
        c._idx = length - 64
        c.offset = mx.array([length - 64] * rows)
        out.append(c)
    return out


def main() -> None:
    import mlx.core as mx

    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    loaded = load(str(models.prepare(name).path), LoadSettings(max_batch=64))
    config = loaded.config
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    traced = loaded.lane._traced or _traced_decode.build(loaded.model)
    if traced is None:
        print("no traced step on this device")
        return
    layers = traced.layers
    # (label, rows, positions, views, made contiguous first, steps).
    cases = [
        ("contiguous", 64, 4096, False, False, 3),
        ("views made contiguous", 64, 4096, True, True, 3),
        ("views", 64, 4096, True, False, 3),
        ("views, a new length", 64, 3840, True, False, 2),
        ("views, a new row count", 48, 4096, True, False, 2),
    ]
    for label, rows, length, view, copied, steps in cases:
        cs = caches(layers, rows, length, heads, dim, view)
        if copied:
            for c in cs:
                c.keys, c.values = mx.contiguous(c.keys), mx.contiguous(c.values)
        tokens = mx.zeros((rows,), mx.int32)
        for step in range(steps):
            before = traced.traces
            mx.synchronize()
            t0 = time.perf_counter()
            logits = traced.logits(tokens, cs)
            t1 = time.perf_counter()
            mx.async_eval(logits, *[a for c in cs for a in (c.keys, c.values)])
            t2 = time.perf_counter()
            mx.eval(logits)
            mx.synchronize()
            t3 = time.perf_counter()
            print(f"{label}, {rows} rows x {length}, step {step}: built {(t1 - t0) * 1e3:.1f} ms, "
                  f"queued {(t2 - t1) * 1e3:.1f} ms, ran {(t3 - t2) * 1e3:.1f} ms, "
                  f"{traced.traces - before} new traces", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
