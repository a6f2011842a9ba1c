"""What the fused decode attention's calls cost the first time a process meets them.

    python bench/experiments/kernel_compile.py

MLX compiles a custom CUDA kernel (``mx.fast.cuda_kernel``) with NVRTC the first
time a process launches each distinct source and keeps it in memory only, never
in its PTX cache on disk. In a fresh process this times, synchronised, calls of
:func:`trio_mlx._accel.decode_attention.decode_attention` in the order a server meets
them: a few rows (the load's check), 64 rows (a served batch: before the
fifteenth round, another warps template and so another compile), the same
again, the traced step's variant (with ``stop``) at 64 rows, and again.
"""

from __future__ import annotations

import time


def main() -> None:
    import mlx.core as mx

    from trio_mlx._accel import decode_attention as _decode_attention

    def call(rows: int, stopped: bool) -> float:
        q = mx.zeros((rows, 32, 1, 64), dtype=mx.bfloat16)
        kv = mx.zeros((rows, 8, 4352, 64), dtype=mx.bfloat16)
        start = mx.zeros((rows,), dtype=mx.int32)
        stop = mx.array([4097], dtype=mx.int32) if stopped else None
        mx.eval(q, kv, start)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(_decode_attention.decode_attention(q, kv, kv, start, 0.125, stop))
        mx.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for label, rows, stopped in [
        ("3 rows, no stop (the load's check)", 3, False),
        ("64 rows, no stop (an eager step of a served batch)", 64, False),
        ("64 rows, no stop, again", 64, False),
        ("64 rows, stop (the traced step)", 64, True),
        ("64 rows, stop, again", 64, True),
    ]:
        warps = _decode_attention._warps(rows * 8, 4, 64)
        print(f"{label}: {call(rows, stopped):8.1f} ms ({warps} warps)", flush=True)


if __name__ == "__main__":
    main()
