"""CPU seconds per generated token of ``trio-mlx serve`` under streaming clients.

CPU time of the server process (utime + stime) is robust to a loaded machine, unlike tok/s.
Run from the repo root: ``python -m bench.servecost [--streams 24] [--requests 4] [--tokens 64]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench.suite import loadgen, models, servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--requests", type=int, default=4, help="requests per stream")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model = models.prepare(args.model)
    env = dict(os.environ)
    with servers.trio_mlx_server(
        model.path, max_batch=args.streams, env=env, log_dir=Path(tempfile.mkdtemp())
    ) as server:
        spec = {
            "mode": "closed", "url": server.url, "streams": args.streams, "requests": 1,
            "max_tokens": 4, "prompt_words": 16, "model": server.model,
            "logit_bias": model.logit_bias,
        }  # fmt: skip
        loadgen.run_clients([spec])  # warm-up: compile, first batch shapes
        for _ in range(args.rounds):
            spec = {**spec, "requests": args.requests, "max_tokens": args.tokens}
            before = server.cpu_seconds()
            records = loadgen.run_clients([spec])[0]["records"]
            cpu = server.cpu_seconds() - before
            tokens = sum(r.get("tokens") or 0 for r in records)
            errors = sum(1 for r in records if r.get("error"))
            print(
                f"streams={args.streams} tokens={tokens} errors={errors} cpu_s={cpu:.2f} "
                f"cpu_us_per_token={1e6 * cpu / max(tokens, 1):.0f}",
                flush=True,
            )
    sys.exit(0)


if __name__ == "__main__":
    main()
