"""What admitting a group of short prompts costs the rows already decoding.

``python bench/experiments/admission_cost.py [MODEL] [ROWS] [GROUP] [ROUNDS] [width=M]``
(default ``llama-1b``, 54 rows, groups of 10, 16 rounds) loads the model as the
engine does, lets ROWS rows decode, then ROUNDS times: times 20 steady steps,
inserts GROUP chat-sized prompts (118-128 tokens, lengths drawn per round from a
seeded generator, so some (rows, width) shapes come again and some are new),
and calls ``BatchLane.step`` one decode step per call until every new row has
its first token. It prints, per admission (and per step: its wall time and the
lane's own timings, prompt tokens and seconds inside ``BatchGenerator.next()``,
the rest being the lane's host work: joins, removals, events), the steps it
took, its worst step and its time over the steady median (what the running rows lost), and whether
the group's shape (rows, longest prompt, after ``width=M`` padding) was met
before. At the end: the mean cost of admissions at a new shape and at a shape
met before.

Why: on the H200 at 64 closed-loop streams the server's ITL p50 was 8-9 ms and
its p99 33-45 ms, and its mean step (tok/s over 64 rows) about 12 ms against
the bare loop's 9-10 with all rows together: most of the 0.8x lies in the
steps that admit rows (design/performance.md, ninth round). This says how much
of an admission is its prefill arithmetic and how much the first time a shape
is met.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from bench.experiments.long_stall import steady_median
from bench.suite import models
from bench.suite.inproc import prompt_ids

from trio_mlx import SamplingParams
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx._start.loading import LoadSettings, load


def main() -> None:
    args = [a for a in sys.argv[1:] if "=" not in a]
    name = args[0] if args else "llama-1b"
    rows = int(args[1]) if len(args) > 1 else 54
    group = int(args[2]) if len(args) > 2 else 10
    rounds = int(args[3]) if len(args) > 3 else 16
    width = [int(a[6:]) for a in sys.argv[1:] if a.startswith("width=")]
    loaded = load(str(models.prepare(name).path), LoadSettings(max_batch=rows + group))
    lane, tokenizer = loaded.lane, loaded.tokenizer
    lane.prompt_cache = None  # every admission prefills its whole prompt
    if width:
        lane.prefill_width_multiple = width[0]
    multiple = lane.prefill_width_multiple
    print(f"{rows} rows decoding, groups of {group}, prefill budget {lane.prefill_budget}, "
          f"width multiple {multiple}", flush=True)  # fmt: skip
    forever = SamplingParams(max_tokens=100_000, temperature=0.0)
    base = prompt_ids(tokenizer, rows, 123, seed=3)
    lane.step(StepPlan([RowSpec(i + 1, tuple(p), forever) for i, p in enumerate(base)]))
    for _ in range(40):
        lane.step()
    rng = random.Random(7)
    seen: set[tuple[int, int]] = set()
    costs: dict[bool, list[float]] = {True: [], False: []}
    row_id = 10_000
    for r in range(rounds):
        median = steady_median(lane, 20)
        lengths = [rng.randint(118, 128) for _ in range(group)]
        longest = -(-max(lengths) // multiple) * multiple
        shape = (group, longest)
        met = shape in seen
        seen.add(shape)
        prompts = prompt_ids(tokenizer, group, 130, seed=100 + r)
        ids = list(range(row_id, row_id + group))
        row_id += group
        specs = [
            RowSpec(i, tuple(p[:n]), SamplingParams(max_tokens=2))
            for i, p, n in zip(ids, prompts, lengths, strict=True)
        ]
        plan, waiting, gaps, parts = StepPlan(specs), set(ids), [], []
        while waiting and len(gaps) < 50:
            t0 = time.perf_counter()
            result = lane.step(plan)
            gaps.append(time.perf_counter() - t0)
            parts.append(
                f"{gaps[-1] * 1e3:.1f} ms: "
                + "+".join(f"{n}t {s * 1e3:.1f}" for n, s in result.timings)
            )
            plan = StepPlan()
            waiting -= {e.id for e in result.events if e.token_ids}
        extra = sum(gaps) - median * len(gaps)
        costs[met].append(extra)
        print(f"  round {r:2d}: shape {shape} {'met before' if met else 'new':10s} "
              f"{len(gaps)} steps, worst {max(gaps) * 1e3:6.1f} ms "
              f"({max(gaps) / median:4.1f}x the median {median * 1e3:.1f} ms), "
              f"{extra * 1e3:6.1f} ms over the median", flush=True)  # fmt: skip
        print(f"    steps (wall: prompt tokens and ms in next() per decode step): "
              f"{'; '.join(parts)}", flush=True)  # fmt: skip
        lane.step(StepPlan(removes=ids))
    for met, label in ((False, "new shape"), (True, "shape met before")):
        if costs[met]:
            print(f"admissions at a {label}: {len(costs[met])}, mean "
                  f"{statistics.mean(costs[met]) * 1e3:.1f} ms over the median", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
