"""Token timelines and the numbers taken from them, shared by every benchmark.

A run of B rows is recorded as, per row, the times its tokens arrived. Two rates
come out of it, for the engine and the bare loop alike:

* ``e2e``: every token over the whole run (prompt processing and the tail included);
* ``decode``: the steady state, from the moment the last row got its first token
  to the moment the first row finished: every row decodes the whole window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def rates(start: float, rows: Sequence[Sequence[tuple[float, int]]]) -> dict[str, Any]:
    """``e2e`` and ``decode`` tokens/s of rows given as ``[(arrival time, tokens), ...]``."""
    rows = [row for row in rows if row]
    total = sum(n for row in rows for _, n in row)
    end = max(row[-1][0] for row in rows)
    t0 = max(row[0][0] for row in rows)
    t1 = min(row[-1][0] for row in rows)
    window = sum(n for row in rows for t, n in row if t0 < t <= t1)
    decode = window / (t1 - t0) if t1 > t0 and window else None
    return {
        "tokens": total,
        "seconds": end - start,
        "e2e_tok_s": total / (end - start),
        "decode_tok_s": decode,
        "ttft_max_s": t0 - start,
    }
