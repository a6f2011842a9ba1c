"""Per-thread summary of a ``py-spy record --format raw --threads`` profile.

    python bench/pyspy_summary.py profile.raw [--top 25]

For each sampled thread (most samples first): its sample count, then the frames
where it was (self) and the frames on its stack (inclusive), as shares of its
samples. py-spy stops the process to sample, so only the shares mean anything.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def main() -> None:
    """Read the raw profile and print each thread's self and inclusive shares."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    samples: Counter[str] = Counter()
    own: dict[str, Counter[str]] = {}
    within: dict[str, Counter[str]] = {}
    for line in args.raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        n = int(count)
        samples[thread] += n
        if frames:
            own.setdefault(thread, Counter())[frames[-1]] += n
        for frame in set(frames):
            within.setdefault(thread, Counter())[frame] += n
    for thread, total in samples.most_common():
        print(f"== {thread}: {total}")
        for title, table in (("self", own), ("inclusive", within)):
            print(f" -- {title}")
            for frame, n in table.get(thread, Counter()).most_common(args.top):
                print(f"  {100 * n / total:5.1f}% {frame}")


if __name__ == "__main__":
    main()
