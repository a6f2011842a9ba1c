"""Whether the engine's MLX CUDA default takes effect: prefill attention per new shape.

``trio_mlx._accel.settings.apply()`` (the call the engine makes before it loads
a model) should leave MLX's cuDNN attention off, and the user's
``MLX_CUDA_USE_CUDNN_SDPA=1`` should keep it on. MLX reads the variable once,
at its first attention call, and cuDNN builds an execution plan for every new
shape, so the first call of each new prefill shape shows which path ran. Each
setting runs in a fresh process: the attention of Llama-3.2-1B's heads (32
query, 8 KV, dim 64, bf16, causal) for 12 prompt lengths never seen before,
then the same 12 again, milliseconds per call.
Run: ``python bench/experiments/cudnn_default.py`` (numbers in design/performance.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

LENGTHS = [97, 131, 177, 203, 251, 307, 353, 401, 449, 503, 557, 613]


def child() -> None:
    """Time the attention of each new shape (first call), then of the same shapes again."""
    from trio_mlx._accel import settings as _cuda_settings

    chosen = _cuda_settings.apply()
    import mlx.core as mx

    def call(length: int) -> float:
        q = mx.random.normal((1, 32, length, 64)).astype(mx.bfloat16)
        k = mx.random.normal((1, 8, length, 64)).astype(mx.bfloat16)
        mx.eval(q, k)
        start = time.perf_counter()
        out = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")
        mx.eval(out)
        return (time.perf_counter() - start) * 1e3

    call(64)  # MLX's own start-up, outside the timing
    first = [call(n) for n in LENGTHS]
    again = [call(n) for n in LENGTHS]
    print(
        f"set by the engine {chosen or 'nothing'}; variable now "
        f"{os.environ.get('MLX_CUDA_USE_CUDNN_SDPA')!r}: new shapes median "
        f"{sorted(first)[len(first) // 2]:.2f} ms (max {max(first):.2f}), seen shapes median "
        f"{sorted(again)[len(again) // 2]:.2f} ms",
        flush=True,
    )


def main() -> None:
    for label, value in [("unset", None), ("user =1", "1"), ("user =0", "0")]:
        env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_USE_CUDNN_SDPA"}
        if value is not None:
            env["MLX_CUDA_USE_CUDNN_SDPA"] = value
        print(f"{label}: ", end="", flush=True)
        subprocess.run([sys.executable, __file__, "child"], env=env, check=True, timeout=120)


if __name__ == "__main__":
    child() if sys.argv[1:] == ["child"] else main()
