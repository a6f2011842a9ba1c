"""MLX on Linux CPUs: the bundled reference BLAS against an optimized one, side by side.

Run from the repository root (about 2-3 minutes on a 2-core machine)::

    python bench/experiments/blas_decode.py            # or: --rounds 1 for a quicker, noisier run

It builds a random ~4M-parameter llama (``trio_mlx.testing.make_random_llama``,
hidden 256, 4 layers, vocab 2048) once, then runs each side in its own Python
process, because the BLAS is chosen when a process starts:

* ``reference``: ``LD_PRELOAD`` removed and ``TRIO_MLX_FAST_BLAS=0``;
* ``fast, N threads``: the BLAS :func:`trio_mlx._start.blas.find_fast_blas` finds,
  preloaded, with ``OPENBLAS_NUM_THREADS`` at the core count and at 1.

Each side reports a 1024^3 float32 matmul in GFLOP/s, mlx-lm ``BatchGenerator``
greedy decode in tokens/s at B = 1, 8, 32, a forward pass over 8 x 128 tokens
(prefill) in tokens/s, and one training step (B=16, L=128,
next-token cross-entropy, Adam). Decode runs ``--rounds`` times, sides
interleaved, and the best round counts: other load on the machine only slows
a round down. Each side checks which BLAS really serves MLX (``backend_info``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BATCHES = (1, 8, 32)
PROMPT_LEN = 16


def _timed(step: Any, *, min_reps: int, budget_s: float) -> float:
    """Seconds per call of ``step``, after one warm-up call."""
    step()
    reps, start = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - start < budget_s:
        step()
        reps += 1
    return (time.perf_counter() - start) / reps


def _matmul_gflops() -> float:
    import mlx.core as mx

    n = 1024
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    seconds = _timed(lambda: mx.eval(a @ b), min_reps=2, budget_s=0.5)
    return 2 * n**3 / seconds / 1e9


def _decode_tok_s(model: Any, batch: int, vocab: int, budget_s: float) -> float:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    prompts = mx.random.randint(3, vocab, (batch, PROMPT_LEN)).tolist()
    gen = BatchGenerator(model, max_tokens=1 << 20, completion_batch_size=max(batch, 8))
    try:
        gen.insert(prompts)
        started: set[int] = set()
        while len(started) < batch:  # prompt processing, then the first token of each
            started.update(r.uid for r in gen.next_generated())
        for _ in range(3):
            gen.next_generated()
        steps, tokens, start = 0, 0, time.perf_counter()
        while steps < 5 or time.perf_counter() - start < budget_s:
            tokens += len(gen.next_generated())
            steps += 1
        return tokens / (time.perf_counter() - start)
    finally:
        gen.close()


def _prefill_tok_s(model: Any, vocab: int, budget_s: float) -> float:
    import mlx.core as mx

    tokens = mx.random.randint(3, vocab, (8, 128))
    seconds = _timed(lambda: mx.eval(model(tokens)), min_reps=2, budget_s=budget_s)
    return tokens.size / seconds


def _train_step_s(model: Any, vocab: int, budget_s: float) -> float:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    tokens = mx.random.randint(3, vocab, (16, 128))
    optimizer = optim.Adam(learning_rate=1e-4)

    def loss_fn(model: Any, x: mx.array) -> mx.array:
        logits = model(x[:, :-1])
        return nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step() -> None:
        loss, grads = loss_and_grad(model, tokens)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)

    return _timed(step, min_reps=1, budget_s=budget_s)


def worker(model_dir: str, parts: list[str], budget_s: float) -> dict[str, Any]:
    """Measure ``parts`` in this process; return a JSON-able dict."""
    import mlx.core as mx
    import mlx_lm

    from trio_mlx import backend_info

    mx.random.seed(0)
    info = backend_info()
    model, _ = mlx_lm.load(model_dir)
    vocab = model.args.vocab_size
    result: dict[str, Any] = {"blas": info.blas, "threads": info.threads}
    if "matmul" in parts:
        result["gflops"] = _matmul_gflops()
    if "decode" in parts:
        result["decode"] = {str(b): _decode_tok_s(model, b, vocab, budget_s) for b in BATCHES}
    if "prefill" in parts:
        result["prefill"] = _prefill_tok_s(model, vocab, budget_s)
    if "train" in parts:
        result["train_s"] = _train_step_s(model, vocab, budget_s)
    return result


def _side_env(fast_blas: str | None, threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TRIO_MLX_BLAS_REEXEC")}
    env.pop("OPENBLAS_NUM_THREADS", None)
    if fast_blas is None:
        env["TRIO_MLX_FAST_BLAS"] = "0"
        return env
    from trio_mlx._start.blas import preload_env

    env["TRIO_MLX_BLAS"] = fast_blas
    env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return preload_env(env)


def _run_side(model_dir: str, env: dict[str, str], parts: list[str], budget_s: float) -> Any:
    command = [sys.executable, __file__, "--worker", model_dir, "--parts", ",".join(parts)]
    command += ["--budget", str(budget_s)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:5.1f}x" if b else "   - "


def report(sides: dict[str, dict[str, Any]]) -> None:
    """Print the table: one column per side, ratios against the reference."""
    names = list(sides)
    ref = sides.get("reference")
    print(f"\n{'':24}" + "".join(f"{n:>22}" for n in names))
    print(
        f"{'blas (threads)':24}"
        + "".join(f"{s['blas'] + ' (' + str(s['threads']) + ')':>22}" for s in sides.values())
    )

    def row(label: str, value: Any, fmt: str, higher_is_better: bool = True) -> None:
        cells = []
        for side in sides.values():
            v = value(side)
            cell = format(v, fmt)
            if ref is not None and side is not ref:
                r = value(ref)
                cell += " " + (_ratio(v, r) if higher_is_better else _ratio(r, v))
            cells.append(f"{cell:>22}")
        print(f"{label:24}" + "".join(cells))

    row("matmul 1024^3 GFLOP/s", lambda s: s["gflops"], ".1f")
    for b in BATCHES:
        row(f"decode B={b:<2} tok/s", lambda s, b=b: s["decode"][str(b)], ".0f")
    row("prefill 8x128 tok/s", lambda s: s["prefill"], ".0f")
    row("train step B=16 L=128 s", lambda s: s["train_s"], ".3f", higher_is_better=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="matmul,decode,prefill,train", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="decode rounds (best counts)")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.parts.split(","), args.budget)))
        return

    from trio_mlx._start.blas import find_fast_blas
    from trio_mlx.testing import make_random_llama

    fast = find_fast_blas({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    cores = os.cpu_count() or 1
    envs = {"reference": _side_env(None, None)}
    if fast is None:
        print("no optimized BLAS found: `apt-get install libopenblas0-pthread`; reference only")
    else:
        envs[f"fast, {cores} threads"] = _side_env(fast, cores)
        if cores > 1:
            envs["fast, 1 thread"] = _side_env(fast, 1)
    print(f"optimized BLAS: {fast}; {cores} CPUs")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(
            make_random_llama(
                Path(tmp) / "llama-4m",
                vocab_size=2048,
                hidden_size=256,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=768,
            )
        )
        sides = {
            name: _run_side(model_dir, env, ["matmul", "decode", "prefill", "train"], args.budget)
            for name, env in envs.items()
        }
        for _ in range(args.rounds - 1):
            for name, env in envs.items():
                again = _run_side(model_dir, env, ["decode"], args.budget)["decode"]
                best = sides[name]["decode"]
                sides[name]["decode"] = {b: max(best[b], again[b]) for b in best}
    report(sides)
    print(f"\n({time.perf_counter() - start:.0f} s; ratios are against the reference column)")


if __name__ == "__main__":
    main()
