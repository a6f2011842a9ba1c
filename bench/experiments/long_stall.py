"""Which lane steps stall the running rows while a long prompt is prefilled.

``python bench/experiments/long_stall.py [MODEL] [ROWS] [LONG ...] [budget=N] [width=M]``
(default ``llama-1b``, 63 rows, long prompts of 3000, 3500 and 4000 tokens) loads
the model as the engine does (its prefill budget for the device, or N; with
``mlx-join``, rows join the batch by mlx-lm's ``BatchKVCache.extend`` instead of
the lane's ``join_caches``; with ``width=M``, every prefill pass right-padded to a
multiple of M: ``BatchLane.prefill_width_multiple``; with ``keys=P``, every
prefill pass's attention over keys padded to a multiple of P, the tail masked out,
so that a chunk at a new offset meets a key length met before (an experiment's
patch of mlx-lm's ``BatchKVCache``, not an engine setting); with ``time-join``, each
join synchronised and timed, beside fresh zeroed arrays of its size), lets ROWS rows
decode, then inserts one long prompt at a time and calls ``BatchLane.step``
one decode step per call until the long row's first token. Every call's wall
time is the running rows' gap for that step (decode is pipelined, so a call
waits for the step before it). It prints the median gap of the steady steps
before each arrival, every step from the arrival to the first token with what
it did (prompt tokens prefilled, whether the long row joined, garbage
collections, the lane's own per-step timings: ``StepResult.timings``), and the largest gap over the median: the issue's latency ratio
without HTTP, clients or the actor.
"""

from __future__ import annotations

import gc
import logging
import statistics
import sys
import time
from typing import Any

from bench.suite import models
from bench.suite.inproc import prompt_ids

from trio_mlx import SamplingParams
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx._start.loading import LoadSettings, load


def time_joins() -> None:
    """Time each join, synchronised, and fresh zeroed arrays of its size twice."""
    import mlx.core as mx

    import trio_mlx._lanes.batch

    real = trio_mlx._lanes.batch.join_caches

    def timed_join(ours: list[Any], theirs: list[Any]) -> bool:
        mx.synchronize()
        t0 = time.perf_counter()
        joined = real(ours, theirs)
        t1 = time.perf_counter()
        arrays = [c.keys for c in ours] + [c.values for c in ours]
        mx.eval(arrays)
        mx.synchronize()
        t2 = time.perf_counter()
        shape, dtype = arrays[0].shape, arrays[0].dtype
        fresh = []
        for _ in range(2):
            t3 = time.perf_counter()
            zeros = [mx.zeros(shape, dtype) for _ in arrays]
            mx.eval(zeros)
            mx.synchronize()
            fresh.append((time.perf_counter() - t3) * 1e3)
            del zeros
        gib = len(arrays) * arrays[0].nbytes / 2**30
        print(f"    join {tuple(shape)} x {len(arrays)} ({gib:.1f} GiB): build "
              f"{(t1 - t0) * 1e3:.1f} ms, run {(t2 - t1) * 1e3:.1f} ms; fresh zeros "
              f"{fresh[0]:.1f} ms, again {fresh[1]:.1f} ms", flush=True)  # fmt: skip
        return joined

    trio_mlx._lanes.batch.join_caches = timed_join


def steady_median(lane: Any, steps: int) -> float:
    """The median wall time of ``steps`` plain decode steps (seconds)."""
    gaps = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lane.step()
        gaps.append(time.perf_counter() - t0)
    return statistics.median(gaps)


