"""MLX's CUDA ``mx.gather_mm`` faults on small shapes (seen with mlx-cuda 0.32.4 on an H200).

Run on a CUDA machine: ``python examples/upstream/gather_mm_cuda.py``. Each
case runs in its own process, because a misaligned address is a sticky CUDA
error: every later MLX call in that process fails too. Measured there (rows=3,
in 16 or 128 features, 4 stacked adapters): bfloat16 faults with a
misaligned address at every rank under 8, and at ranks 8-16 when the output
has 6 or 12 columns; float32 faults when the output has 6 columns at ranks 8
and 16; in 128 / out 128 at ranks >= 8 it works. Inside a captured CUDA
graph (the engine's batch lane) the same calls fail with
``cuGraphAddKernelNode ... invalid argument`` instead. trio-mlx therefore
computes its multi-LoRA layers without ``gather_mm`` on CUDA
(``trio_mlx._adapters.multilora.method_for_device``).
"""

from __future__ import annotations

import subprocess
import sys

ONE = r"""
import sys
import mlx.core as mx
dtype, rank, out = getattr(mx, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
x = mx.random.normal((3, 1, 16)).astype(dtype)
a = mx.random.normal((4, 16, rank)).astype(dtype)
b = mx.random.normal((4, rank, out)).astype(dtype)
ids = mx.array([2, 0, 1], dtype=mx.uint32)
mx.eval(mx.gather_mm(mx.gather_mm(x, a, rhs_indices=ids), b, rhs_indices=ids))
print("ok")
"""


def main() -> None:
    for dtype, rank, out in [("bfloat16", 4, 12), ("float32", 8, 6), ("float32", 8, 12)]:
        run = subprocess.run(
            [sys.executable, "-c", ONE, dtype, str(rank), str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        said = run.stdout.strip() or run.stderr.strip().splitlines()[-1]
        print(f"{dtype:9s} rank={rank:2d} out={out:3d}: {said}")


if __name__ == "__main__":
    main()
