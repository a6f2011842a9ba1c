"""The MLX CUDA backend settings trio-mlx chooses, unless the user chose.

Theory of operation
===================

MLX reads a few of its CUDA backend's settings from the environment once, the
first time the setting is needed, and keeps the value for the process. One of
them costs served traffic a great deal: ``MLX_CUDA_USE_CUDNN_SDPA`` (default
on) sends prefill attention to cuDNN, which builds an execution plan for each
new shape. In a server every prefill group has its own shape (the number of
rows, their padded length, the cached prefix), so the plans are built again
and again on the one MLX thread while the GPU idles. Measured side by side on
the H200 (design/performance.md): with cuDNN
attention off, served throughput rose 24-35% at 8-64 streams, time to first
token halved, and long prompts reached their first token 26-45% sooner.
Without cuDNN, MLX's own attention serves prefill (matmuls and a softmax),
which holds one chunk's score matrix at a time: query heads x chunk tokens x
keys, in the model's dtype (Llama-3.2-1B's 32 heads, a 1,536-token chunk and
4,096 keys in bf16: 0.4 GB; against 32,768 keys: 3.2 GB). On a GPU with
little memory to spare for very long prompts, a smaller ``prefill_budget``
bounds it, or ``MLX_CUDA_USE_CUDNN_SDPA=1`` brings cuDNN back.

The second is ``MLX_ENABLE_CACHE_THRASHING_CHECK`` (default on): once one of
MLX's CUDA caches has missed more than twice its capacity, the evaluation that
missed raises "Cache thrashing". For a notebook that is a hint to raise the
cache size; for a server it fails every row in the batch, and served prefill
shapes never stop being new. Measured on the H200: with ``MLX_CUDA_USE_CUDNN_SDPA=1``
a process raised it before its 700th distinct prompt length, and with the check
off it ran all 700. The engine turns the check off (a cache that misses then
costs time, not the batch); a user who sets either variable keeps their value.

:func:`apply` sets the engine's defaults in ``os.environ`` before the model
loads (on the MLX thread, ahead of any attention call), only on the CUDA
backend and only for variables the user has not set: exporting
``MLX_CUDA_USE_CUDNN_SDPA=1`` keeps cuDNN. Because MLX keeps the first value
it read, an embedding program that ran MLX attention on CUDA before opening
the engine keeps whatever was in force then (:func:`apply` cannot tell; it
logs what it set), and the variable stays in the process's environment, so
child processes started afterwards inherit it. :data:`DEFAULTS` is public to
the bench suite, which runs its reference loops and ``mlx_lm.server`` under
the same settings, so that comparisons stay like with like.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

__all__ = ["DEFAULTS", "apply", "on_cuda"]

logger = logging.getLogger("trio_mlx")

#: Variable -> the engine's value on CUDA (see the module's docstring for why).
DEFAULTS: dict[str, str] = {
    "MLX_CUDA_USE_CUDNN_SDPA": "0",
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
}


def on_cuda(cuda: bool | None = None) -> bool:
    """``cuda`` if given (the tests' override), else whether MLX's CUDA backend is available."""
    if cuda is None:
        import mlx.core as mx

        cuda = bool(mx.cuda.is_available())
    return cuda


def apply(
    environ: MutableMapping[str, str] | None = None, *, cuda: bool | None = None
) -> dict[str, str]:
    """Set :data:`DEFAULTS` that are unset, on the CUDA backend; return what was set.

    ``environ`` defaults to ``os.environ`` and ``cuda`` to whether MLX's CUDA
    backend is available (both are parameters for the tests).
    """
    if environ is None:
        environ = os.environ
    if not on_cuda(cuda):
        return {}
    chosen = {name: value for name, value in DEFAULTS.items() if name not in environ}
    environ.update(chosen)
    if chosen:
        logger.info("MLX CUDA settings chosen by trio-mlx: %s", chosen)
    return chosen
