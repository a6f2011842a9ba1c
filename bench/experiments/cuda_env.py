"""The bare closed loop under MLX's CUDA graph settings, and with the fused attention.

``python bench/experiments/cuda_env.py [MODEL] [SECONDS]`` runs the bench suite's
bare closed loops (rows together, and staggered) at B = 8 and 64 once per
variant, each in a process of its own (MLX reads these variables once):
MLX's defaults; no CUDA graphs (``MLX_USE_CUDA_GRAPHS=0``: kernels launched
one by one); graphs of up to 400 and 1,000 operations
(``MLX_MAX_OPS_PER_BUFFER``, 100 on an H200 by default); and MLX's defaults
with trio-mlx's decode attention installed in the bare model. The step is
host-bound (design/performance.md): this shows what the launch path costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.suite import models

VARIANTS: dict[str, dict[str, str]] = {
    "defaults": {},
    "no graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
    "400 ops per graph": {"MLX_MAX_OPS_PER_BUFFER": "400"},
    "1000 ops per graph": {"MLX_MAX_OPS_PER_BUFFER": "1000"},
    "fused attention": {"KERNEL": "1"},
}


def main() -> None:
    model = models.prepare(sys.argv[1] if len(sys.argv) > 1 else "llama-1b")
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    for name, extra in VARIANTS.items():
        job = {
            "kind": "closed", "model": str(model.path), "prompt_len": 60, "max_tokens": 128,
            "batches": [8, 64], "warm_seconds": 1.5, "seconds": seconds,
            "kernel": extra.pop("KERNEL", None) is not None,
        }  # fmt: skip
        env = {**os.environ, **extra}
        done = subprocess.run(
            [sys.executable, "-m", "bench.suite.inproc", json.dumps(job)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if done.returncode:
            print(f"{name}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        for line in done.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                cells = ", ".join(
                    f"{kind} {r[kind]['tok_s']:.0f} tok/s ({r[kind]['step_ms']:.1f} ms/step)"
                    for kind in ("together", "staggered")
                )
                print(f"{name:>20} B={r['batch']:>3}: {cells}", flush=True)


if __name__ == "__main__":
    main()
