"""Whether writing one position of a KV buffer at an array index copies the buffer.

``python bench/experiments/dynamic_write.py [ROWS] [LENGTHS]`` (default 64 rows,
buffer lengths 256,1280,4096; 8 KV heads of 64, bfloat16 on a GPU, float32 on the
CPU) times, per call and evaluated each time, writing one new position into a
buffer that nothing else holds (so MLX may update it in place):

- ``setitem``: ``buf[..., i:i+1, :] = new`` at a Python int (what mlx-lm's caches do);
- ``slice_update``: ``mx.slice_update(buf, new, mx.array([i]), (2,))``, eager;
- ``compiled``: the same inside ``mx.compile`` (what a traced decode step needs: one
  graph for every position);
- ``put_along_axis``: ``mx.put_along_axis`` with an index array.

A time that grows with the buffer's length is a copy of the buffer per write.
Why: a decode step traced once (``compiled_decode.py``) ran 3x slower than the
eager step at 1,280 positions on the H200, and as slow without ``mx.compile``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    import mlx.core as mx

    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    lengths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "256,1280,4096").split(",")]
    dtype = mx.bfloat16 if mx.cuda.is_available() or mx.metal.is_available() else mx.float32
    new = mx.ones((rows, 8, 1, 64), dtype)

    def setitem(buf: Any, i: int) -> Any:
        buf[..., i : i + 1, :] = new
        return buf

    def dynamic(buf: Any, i: int) -> Any:
        return mx.slice_update(buf, new, mx.array([i]), (2,))

    traced = mx.compile(lambda buf, at: mx.slice_update(buf, new, at, (2,)))

    def compiled(buf: Any, i: int) -> Any:
        return traced(buf, mx.array([i]))

    def put(buf: Any, i: int) -> Any:
        index = mx.full((rows, 8, 1, 64), i, mx.int32)
        return mx.put_along_axis(buf, index, new, axis=2)

    ways: dict[str, Callable[[Any, int], Any]] = {
        "setitem": setitem, "slice_update": dynamic, "compiled": compiled,
        "put_along_axis": put,
    }  # fmt: skip
    print(f"{rows} rows, 8 KV heads of 64, {dtype}; microseconds per write, evaluated each time")
    for length in lengths:
        line = []
        for name, way in ways.items():
            buf = mx.zeros((rows, 8, length, 64), dtype)
            mx.eval(buf)
            for i in range(5):
                buf = way(buf, i)
                mx.eval(buf)
            t0 = time.perf_counter()
            for i in range(100):
                buf = way(buf, (5 + i) % length)
                mx.eval(buf)
            line.append(f"{name} {(time.perf_counter() - t0) / 100 * 1e6:8.0f}")
            del buf
        megabytes = rows * 8 * length * 64 * new.itemsize / 1e6
        print(f"  length {length:5d} ({megabytes:5.0f} MB): " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
