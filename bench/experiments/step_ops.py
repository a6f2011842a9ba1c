"""The MLX operations of one batched decode step of a model, by kind.

The decode step is host-bound on the H200 (design/performance.md): each
operation MLX evaluates costs host time to encode and launch. ``python
bench/experiments/step_ops.py [MODEL] [B]`` builds one step's graph (the
model's forward over a ``BatchKVCache``, log-softmax and argmax, as the lane
runs it) and counts its nodes with ``mx.export_to_dot``. On the CPU, MLX's
fast operations show as their plain-op fallbacks; run it where they are kernels.
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
from bench.suite import models
from mlx_lm.models.cache import BatchKVCache


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    model, _ = mlx_lm.load(str(models.prepare(name).path))
    from trio_mlx._accel.decode_attention import install

    print("fused attention installed:", install(model))
    cache = [BatchKVCache([i % 3 for i in range(rows)]) for _ in model.layers]
    mx.eval(model(mx.ones((rows, 8), dtype=mx.int32), cache=cache))
    logits = model(mx.ones((rows, 1), dtype=mx.int32), cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    token = mx.argmax(logprobs, axis=-1)
    dot = Path(tempfile.mkdtemp()) / "step.dot"
    mx.export_to_dot(str(dot), token, logprobs)
    kinds = collections.Counter(re.findall(r'label ="([A-Za-z_0-9]+)', dot.read_text()))
    print(f"{len(model.layers)} layers, B={rows}: {sum(kinds.values())} operations")
    print(", ".join(f"{k} {n}" for k, n in kinds.most_common()))


if __name__ == "__main__":
    main()
