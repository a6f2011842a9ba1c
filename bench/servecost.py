"""CPU seconds per generated token of ``trio-mlx serve`` under streaming clients.

CPU time of the server process (utime + stime) is robust to a loaded machine, unlike tok/s.
Run from the repo root: ``python -m bench.servecost [--streams 24] [--requests 4] [--tokens 64]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.suite import loadgen, models, servers


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) of each thread of ``pid``: "main" (the Trio thread) or its id."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main (Trio)" if task.name == str(pid) else f"thread {task.name}"
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--requests", type=int, default=4, help="requests per stream")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompt-words", type=int, default=16, help="words per prompt")
    parser.add_argument("--max-batch", type=int, default=0, help="default: max(2, streams)")
    parser.add_argument("--py-spy", default=None, help="also record a py-spy raw profile here")
    args = parser.parse_args()
    model = models.prepare(args.model)
    env = dict(os.environ)
    with servers.trio_mlx_server(
        model.path,
        max_batch=args.max_batch or max(2, args.streams),
        env=env,
        log_dir=Path(tempfile.mkdtemp()),
    ) as server:
        spec = {
            "mode": "closed", "url": server.url, "streams": args.streams, "requests": 1,
            "max_tokens": 4, "prompt_words": args.prompt_words, "model": server.model,
            "logit_bias": model.logit_bias,
        }  # fmt: skip
        loadgen.run_clients([spec])  # warm-up: compile, first batch shapes
        for _ in range(args.rounds):
            spec = {**spec, "requests": args.requests, "max_tokens": args.tokens}
            spy = None
            if args.py_spy:
                spy = subprocess.Popen(
                    ["py-spy", "record", "-p", str(server.process.pid), "-r", "200", "--threads",
                     "--format", "raw", "-o", args.py_spy],
                )  # fmt: skip
            before = server.cpu_seconds()
            threads_before = thread_cpu(server.process.pid)
            started = time.monotonic()
            records = loadgen.run_clients([spec])[0]["records"]
            wall = time.monotonic() - started
            cpu = server.cpu_seconds() - before
            threads = thread_cpu(server.process.pid)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            tokens = sum(r.get("tokens") or 0 for r in records)
            errors = sum(1 for r in records if r.get("error"))
            print(
                f"streams={args.streams} tokens={tokens} errors={errors} cpu_s={cpu:.2f} "
                f"cpu_us_per_token={1e6 * cpu / max(tokens, 1):.0f} wall_s={wall:.2f} "
                f"tok_s={tokens / wall:.0f}",
                flush=True,
            )
            for name in sorted(threads, key=lambda n: -threads[n]):
                spent = threads[name] - threads_before.get(name, 0.0)
                if spent > 0.005 * cpu:
                    print(f"  {name}: {1e6 * spent / max(tokens, 1):.0f} us/token", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
