"""Interleaved A/B of ``trio-mlx serve`` from two source trees, closed-loop streaming clients.

    python bench/ab_servers.py path/to/main path/to/branch [--model default] [--rounds 3]
    python bench/ab_servers.py . .:TRIO_MLX_SOLO_DECODE=0   # one tree, two environments

A tree may carry ``:VAR=VALUE,...``: settings added to that server's environment.

Both servers stay up for the whole run and the rounds alternate between them (and reverse
their order every other round), so load that comes and goes on a shared machine hits both
alike. Each tree's ``engine/`` and ``http/`` go on that server's PYTHONPATH; the clients are
this tree's ``bench.suite``. Prints, per round, concurrency and tree: tok/s, TTFT p99, ITL
p50/p99, GPU busy (``nvidia-smi``, where there is one) and the worker's busy fraction.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.suite import report, traffic  # noqa: E402
from bench.suite.__main__ import model_env  # noqa: E402
from bench.suite.models import EOS_IDS, prepare  # noqa: E402
from bench.suite.servers import _serve  # noqa: E402


def main() -> None:
    """Parse the command line and run the A/B."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs=2, help="two source trees (repository roots)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="4,16")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    args = parser.parse_args()
    model = prepare(args.model)
    bias = {str(k): -100 for k in EOS_IDS} if model.logit_bias else None
    profile = {"prompt_words": 60, "client_processes": 2, "logit_bias": bias,
               "traffic": {"duration": args.seconds, "warm": 2.0, "max_tokens": args.tokens}}  # fmt: skip
    with contextlib.ExitStack() as stack:
        servers = []
        for i, spec in enumerate(args.trees):
            tree, _, settings = spec.partition(":")
            env = model_env()
            env.update(item.split("=", 1) for item in settings.split(",") if item)
            tree = str(Path(tree).resolve())
            rest = env.get("PYTHONPATH")  # where the dependencies are installed (GPU machine)
            env["PYTHONPATH"] = f"{tree}/engine:{tree}/http:{ROOT}" + (f":{rest}" if rest else "")
            command = [sys.executable, "-m", "trio_mlx_http", "serve", "--model", str(model.path),
                       "--host", "127.0.0.1", "--port", "{port}", "--max-batch", str(args.max_batch)]  # fmt: skip
            server = stack.enter_context(
                _serve(f"tree{i}", command, env, Path("/tmp/ab-logs"), 300)
            )
            warm = {**profile, "traffic": {**profile["traffic"], "duration": 3.0}}
            traffic.closed(server, warm, 4)
            servers.append((spec, server))
        for rnd in range(args.rounds):
            for c in (int(x) for x in args.concurrency.split(",")):
                for tree, server in servers if rnd % 2 == 0 else servers[::-1]:
                    row = traffic.closed(server, profile, c)
                    print(f"round {rnd} C={c} {tree}: {_line(row)}", flush=True)


def _line(row: dict[str, Any]) -> str:
    """One round's figures: tok/s, TTFT p99, ITL p50/p99, GPU and worker busy, checks."""
    line = (
        f"{row['tok_s'] or 0:,.0f} tok/s, TTFT p99 {report.ms(row['ttft_p99_s'])} ms, "
        f"ITL p50/p99 {report.ms(row['itl_p50_s'])}/{report.ms(row['itl_p99_s'])} ms"
    )
    if row.get("gpu_busy_pct") is not None:
        line += f", GPU busy {row['gpu_busy_pct']:.0f}%"
    if row.get("worker_busy") is not None:
        line += f", worker busy {row['worker_busy']:.0%}"
    if not row.get("exact_tokens", True):
        line += ", NOT every request produced max_tokens"
    return line


if __name__ == "__main__":
    main()
