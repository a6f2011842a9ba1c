"""Where a thread spent its long stalls, from a ``py-spy record --native --threads
--format speedscope`` profile.

    python bench/pyspy_stall.py spy.json[.gz] [--thread trio-mlx-worker] [--min 0.5]

A stall is a stretch of consecutive samples of the thread whose innermost Python
frame stays the same (one call that does not return: ``mx.async_eval`` queueing
a step, say) for at least ``--min`` seconds of the profile. For each, it prints
the stretch's start and length, its innermost Python frames, and the native
frames its samples were in: the MLX primitive being evaluated (innermost
``eval_gpu``) and the innermost named frames (a bare address is skipped), each with
its share of the stretch's samples. The stretches of an idle wait (``epoll``,
a condition variable) are left out with ``--busy``.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

from pyspy_jit import threads  # beside this file: run as ``python bench/pyspy_stall.py``

_IDLE = ("epoll_wait", "pthread_cond_wait", "pthread_cond_timedwait", "futex_wait", "sem_wait",
         "PyThread_acquire_lock")  # fmt: skip


def _python(frames: list[dict[str, Any]], sample: list[int]) -> tuple[str, ...]:
    return tuple(
        f"{frames[i]['name'].rsplit('.', 1)[-1]}:{frames[i].get('line')}"
        for i in sample
        if str(frames[i].get("file", "")).endswith(".py")
    )


def stalls(
    profile: dict[str, Any], frames: list[dict[str, Any]], least: float
) -> list[tuple[Any, ...]]:
    """(start, seconds, Python frames, samples) of each stretch at least ``least`` long."""
    out: list[tuple[Any, ...]] = []
    key: tuple[str, ...] | None = None
    members: list[list[int]] = []
    start = elapsed = now = 0.0
    for sample, weight in zip(profile["samples"], profile["weights"], strict=True):
        python = _python(frames, sample)[-3:]
        if python != key:
            if key is not None and elapsed >= least:
                out.append((start, elapsed, key, members))
            key, members, start, elapsed = python, [], now, 0.0
        members.append(sample)
        elapsed += weight
        now += weight
    if key is not None and elapsed >= least:
        out.append((start, elapsed, key, members))
    return out


def _named(frames: list[dict[str, Any]], sample: list[int]) -> list[str]:
    """The sample's frames that have a name (not a bare address), outermost first."""
    names = (frames[i]["name"] for i in sample)
    return [name[:60] for name in names if not name.startswith("0x")]


def _shares(names: list[str], top: int = 5) -> str:
    counts = collections.Counter(names)
    return "; ".join(f"{n / len(names):4.0%} {name}" for name, n in counts.most_common(top))


def main() -> None:
    """Read the profile and print the thread's stalls."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--thread", default="trio-mlx-worker")
    parser.add_argument("--min", type=float, default=0.5, help="shortest stall, in seconds")
    parser.add_argument("--busy", action="store_true", help="leave idle waits out")
    args = parser.parse_args()
    frames, profiles = threads(args.profile, args.thread)
    for profile in profiles:
        print(f"{profile['name']}: {sum(profile['weights']):.1f} s sampled")
        for start, seconds, python, members in stalls(profile, frames, args.min):
            leaves = [" < ".join(_named(frames, s)[::-1][:3]) for s in members]
            if args.busy and all(any(w in leaf for w in _IDLE) for leaf in leaves):
                continue
            primitives = [([frames[i]["name"] for i in s if "eval_gpu" in frames[i]["name"]]
                           or ["-"])[-1] for s in members]  # fmt: skip
            print(f"  {start:7.2f} s  +{seconds:5.2f} s  {' > '.join(python)}")
            print(f"      primitive: {_shares(primitives, 3)}")
            print(f"      innermost: {_shares(leaves)}")


if __name__ == "__main__":
    main()
