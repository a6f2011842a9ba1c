"""A decode step traced once by ``mx.compile`` against the eager step, per batch size.

``python bench/experiments/compiled_decode.py [MODEL] [ROWS,...] [PROMPT] [STEPS] [write=put]``
(default ``llama-1b``, rows 8,32,64, 100-token prompts, 128 steps) loads the model
as the engine does (fused projections; the fused decode attention on CUDA), fills
a batch of ROWS left-padded rows, then decodes STEPS greedy steps two ways,
pipelined as the lane decodes (the next step queued before the last one's tokens
are read):

- ``eager``: the model over mlx-lm's ``BatchKVCache``s, as the lane runs it; every
  step builds the model's graph in Python and writes the cache at a Python int;
- ``compiled``: the same model over the same buffers, traced once per (rows,
  buffer length) by ``mx.compile``: the write position and each row's offset
  are arrays, the write a ``mx.slice_update`` at an array index (with
  ``write=put``, ``mx.put_along_axis``), and attention
  reads the whole buffer with the unwritten tail masked out (on CUDA the fused
  kernel's ``stop``; elsewhere a boolean mask), so consecutive steps are one
  shape.

It prints each way's median ms per step (and the compiled way's step run
without ``mx.compile``: what the array positions and whole-buffer reads cost
alone), the compiled way's first call (trace and compile) at each new batch
size, and whether the greedy tokens agree. The engine's version of the traced
step is ``trio_mlx._accel.traced_decode`` (``put`` only; this script kept both writes
to show why).
Why: on the H200 a 64-row decode step of llama-1b takes 6-9 ms while the GPU is
busy a quarter of the time (design/performance.md): the step's host work sets the
pace, and this says how much of it one compiled graph takes away.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from bench.suite import models

from trio_mlx._start.loading import LoadSettings, load


class StaticCache:
    """One layer's keys and values for a traced step: positions are arrays."""

    def __init__(self, keys: Any, values: Any, idx: Any, offset: Any, left: Any, mask: Any):
        self.keys, self.values, self.idx, self.offset = keys, values, idx, offset
        self.left_padding, self.mask = left, mask

    #: How the new position is written: ``slice`` (``mx.slice_update``) or ``put``
    #: (``mx.put_along_axis``).
    write = "slice"

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        if self.write == "put":
            at = mx.broadcast_to(self.idx.reshape(1, 1, 1, 1), keys.shape)
            self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
            self.values = mx.put_along_axis(self.values, at, values, axis=2)
        else:
            self.keys = mx.slice_update(self.keys, keys, self.idx, (2,))
            self.values = mx.slice_update(self.values, values, self.idx, (2,))
        return self.keys, self.values

    def make_mask(self, n: int, **kwargs: Any) -> Any:
        return self.mask


def route_attention(model: Any) -> None:
    """Send a StaticCache's attention to the fused kernel with ``stop`` (CUDA)."""
    import mlx.core as mx

    from trio_mlx._accel import decode_attention as _decode_attention

    module = sys.modules[type(model).__module__]
    inner = module.scaled_dot_product_attention

    def attention(
        q: Any, k: Any, v: Any, cache: Any, scale: float, mask: Any, sinks: Any = None
    ) -> Any:
        if isinstance(cache, StaticCache) and mx.cuda.is_available():
            return _decode_attention.decode_attention(
                q, k, v, cache.left_padding, scale, stop=cache.idx + 1
            )
        return inner(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)

    module.scaled_dot_product_attention = attention


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    for arg in sys.argv[1:]:
        if arg.startswith("write="):
            StaticCache.write = arg[6:]
    sys.argv = [a for a in sys.argv if not a.startswith("write=")]
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    batches = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8,32,64").split(",")]
    prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    loaded = load(str(models.prepare(name).path), LoadSettings(max_batch=max(batches)))
    model = loaded.model
    route_attention(model)
    layers = len(model.layers)

    def step(tokens: Any, idx: Any, offset: Any, left: Any, *kv: Any) -> list[Any]:
        positions = mx.arange(kv[0].shape[2])[None]
        mask = ((positions >= left[:, None]) & (positions <= idx))[:, None, None, :]
        caches = [
            StaticCache(kv[2 * i], kv[2 * i + 1], idx, offset, left, mask) for i in range(layers)
        ]
        logits = model(tokens[:, None], cache=caches)[:, -1, :]
        return [mx.argmax(logits, axis=-1), *[a for c in caches for a in (c.keys, c.values)]]

    compiled = mx.compile(step)

    def filled(rows: int) -> tuple[list[Any], Any]:
        mx.random.seed(rows)
        left = [(3 * i) % 17 for i in range(rows)]
        prompt = mx.random.randint(0, 1000, (rows, prompt_len))
        caches = [BatchKVCache(left) for _ in range(layers)]
        logits = model(prompt, cache=caches)
        first = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(first, [c.keys for c in caches], [c.values for c in caches])
        return caches, first

    def eager(rows: int) -> tuple[list[list[int]], list[float]]:
        caches, token = filled(rows)
        out, times = [], []
        queued = token
        for _ in range(steps):
            t0 = time.perf_counter()
            nxt = mx.argmax(model(queued[:, None], cache=caches)[:, -1, :], axis=-1)
            mx.async_eval(nxt)
            out.append(queued.tolist())
            queued = nxt
            times.append(time.perf_counter() - t0)
        return out, times

    def traced(rows: int, fn: Any = compiled) -> tuple[list[list[int]], list[float]]:
        caches, token = filled(rows)
        idx = caches[0]._idx
        if idx + steps > caches[0].keys.shape[2]:  # room for every step: one buffer length
            grow = ((idx + steps + 255) // 256) * 256 - caches[0].keys.shape[2]
            for c in caches:
                pad = mx.zeros((*c.keys.shape[:2], grow, c.keys.shape[3]), c.keys.dtype)
                c.keys = mx.concatenate([c.keys, pad], axis=2)
                c.values = mx.concatenate([c.values, pad], axis=2)
        kv = [a for c in caches for a in (c.keys, c.values)]
        left = caches[0].left_padding
        offset = caches[0].offset
        del caches
        mx.eval(kv)
        out, times = [], []
        queued = token
        for i in range(steps):
            t0 = time.perf_counter()
            at = mx.array([idx + i], dtype=mx.int32)
            nxt, *kv = fn(queued, at, offset + i, left, *kv)
            mx.async_eval(nxt)
            out.append(queued.tolist())
            queued = nxt
            times.append(time.perf_counter() - t0)
        return out, times

    print(f"{name}: prompts {prompt_len} tokens, {steps} steps, rows {batches}")
    for rows in batches:
        for rnd in range(2):
            want, te = eager(rows)
            got, tc = traced(rows)
            _, tu = traced(rows, step)
            same = sum(
                a == b for x, y in zip(want, got, strict=True) for a, b in zip(x, y, strict=True)
            )
            first = f"first call {tc[0] * 1e3:.0f} ms, " if rnd == 0 else ""
            print(
                f"  rows {rows:3d} round {rnd}: eager {statistics.median(te[4:]) * 1e3:6.2f} ms/step, "
                f"compiled {statistics.median(tc[4:]) * 1e3:6.2f} ({first}x{statistics.median(te[4:]) / statistics.median(tc[4:]):.2f}); "
                f"greedy tokens equal {same} of {rows * steps}; the same step not compiled "
                f"{statistics.median(tu[4:]) * 1e3:6.2f}"
            )


if __name__ == "__main__":
    main()
