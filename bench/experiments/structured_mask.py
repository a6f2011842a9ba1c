"""Per-step cost of structured output's grammar masks at a large vocabulary (CPU or GPU).

    python bench/experiments/structured_mask.py MODEL_DIR [--batches 8,32] [--steps 48]

Times what one decode step spends on the masks of B constrained rows (the 20
schemas of ``bench/suite/schemas.py``, wrapped so no value ends), on fixed random
logits of the model's width, greedy through the masked logits, three ways:

* ``per_row_main``: the processor as first merged (``compute_bitmask`` bytes,
  ``np.unpackbits`` per row, one ``mx.where`` per row), reproduced here;
* ``per_row``: each row's ``GrammarProcessor`` alone (the serial lane, a row's
  first step);
* ``batch``: the batch lane's ``GrammarBatch`` (one token read-back, one
  parallel fill into one array, one unpack, a ``where`` per row).

Each step: the rows' processors called as mlx-lm calls them, the masked logits
concatenated and evaluated. ``*_host_ms`` is the part before that evaluation:
the Python and llguidance work (read-backs, feeding, filling, unpacking on the
host) that, on a GPU, the device waits for; the rest is MLX running the masks,
the concatenation and the argmax on the device. The model itself is not run (``bench.suite``'s
part 7 measures decoding end to end; ``--lane`` instead decodes B constrained rows
through a ``BatchLane`` with the model, GrammarBatch on and off, alternating, best
tokens/s of the rounds). ``python -m bench.suite --models tiny-128k``
builds a model with llama-1b's vocabulary (128,256) on a tiny body.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class MainProcessor:
    """The per-row processor as first merged (for comparison only)."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._start: int | None = None
        self._fed = 0

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np

        length = int(tokens.shape[-1])
        if self._start is None:
            self._start = length
        new = length - self._start - self._fed
        if new > 0 and not self._matcher.is_stopped():
            self._matcher.consume_tokens(tokens[length - new :].tolist())
        self._fed += max(new, 0)
        bits = np.unpackbits(
            np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        width = int(logits.shape[-1])
        if bits.shape[0] < width:
            bits = np.pad(bits, (0, width - bits.shape[0]))
        neg = mx.array(-mx.inf, dtype=logits.dtype)
        return mx.where(mx.array(bits[:width].view(np.bool_)), logits, neg)


def run(
    compiler: Any, width: int, batch: int, steps: int, mode: str
) -> tuple[list[float], list[float]]:
    """(host seconds, total seconds) per step after the first."""
    import mlx.core as mx
    import numpy as np
    from bench.suite.schemas import SCHEMAS, endless

    from trio_mlx import SamplingParams
    from trio_mlx._lanes.structured import GrammarBatch

    constraints = [
        compiler.compile(SamplingParams(json_schema=endless(SCHEMAS[i % len(SCHEMAS)])))
        for i in range(batch)
    ]
    if mode == "per_row_main":
        procs: list[Any] = [MainProcessor(c.matcher) for c in constraints]
    else:
        procs = [c.processor() for c in constraints]
    grammar = GrammarBatch() if mode == "batch" else None
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((batch, width)).astype(np.float32))
    mx.eval(logits)
    history = [[1, 2, 3] for _ in range(batch)]
    last = mx.array([h[-1] for h in history])
    times, host = [], []
    for step in range(steps):
        # As mlx-lm's: each row's context ends with the step's input token, not yet
        # read back (so a processor that reads it waits for the device).
        prefixes = [mx.array(h[:-1]) for h in history]
        mx.eval(prefixes, last)
        start = time.perf_counter()
        contexts = [mx.concatenate([prefixes[e], last[e : e + 1]]) for e in range(batch)]
        if grammar is not None and step > 0:
            grammar.begin(last, list(enumerate(procs)))
        out = [procs[e](contexts[e], logits[e : e + 1]) for e in range(batch)]
        masked = mx.concatenate(out, axis=0)
        chosen = mx.argmax(masked, axis=-1)
        host.append(time.perf_counter() - start)
        mx.eval(chosen)
        if grammar is not None:
            grammar.end()
        times.append(time.perf_counter() - start)
        ids = chosen.tolist()
        for e in range(batch):
            history[e].append(ids[e])
        last = chosen
        # Different logits each step, so the walk visits varied grammar states.
        logits = mx.roll(logits, 7919, axis=-1)
        mx.eval(logits)
    return host[1:], times[1:]


def lane_run(model: Any, tokenizer: Any, compiler: Any, batch: int, steps: int, on: bool) -> float:
    """Decode tokens/s of ``batch`` constrained rows through a ``BatchLane`` (``on``: GrammarBatch)."""
    from bench.suite.schemas import SCHEMAS, endless

    from trio_mlx import SamplingParams
    from trio_mlx._lanes.batch import BatchLane
    from trio_mlx._lanes.records import RowSpec, StepPlan

    lane = BatchLane(model, tokenizer, max_batch=batch, grammar_batch=on)
    specs = []
    for i in range(batch):
        params = SamplingParams(
            max_tokens=steps + 8, json_schema=endless(SCHEMAS[i % len(SCHEMAS)])
        )
        specs.append(RowSpec(i, (1, 2, 3, 4 + i), params, compiler.compile(params)))
    lane.step(StepPlan(specs))
    while lane.step().decoding < batch:
        pass
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(e.token_ids) for e in lane.step().events)
    elapsed = time.perf_counter() - start
    lane.discard(list(range(batch)))
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--lane",
        action="store_true",
        help="instead: decode through a BatchLane with the model, GrammarBatch on vs off",
    )
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from trio_mlx._lanes.structured import GrammarCompiler

    config = json.loads((args.model / "config.json").read_text())
    width = int(config["vocab_size"])
    compiler = GrammarCompiler(load_tokenizer(args.model), width)
    compiler.llg_tokenizer()
    results: dict[str, Any] = {"device": str(mx.default_device()), "vocab": width, "rows": []}
    if args.lane:
        from mlx_lm import load

        model, tokenizer = load(str(args.model))
        for batch in [int(b) for b in args.batches.split(",")]:
            rates: dict[str, float] = {}
            for _ in range(args.rounds):
                for name, on in (("per_row_tok_s", False), ("batch_tok_s", True)):
                    rate = lane_run(model, tokenizer, compiler, batch, args.steps, on)
                    rates[name] = max(rates.get(name, 0.0), rate)
            row = {"batch": batch, "lane": True, **rates}
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        return
    for batch in [int(b) for b in args.batches.split(",")]:
        best: dict[str, float] = {}
        for _ in range(args.rounds):  # alternating rounds, best median per mode
            for mode in ("per_row_main", "per_row", "batch"):
                host, total = run(compiler, width, batch, args.steps, mode)
                for key, values in ((f"{mode}_host", host), (mode, total)):
                    median = statistics.median(values)
                    best[key] = min(best.get(key, median), median)
        row = {"batch": batch, **{f"{m}_ms": v * 1e3 for m, v in best.items()}}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
