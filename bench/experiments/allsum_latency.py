"""Latency of ``mx.distributed.all_sum`` on the group ``mlx.launch`` made: what a
tensor-parallel decode step pays per collective.

A sharded llama step runs two all_sums per layer (attention out, MLP down) on
[B, 1, hidden] activations. This times, for B in 1, 8, 32 and hidden 4096 (bf16):
one all_sum evaluated alone (a host round trip), and ``--chain`` all_sums in one
graph (what a 32-layer step queues: 64), per collective.

    mlx.launch -n 2 --backend nccl --python python3 -- bench/experiments/allsum_latency.py
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chain", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    group = mx.distributed.init()
    say = print if group.rank() == 0 else (lambda *_: None)
    say(f"ranks {group.size()}, device {mx.default_device()}")
    for batch in (1, 8, 32):
        x = mx.ones((batch, 1, args.hidden), dtype=mx.bfloat16)
        for _ in range(5):
            mx.eval(mx.distributed.all_sum(x, group=group))
        start = time.perf_counter()
        for _ in range(args.repeats):
            mx.eval(mx.distributed.all_sum(x, group=group))
        alone = (time.perf_counter() - start) / args.repeats
        start = time.perf_counter()
        for _ in range(args.repeats // 5 or 1):
            y = x
            for _ in range(args.chain):
                y = mx.distributed.all_sum(y, group=group) * 0.5
            mx.eval(y)
        chained = (time.perf_counter() - start) / ((args.repeats // 5 or 1) * args.chain)
        say(
            f"B={batch}: one all_sum with its eval {alone * 1e6:.0f} us; "
            f"in a chain of {args.chain}: {chained * 1e6:.0f} us each "
            f"({chained * args.chain * 1e3:.2f} ms per chain)"
        )


if __name__ == "__main__":
    main()
