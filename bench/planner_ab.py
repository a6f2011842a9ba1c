"""Fixed work through ``engine.generate``: the step planner's costs, engine against engine.

C consumers each run R greedy requests back to back (closed loop, first lengths
staggered as streaming clients' are), in one process, no HTTP. Printed, as one
JSON line: tok/s, process CPU per generated token, forward passes of the model
per 1,000 generated tokens (read off the lane's model, so it counts prefill
passes, decode steps and arrivals' own first steps alike), decode bursts,
admissions and TTFT p50. Forward passes and CPU per token are steadier than
tok/s on a shared machine.

Main against a branch, alternating (the engine comes from ``PYTHONPATH``)::

    for r in 1 2 3; do for root in /work/main .; do
      PYTHONPATH=$root/engine:$root/http:. python bench/planner_ab.py 16 4
      PYTHONPATH=$root/engine:$root/http:. python bench/planner_ab.py 16 4 \\
        --variant '{"admit_group": 16, "admit_fraction": 4, "removal_delay": 16}'
    done; done

``--variant`` sets planner knobs after the engine opened (``actor.planner``: ``admit_*``;
lane: ``removal_*``, ``prefill_*``), e.g. the GPU's grouping on the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from pathlib import Path
from typing import Any

from bench.suite.inproc import prompt_ids
from bench.suite.models import EOS_IDS


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Counted:
    """The model, counting forward calls."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """One fixed-work closed loop; the measurements."""
    import attrs
    import trio
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    import trio_mlx
    from trio_mlx import SamplingParams
    from trio_mlx.default_model import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    pool = prompt_ids(load_tokenizer(model), 64, args.prompt_len, seed=7)
    # The bundled model's EOS ids are held back so every request runs its max_tokens;
    # the suite's random models never produce theirs (bench.suite.models).
    bias = None if args.model else dict.fromkeys(EOS_IDS, -100.0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logit_bias=bias)
    variant = json.loads(args.variant)
    async with trio_mlx.open_engine(model, max_batch=args.c) as engine:
        actor = engine._actor
        for key, value in variant.items():
            lane_knob = key.startswith(("removal", "prefill"))
            setattr(actor.lane if lane_knob else actor.planner, key, value)
        counted = _Counted(actor.lane.model)
        actor.lane._generator.model._model = counted  # inside the lane's _RowModel
        async with engine.generate(pool[0], attrs.evolve(params, max_tokens=4)) as stream:
            async for _ in stream:
                pass
        counted.calls = 0
        tokens, ttft = 0, []
        rng = random.Random(1)
        before, cpu0, start = engine.statistics(), _cpu(), time.perf_counter()

        async def consume(i: int) -> None:
            nonlocal tokens
            todo = attrs.evolve(params, max_tokens=args.max_tokens * (args.c - i) // args.c or 1)
            for _ in range(args.requests):
                sent, first = time.perf_counter(), True
                async with engine.generate(rng.choice(pool), todo) as stream:
                    async for delta in stream:
                        if first and delta.token_ids:
                            ttft.append(time.perf_counter() - sent)
                            first = False
                        tokens += len(delta.token_ids)
                todo = params

        async with trio.open_nursery() as nursery:
            for i in range(args.c):
                nursery.start_soon(consume, i)
        wall, cpu = time.perf_counter() - start, _cpu() - cpu0
        after = engine.statistics()
    ttft.sort()
    return {
        "c": args.c,
        "variant": variant,
        "tok_s": round(tokens / wall, 1),
        "cpu_ms_per_token": round(1000 * cpu / tokens, 3),
        "forwards_per_1k_tokens": round(1000 * counted.calls / tokens, 1),
        "bursts": after.steps - before.steps,
        "admissions": after.admissions - before.admissions,
        "ttft_p50_ms": round(1000 * ttft[len(ttft) // 2]),
    }


def main() -> None:
    """Parse the command line, run once, print the JSON line."""
    import trio

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("c", type=int, help="consumers (and max_batch)")
    parser.add_argument("requests", type=int, help="requests per consumer")
    parser.add_argument("--model", help="model directory (default: the bundled model)")
    parser.add_argument("--prompt-len", type=int, default=155)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variant", default="{}", help="planner knobs as JSON")
    print(json.dumps(trio.run(run, parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()
