"""Optional start-up work on CUDA: meet the matmul shapes traffic will meet, once.

Theory of operation
===================

On MLX's CUDA backend a matmul of a row count M not met before costs about
4 ms on top of the matmul; the second call costs 0.2 ms. Measured on the H200
(``bench/experiments/first_shape.py``; design/performance.md, eighth round):
the cost is per band of M (in a sweep of every M from 96 to 160 the first
calls over 1 ms fell at 96, 97, 105, 113, 121, 129, 136, 145 and 152), and
neither CUDA graphs off nor eager module loading changed it, so it is most
likely cuBLAS's per-shape set-up (not traced inside cuBLAS). A forward pass has several weight shapes, so a decode batch
of a new size or a prefill pass of a new width stalls its step by 10-30 ms,
while every running stream waits; a fresh server meets many of them.

:func:`warm_up` runs :func:`prime`: one forward pass into a scratch cache for
every token count in :func:`prime_widths` (each decode batch size up to
``max_batch``, and every multiple of 8 up to the prefill budget), so that
those bands are met before traffic. In the sweep, priming every 8th M left 2
of the 9 slow first calls. It takes 3.0 s at a 768-token budget and 5.8 s at
the GPU default of 1,536 (Llama-3.2-1B shape, H200).

**Off by default**, on ``TRIO_MLX_CUDA_WARMUP=1``: with it, neither the
in-process long-prompt trace nor the served traffic part moved beyond their
spread (two fresh servers with the same settings read 5,050 and 3,599 tok/s at
64 streams in one run), so the start-up time buys nothing measured yet.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trio_mlx import _cuda_settings

__all__ = ["prime", "prime_widths", "warm_up"]

logger = logging.getLogger("trio_mlx")


def prime_widths(max_batch: int, prefill_budget: int) -> list[int]:
    """The token counts :func:`prime` runs: every batch size, every 8th width to the budget."""
    return sorted(set(range(1, max_batch + 1)) | set(range(8, prefill_budget + 1, 8)))


def prime(model: Any, widths: Iterable[int]) -> None:
    """One forward pass of ``width`` tokens into a scratch cache, for each width."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    for width in widths:
        mx.eval(model(mx.zeros((1, width), dtype=mx.int32), cache=make_prompt_cache(model)))
    mx.clear_cache()


def warm_up(
    model: Any,
    max_batch: int,
    prefill_budget: int,
    environ: Mapping[str, str] | None = None,
    *,
    cuda: bool | None = None,
) -> dict[str, float]:
    """:func:`prime` on CUDA when ``TRIO_MLX_CUDA_WARMUP=1``: widths primed and seconds taken.

    ``environ`` defaults to ``os.environ`` and ``cuda`` to whether MLX's CUDA
    backend is available (both are parameters for the tests).
    """
    environ = os.environ if environ is None else environ
    if environ.get("TRIO_MLX_CUDA_WARMUP", "0") != "1":
        return {}
    if not _cuda_settings.on_cuda(cuda):
        return {}
    done: dict[str, float] = {}
    start = time.perf_counter()
    widths = prime_widths(max_batch, prefill_budget)
    prime(model, widths)
    done["primed_widths"] = float(len(widths))
    done["seconds"] = time.perf_counter() - start
    logger.info("CUDA warm-up: %s", done)
    return done
