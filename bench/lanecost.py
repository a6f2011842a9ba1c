"""The MLX worker thread's CPU time per generated token, through ``BatchLane.step`` alone.

No engine, no Trio, no HTTP: this thread plays the worker and drives the batch
lane the way the actor does (bursts of up to 16 decode steps), B rows at a
time, a finished row replaced by a new one at once, R requests in all, the
first B with staggered lengths. It prints one JSON line: CPU seconds of this
thread per generated token (``time.thread_time``: robust on a loaded box,
unlike tok/s), steps and tokens. The MLX compute runs on MLX's own stream
thread and is not counted; what is counted is Python, graph building and the
eval's dispatch, the host work that limits a GPU run.

Main against a branch, alternating (the engine comes from ``PYTHONPATH``)::

    for r in 1 2 3; do for root in /work/main .; do
      PYTHONPATH=$root/engine:$root/http:. python -m bench.lanecost 24 96
    done; done

``--no-bias`` drops the EOS logit bias every row carries otherwise (the
bench suite's bundled-model runs carry it, its random GPU models do not).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.suite.loadgen import WORDS
from bench.suite.models import EOS_IDS


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One fixed-work run; the measurements."""
    from mlx_lm import load

    from trio_mlx import SamplingParams
    from trio_mlx._lanes.batch import BatchLane
    from trio_mlx._lanes.records import RowSpec, StepPlan
    from trio_mlx.default_model import default_model_path

    model, tokenizer = load(str(Path(args.model) if args.model else default_model_path()))
    bias = None if args.no_bias else dict.fromkeys(EOS_IDS, -100.0)
    lane = BatchLane(model, tokenizer, max_batch=args.rows)
    ids = iter(range(1, 1 << 30))

    def spec(max_tokens: int) -> RowSpec:
        row_id = next(ids)
        rng = random.Random(row_id)
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=bias)
        return RowSpec(row_id, tuple(tokenizer.encode(prompt)), params)

    def drain(inserts: list[RowSpec], more: int) -> tuple[int, int]:
        tokens = calls = 0
        while lane.rows or inserts:
            result = lane.step(StepPlan(inserts, steps=16), seconds=10.0)
            calls += 1
            inserts = []
            for event in result.events:
                tokens += len(event.token_ids)
                if (event.finish_reason or event.error is not None) and more > 0:
                    inserts.append(spec(args.max_tokens))
                    more -= 1
        return tokens, calls

    drain([spec(4) for _ in range(args.rows)], 0)  # warm-up: first shapes
    first = [spec(args.max_tokens * (args.rows - i) // args.rows or 1) for i in range(args.rows)]
    cpu, start = time.thread_time(), time.perf_counter()
    tokens, calls = drain(first, args.requests - args.rows)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - start
    return {
        "rows": args.rows,
        "requests": args.requests,
        "bias": bias is not None,
        "tokens": tokens,
        "step_calls": calls,
        "thread_us_per_token": round(1e6 * cpu / tokens, 1),
        "tok_s": round(tokens / wall, 1),
    }


def main() -> None:
    """Parse the command line, run once, print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=int, help="rows in the batch (max_batch)")
    parser.add_argument("requests", type=int, help="requests in all (at least rows)")
    parser.add_argument("--model", help="model directory (default: the bundled model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--no-bias", action="store_true", help="no EOS logit bias on the rows")
    print(json.dumps(run(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
