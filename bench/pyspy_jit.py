"""When a thread compiled GPU kernels, from a ``py-spy record --native --threads
--format speedscope`` profile.

    python bench/pyspy_jit.py spy.json[.gz] [--thread trio-mlx-worker]

Prints each stretch of consecutive samples of the thread whose stack was inside
MLX's CUDA kernel compiler (``nvrtcCompileProgram`` or ``JitModule``): its start
and length in the profile's seconds, the MLX primitive being evaluated (the
innermost ``eval_gpu`` frame) and the innermost Python frames. py-spy with native
frames slows the process a great deal: the order and the shares mean something,
the seconds only next to each other.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any


def stretches(profile: dict[str, Any], frames: list[dict[str, Any]]) -> list[tuple]:
    """(start, seconds, primitive, Python frames) of each compiling stretch."""
    out: list[tuple] = []
    current: tuple | None = None
    start = elapsed = now = 0.0
    for sample, weight in zip(profile["samples"], profile["weights"], strict=True):
        names = [frames[i]["name"] for i in sample]
        key = None
        if any("nvrtcCompileProgram" in n or "JitModule" in n for n in names):
            primitive = [n for n in names if "eval_gpu" in n][-1:]
            python = [
                f"{frames[i]['name'].rsplit('.', 1)[-1]}:{frames[i].get('line')}"
                for i in sample
                if str(frames[i].get("file", "")).endswith(".py")
            ]
            key = (tuple(primitive), tuple(python[-3:]))
        if key != current:
            if current is not None:
                out.append((start, elapsed, *current))
            current, start, elapsed = key, now, 0.0
        elapsed += weight
        now += weight
    if current is not None:
        out.append((start, elapsed, *current))
    return out


def threads(path: Path, thread: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The profile's frames and the sample lists of the threads named like ``thread``."""
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    profiles = [p for p in data["profiles"] if thread in p["name"]]
    return data["shared"]["frames"], profiles


def main() -> None:
    """Read the profile and print the thread's compiling stretches."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--thread", default="trio-mlx-worker")
    args = parser.parse_args()
    frames, profiles = threads(args.profile, args.thread)
    for profile in profiles:
        total = sum(profile["weights"])
        found = stretches(profile, frames)
        compiling = sum(seconds for _, seconds, *_ in found)
        print(f"{profile['name']}: {total:.1f} s sampled, {compiling:.1f} s compiling kernels")
        for start, seconds, primitive, python in found:
            print(f"  {start:7.2f} s  +{seconds:5.2f} s  {' '.join(primitive) or '?'}  "
                  f"{' > '.join(python)}")  # fmt: skip


if __name__ == "__main__":
    main()
