"""What a prefill pass of a shape MLX has not met yet costs, and in which op.

``python bench/experiments/first_shape.py [MODEL] [variants]`` (default
``llama-1b``) runs each measurement below in a fresh process of its own (so that
no block meets shapes another block met first), under MLX's defaults and, with
``variants``, also ``MLX_USE_CUDA_GRAPHS=0`` and ``CUDA_MODULE_LOADING=EAGER``,
each under the engine's CUDA settings and memory pool. Each times, synchronised,
the first and the second call of:

- ``forward``: the model's forward pass over a one-row ``KVCache`` that already
  holds S tokens, for W new tokens (the lane's prefill chunk: a new W is a new
  last chunk, a new S a new place in the prompt); ``batch fwd``: the same over
  one-row ``BatchKVCache``s (array masks and offsets, as the lane's prefill runs);
- ``matmul``: one projection (W x hidden) @ (hidden x 4 hidden) for each new W;
- ``attention``: MLX's attention for W queries over S + W keys with a boolean
  mask array, as mlx-lm's batch caches pass it, and then the first call at
  S + 16 (a key length not met, in the same band of 256); ``attention pad256``:
  the same with the keys padded to a multiple of 256 and the tail masked out, so
  that S and S + 16 are one shape.

A first call much slower than the second is a per-shape cost; the variants say
whether it is CUDA graph instantiation or lazily loaded kernels. (Until the
ninth round every block ran in one process, attention last, after the forward
passes had met its shapes: its "no first-call cost" then was not a measurement
of new shapes.) With ``sweep``, one process times the matmul's first and second
call for every M from 96 to 160: a cost per new M, or only at the few M that
meet a new kernel; then again in a process that ran every multiple of 8 first
(what the engine's CUDA warm-up does: ``trio_mlx._accel.warmup``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

VARIANTS = {
    "defaults": {},
    "MLX_USE_CUDA_GRAPHS=0": {"MLX_USE_CUDA_GRAPHS": "0"},
    "CUDA_MODULE_LOADING=EAGER": {"CUDA_MODULE_LOADING": "EAGER"},
}
BLOCKS = ("forward", "batch fwd", "matmul", "attention", "attention pad256")
WIDTHS = (160, 428, 768, 1000)
STARTS = (768, 1536, 2304, 3072)


def timed(fn: Callable[[], Any]) -> float:
    import mlx.core as mx

    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def child(name: str) -> None:
    import mlx.core as mx
    from bench.suite import models
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.utils import load

    from trio_mlx import _cuda_pool, _cuda_settings

    _cuda_settings.apply()
    _cuda_pool.keep_memory()  # as the engine loads: TRIO_MLX_CUDA_POOL_GIB=off for MLX's own
    model: Any = load(str(models.prepare(name).path))[0]
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    hidden = args.hidden_size
    dim = getattr(args, "head_dim", None) or hidden // heads
    dtype = model.model.embed_tokens.weight.dtype
    layers = len(model.layers)
    capacity = max(STARTS) + max(WIDTHS) + 256

    def forward(width: int, start: int) -> Callable[[], Any]:
        caches = []
        for _ in range(layers):
            c: Any = mlx_cache.KVCache()  # type: ignore[no-untyped-call]
            c.keys = mx.zeros((1, kv_heads, capacity, dim), dtype)
            c.values = mx.zeros((1, kv_heads, capacity, dim), dtype)
            c.offset = start
            caches.append(c)
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
        tokens = mx.array([[(7 * i) % 1000 + 5 for i in range(width)]])

        def call() -> Any:
            for c in caches:  # every call meets the same S: the cache advances
                c.offset = start
            return model(tokens, cache=caches)

        return call

    def batch_forward(width: int, start: int) -> Callable[[], Any]:
        """The same pass over one-row ``BatchKVCache``s: the lane's prefill path (array masks)."""
        caches = []
        for _ in range(layers):
            c: Any = mlx_cache.BatchKVCache([0])  # type: ignore[no-untyped-call]
            c.keys = mx.zeros((1, kv_heads, capacity, dim), dtype)
            c.values = mx.zeros((1, kv_heads, capacity, dim), dtype)
            caches.append(c)
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
        tokens = mx.array([[(7 * i) % 1000 + 5 for i in range(width)]])

        def call() -> Any:
            for c in caches:
                c._idx, c.offset = start, mx.array([start])
            return model(tokens, cache=caches)

        return call

    weight = mx.random.normal((hidden, 4 * hidden)).astype(dtype)

    def matmul(width: int) -> Callable[[], Any]:
        x = mx.random.normal((width, hidden)).astype(dtype)
        mx.eval(x)
        return lambda: x @ weight

    def attention(width: int, start: int, pad: int = 1) -> Callable[[], Any]:
        keys = -(-(start + width) // pad) * pad  # the padded tail is masked out
        q = mx.random.normal((1, heads, width, dim)).astype(dtype)
        k = mx.random.normal((1, kv_heads, keys, dim)).astype(dtype)
        v = mx.random.normal((1, kv_heads, keys, dim)).astype(dtype)
        rows = mx.arange(width)[:, None] + start
        mask = (mx.arange(keys)[None, :] <= rows)[None, None]
        mx.eval(q, k, v, mask)
        return lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)

    timed(forward(16, 16))  # the first call of all pays start-up, not shapes
    print(f"-- {os.environ.get('FIRST_SHAPE_VARIANT')}", flush=True)
    if os.environ.get("FIRST_SHAPE_SWEEP"):
        if os.environ.get("FIRST_SHAPE_PRIMED"):
            for width in range(8, 161, 8):
                timed(matmul(width))
        sweep(matmul)
        return
    makers: dict[str, Callable[[int, int], Callable[[], Any]]] = {
        "forward": forward,
        "batch fwd": batch_forward,
        "matmul": lambda w, s: matmul(w),
        "attention": attention,
        "attention pad256": lambda w, s: attention(w, s, 256),
    }
    label = os.environ["FIRST_SHAPE_BLOCK"]
    make = makers[label]
    firsts, seconds, nexts = [], [], []
    for width in WIDTHS:
        for start in STARTS if label != "matmul" else STARTS[:1]:
            fn = make(width, start)
            first, second = timed(fn), timed(fn)
            firsts.append(first)
            seconds.append(second)
            line = f"  {label:9s} W={width:5d} S={start:5d}  first {first:7.2f} ms  second {second:7.2f} ms"
            if label.startswith("attention"):
                nexts.append(timed(make(width, start + 16)))
                line += f"  first at S+16 {nexts[-1]:7.2f} ms"
            print(line, flush=True)
    tail = f", first calls at S+16 sum {sum(nexts):.1f} ms" if nexts else ""
    print(f"  {label}: first calls sum {sum(firsts):.1f} ms, second calls sum "
          f"{sum(seconds):.1f} ms{tail}", flush=True)  # fmt: skip


