"""One stream: the engine in-process against ``trio-mlx serve``, per token.

``python bench/experiments/served_solo.py [MODEL] [ROUNDS]`` (default
``llama-1b``, 3) measures one closed-loop stream of 128-token greedy requests
with ~123-token chat prompts, alternating:

* ``engine``: ``engine.generate`` in this process (no HTTP), the decode time per
  token after each request's first token;
* ``served`` variants: ``trio-mlx serve`` with one streaming client (the
  suite's closed loop, 8 s): tok/s, TTFT p50 and the inter-token gap p50;
  ``default``, ``no-prompt-cache`` (``--prompt-cache-bytes 0``) and
  ``batched`` (``TRIO_MLX_SOLO_DECODE=0``).

It says how much of a served stream's time per token is the engine's.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.suite import models, servers, traffic
from bench.suite.__main__ import model_env
from bench.suite.inproc import prompt_ids

VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),
    "no-prompt-cache": ({}, ["--prompt-cache-bytes", "0"]),
    "batched": ({"TRIO_MLX_SOLO_DECODE": "0"}, []),
}


def in_process(path: str, rounds: int) -> list[float]:
    import trio

    import trio_mlx

    async def run() -> list[float]:
        out = []
        async with trio_mlx.open_engine(path, max_batch=8) as engine:
            tokenizer = engine.tokenizer
            prompt = prompt_ids(tokenizer, 1, 123, seed=7)[0]
            params = trio_mlx.SamplingParams(max_tokens=128, temperature=0.0)
            for r in range(rounds * 4 + 1):
                stamps = []
                async with engine.generate(prompt, params) as stream:
                    async for delta in stream:
                        if delta.token_ids:
                            stamps.append((time.perf_counter(), len(delta.token_ids)))
                if r:  # the first request warms up
                    tokens = sum(n for _, n in stamps[1:])
                    out.append((stamps[-1][0] - stamps[0][0]) / tokens * 1e3)
        return out

    return trio.run(run)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    model = models.prepare(name)
    engine_ms = in_process(str(model.path), rounds)
    print(f"engine in-process: {statistics.median(engine_ms):.3f} ms/token "
          f"(min {min(engine_ms):.3f}, {len(engine_ms)} requests)", flush=True)  # fmt: skip
    profile = {
        "prompt_words": 60, "client_processes": 1, "logit_bias": None,
        "traffic": {"duration": 8.0, "warm": 2.0, "max_tokens": 128},
    }  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in VARIANTS}
    for _ in range(rounds):
        for label, (env, extra) in VARIANTS.items():
            with servers.trio_mlx_server(
                model.path,
                max_batch=8,
                env={**model_env(), **env},
                log_dir=Path(tempfile.mkdtemp()),
                extra=extra,
            ) as server:
                traffic.closed(
                    server, {**profile, "traffic": {**profile["traffic"], "duration": 3.0}}, 1
                )
                row = traffic.closed(server, profile, 1)
            results[label].append(row)
            print(f"{label}: {row['tok_s'] or 0:,.0f} tok/s, TTFT p50 "
                  f"{(row['ttft_p50_s'] or 0) * 1e3:.1f} ms, ITL p50 "
                  f"{(row['itl_p50_s'] or 0) * 1e3:.2f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
