"""Optional start-up work on CUDA: meet the matmul shapes traffic will meet, once.

Theory of operation
===================

On MLX's CUDA backend a matmul of a row count M not met before costs about
4 ms on top of the matmul; the second call costs 0.2 ms. Measured on the H200
(design/performance.md):
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

Kernels compiled on first use
=============================

MLX's CUDA backend compiles a kernel module with NVRTC the first time a
process meets it (each fused graph, gather, scatter and custom kernel of a new
kind), a second or more each on the H200; a fresh server's first requests
stalled 2.3-12.6 s on them (design/performance.md). MLX keeps
what it compiled on disk (``<temp>/mlx/<version>/ptx``), so later processes on
the machine load them instead. With the same variable, :func:`lane_pass` then
runs the loaded lane through a small schedule that meets its paths once before
traffic does: a batch of rows above and below 32 (the decode-attention kernel's
two block sizes), prompts of several lengths and one longer than the prefill
budget (chunked), rows joining a decoding batch, finishing at different steps
(removal), cancelled, parked and resumed, a buffer filled past mlx-lm's
256-position step (its own step grows it), a prompt-cache hit, and one row alone
(the solo step). What it leaves: no rows, an empty prompt cache, the traced
step's shapes. Not measured on the H200 yet: whether it moves the first
requests' stalls to start-up.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from trio_mlx._accel import install as _accel
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx._params import SamplingParams

__all__ = ["lane_pass", "prime", "prime_widths", "warm_up"]

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


#: The most lane calls :func:`lane_pass` makes (its schedule needs a few hundred).
LANE_PASS_STEPS = 3000


def lane_pass(lane: BatchLane) -> dict[str, float]:
    """Run ``lane`` (empty, loaded) through every path traffic takes, once; see the notes.

    Returns the rows run, the lane calls made and the prompt tokens served from the
    prompt cache. The rows' tokens are thrown away; the lane is left without rows
    and its prompt cache empty, whether the schedule ends or raises.
    """
    try:
        return _schedule(lane)
    finally:
        if lane.rows:  # the bound, or an error: never leave rows behind
            lane.discard(range(2 * lane.max_batch + 4))  # every id the schedule uses
        if lane.prompt_cache is not None:
            lane.prompt_cache.clear()


def _schedule(lane: BatchLane) -> dict[str, float]:
    eos = set(lane.tokenizer.eos_token_ids)
    # Any ordinary token will do: the rows' content does not matter.
    token = next(t for t in range(3, 1000) if t not in eos)
    no_eos = dict.fromkeys(eos, -100.0)
    budget = lane.prefill_budget or 256
    lengths = [3, 17, 64, 130, 250]
    first = max(1, min(lane.max_batch - 4, 40))

    def spec(row_id: int, length: int, tokens: int) -> RowSpec:
        prompt = tuple([token] * (length - 1) + [token + 1 + row_id % 7])
        return RowSpec(row_id, prompt, SamplingParams(max_tokens=tokens, logit_bias=no_eos))

    calls = rows = cached = 0

    def run(plan: StepPlan, *, drain: bool) -> None:
        nonlocal calls, rows, cached
        rows += len(plan.inserts)
        cached += sum(lane.step(plan).cached.values())
        calls += 1
        while drain and lane.rows and calls < LANE_PASS_STEPS:
            lane.step()
            calls += 1

    # A batch above 32 rows (or the lane's most), prompts of several lengths,
    # finishing at different steps; the 250-token ones cross position 256.
    run(
        StepPlan([spec(i, lengths[i % 5], (30, 4, 9, 16)[i % 4]) for i in range(first)]),
        drain=False,
    )
    run(StepPlan(), drain=False)
    run(StepPlan(), drain=False)
    # Rows join while others decode: one longer than the prefill budget, one
    # cancelled at once.
    run(StepPlan([spec(first, budget * 2 + 5, 6), spec(first + 1, 40, 8)]), drain=False)
    run(StepPlan(removes=[first + 1]), drain=False)
    lane.park([0])  # row 0 decodes 30 tokens: still in the batch
    run(StepPlan(resumes=[0]), drain=True)
    # The 130-token prompt again, stored when its row finished: a prompt-cache hit.
    # Then one row alone (the solo step), under 32 rows.
    run(StepPlan([spec(2 * first + 3, 130, 4)]), drain=True)
    run(StepPlan([spec(first + 2, 9, 5)]), drain=True)
    return {"lane_rows": float(rows), "lane_calls": float(calls), "lane_cached": float(cached)}


def warm_up(
    model: Any,
    max_batch: int,
    prefill_budget: int,
    environ: Mapping[str, str] | None = None,
    *,
    cuda: bool | None = None,
    lane: BatchLane | None = None,
) -> dict[str, float]:
    """:func:`prime` (and :func:`lane_pass` over ``lane``) on CUDA when
    ``TRIO_MLX_CUDA_WARMUP=1``: what each did and the seconds taken.

    ``environ`` defaults to ``os.environ`` and ``cuda`` to whether MLX's CUDA
    backend is available (both are parameters for the tests).
    """
    environ = os.environ if environ is None else environ
    if environ.get("TRIO_MLX_CUDA_WARMUP", "0") != "1":
        return {}
    if not _accel.on_cuda(cuda):
        return {}
    done: dict[str, float] = {}
    start = time.perf_counter()
    widths = prime_widths(max_batch, prefill_budget)
    prime(model, widths)
    done["primed_widths"] = float(len(widths))
    if lane is not None:
        try:
            done.update(lane_pass(lane))
        except Exception:  # a warm-up never keeps the server from starting
            logger.warning("CUDA warm-up: the lane pass failed; serving without it", exc_info=True)
    done["seconds"] = time.perf_counter() - start
    logger.info("CUDA warm-up: %s", done)
    return done
