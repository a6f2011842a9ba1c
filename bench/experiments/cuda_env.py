"""The bare closed loop under MLX's CUDA graph settings, and with the fused attention.

``python bench/experiments/cuda_env.py [MODEL] [SECONDS] [ROUNDS]`` runs the
bench suite's bare closed loops (rows together, and staggered) at B = 8 and 64
for each variant, in alternating order over the rounds, each in a process of
its own (MLX reads these variables once):
MLX's defaults; no CUDA graphs (``MLX_USE_CUDA_GRAPHS=0``: kernels launched
one by one); graphs of up to 1,000 operations
(``MLX_MAX_OPS_PER_BUFFER``, 100 on an H200 by default); and MLX's defaults
with trio-mlx's decode attention installed in the bare model. The step is
host-bound (design/performance.md): this shows what the launch path costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from bench.suite import models

#: Each variant's environment, and whether the bare model gets trio-mlx's attention.
VARIANTS: dict[str, tuple[dict[str, str], bool]] = {
    "defaults": ({}, False),
    "no graphs": ({"MLX_USE_CUDA_GRAPHS": "0"}, False),
    "1000 ops per graph": ({"MLX_MAX_OPS_PER_BUFFER": "1000"}, False),
    "fused attention": ({}, True),
}


def _once(
    model: str, name: str, extra: dict[str, str], kernel: bool, seconds: float
) -> dict[int, Any]:
    """One variant's process: tok/s and step times at each B, together and staggered."""
    job = {
        "kind": "closed", "model": model, "prompt_len": 60, "max_tokens": 128,
        "batches": [8, 64], "warm_seconds": 1.0, "seconds": seconds,
        "kernel": kernel,
    }  # fmt: skip
    env = {**os.environ, **extra}
    done = subprocess.run(
        [sys.executable, "-m", "bench.suite.inproc", json.dumps(job)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode:
        print(f"{name}: failed\n{done.stderr[-2000:]}", flush=True)
        return {}
    out: dict[int, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            out[r["batch"]] = r
    return out


def main() -> None:
    model = models.prepare(sys.argv[1] if len(sys.argv) > 1 else "llama-1b")
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    got: dict[str, list[dict[int, Any]]] = {name: [] for name in VARIANTS}
    for i in range(rounds):
        # Alternating order: a drift of the machine does not favour one variant.
        names = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        for name in names:
            run = _once(str(model.path), name, *VARIANTS[name], seconds)
            got[name].append(run)
            cells = ", ".join(
                f"B={b} {r['together']['tok_s']:.0f}/{r['staggered']['tok_s']:.0f}"
                for b, r in sorted(run.items())
            )
            print(f"round {i + 1} {name}: {cells} tok/s (together/staggered)", flush=True)
    for name, runs in got.items():
        for b in (8, 64):
            cells = []
            for kind in ("together", "staggered"):
                rates = [r[b][kind]["tok_s"] for r in runs if b in r]
                cells.append(f"{kind} " + "/".join(f"{x:.0f}" for x in rates) + " tok/s")
            print(f"{name:>20} B={b:>3}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