def pad_keys(multiple: int) -> None:
    """Prefill passes (N > 1) attend over keys padded to ``multiple``, the tail masked out."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    update, make_mask = BatchKVCache.update_and_fetch, BatchKVCache.make_mask

    def padded(length: int) -> int:
        return -(-length // multiple) * multiple

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        k, v = update(self, keys, values)
        if keys.shape[2] == 1:
            return k, v
        end = padded(self._idx)
        short = end - self.keys.shape[2]
        if short > 0:  # room for the padded tail (never read: the mask hides it)
            grow = [(0, 0), (0, 0), (0, short), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, grow), mx.pad(self.values, grow)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def padded_mask(self: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = make_mask(self, N, return_array=return_array, **kwargs)
        if N == 1 or not isinstance(mask, mx.array):
            return mask
        extra = padded(self._idx + N) - mask.shape[-1]  # built before the keys are stored
        if extra <= 0:
            return mask
        tail = mx.zeros((*mask.shape[:-1], extra), dtype=mx.bool_)
        return mx.concatenate([mask, tail], axis=-1)

    BatchKVCache.update_and_fetch = update_and_fetch  # type: ignore[method-assign]
    BatchKVCache.make_mask = padded_mask  # type: ignore[method-assign]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 63
    budget = [int(x[7:]) for x in sys.argv[3:] if x.startswith("budget=")]
    longs = [int(x) for x in sys.argv[3:] if x.isdigit()] or [3000, 3500, 4000]
    if "mlx-join" in sys.argv:
        import trio_mlx._lanes.batch

        trio_mlx._lanes.batch.join_caches = lambda ours, theirs: False
    if "time-join" in sys.argv:
        time_joins()
    for arg in sys.argv[3:]:
        if arg.startswith("keys="):
            pad_keys(int(arg[5:]))
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the CUDA warm-up's line
    settings = LoadSettings(max_batch=rows + 1, prefill_budget=budget[-1] if budget else None)
    loaded = load(str(models.prepare(name).path), settings)
    lane, tokenizer = loaded.lane, loaded.tokenizer
    for arg in sys.argv[3:]:
        if arg.startswith("width="):
            lane.prefill_width_multiple = int(arg[6:])
    print(f"prefill budget {lane.prefill_budget}, width multiple "
          f"{lane.prefill_width_multiple}, {rows} rows", flush=True)  # fmt: skip
    collections: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(time.perf_counter())

    gc.callbacks.append(on_gc)
    params = SamplingParams(max_tokens=100_000, temperature=0.0)
    prompts = prompt_ids(tokenizer, rows, 123, seed=3)
    lane.step(StepPlan([RowSpec(i + 1, tuple(p), params) for i, p in enumerate(prompts)]))
    for _ in range(40):
        lane.step()
    row_id = 1000
    for length in longs:
        median = steady_median(lane, 30)
        row_id += 1
        long_prompt = tuple(prompt_ids(tokenizer, 1, length * 2, seed=length)[0][:length])
        plan = StepPlan([RowSpec(row_id, long_prompt, SamplingParams(max_tokens=4))])
        print(f"long prompt {len(long_prompt)} tokens; steady gap median {median * 1e3:.1f} ms")
        worst, k = 0.0, 0
        while True:
            before = lane._prefilling.get(next(iter(lane._prefilling), -1), None)
            mark = len(collections)
            t0 = time.perf_counter()
            result = lane.step(plan)
            gap = time.perf_counter() - t0
            plan = StepPlan()
            first = any(e.id == row_id and e.token_ids for e in result.events)
            worst = max(worst, gap)
            print(f"  step {k}: {gap * 1e3:7.1f} ms  ({gap / median:4.1f}x)  "
                  f"left to prefill before {before}  gc {len(collections) - mark}  "
                  f"lane timings {[(p, round(t * 1e3, 1)) for p, t in result.timings]}"
                  f"{'  first token' if first else ''}", flush=True)  # fmt: skip
            k += 1
            if first or k > 50:
                break
        after = []
        for _ in range(10):
            t0 = time.perf_counter()
            lane.step()
            after.append(time.perf_counter() - t0)
        print(f"  worst {worst * 1e3:.1f} ms = {worst / median:.1f}x the median; "
              f"next 10 steps median {statistics.median(after) * 1e3:.1f} ms", flush=True)  # fmt: skip
        lane.step(StepPlan(removes=[row_id]))


if __name__ == "__main__":
    main()