def sweep(matmul: Callable[[int], Callable[[], Any]]) -> None:
    """Every M from 96 to 160: is the cost per new M, or per kernel met once?"""
    firsts, seconds = [], []
    for width in range(96, 161):
        fn = matmul(width)
        firsts.append(timed(fn))
        seconds.append(timed(fn))
    slow = [w for w, t in zip(range(96, 161), firsts, strict=True) if t > 1.0]
    print(f"  sweep M=96..160: first calls sum {sum(firsts):.1f} ms, second calls sum "
          f"{sum(seconds):.1f} ms; first calls over 1 ms at M = {slow}", flush=True)  # fmt: skip


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    if "sweep" in sys.argv:
        for primed in ("", "1"):
            label = "sweep, every 8th M primed first" if primed else "sweep"
            env = {**os.environ, "FIRST_SHAPE_VARIANT": label, "FIRST_SHAPE_SWEEP": "1"}
            env["FIRST_SHAPE_PRIMED"] = primed
            subprocess.run([sys.executable, __file__, "--child", name], env=env, check=False)
        return
    variants = VARIANTS if "variants" in sys.argv else {"defaults": {}}
    for variant, extra in variants.items():
        for block in BLOCKS:
            env = {**os.environ, **extra, "FIRST_SHAPE_VARIANT": f"{variant}, {block}"}
            env["FIRST_SHAPE_BLOCK"] = block
            subprocess.run([sys.executable, __file__, "--child", name], env=env, check=False)


if __name__ == "__main__":
    main()
