"""Several models on one server's MLX thread: memory, a cold request, two models at once.

In process, through ``trio_mlx.open_host``, on two random llamas of one shape (or the
folders given):

    python -m bench.hosting                                  # CPU: hidden 512, 4 layers
    python -m bench.hosting --hidden 2048 --layers 16 --streams 32 --tokens 256  # a GPU

It reports MLX's active memory with nothing loaded, with one model, with both, and
after both are unloaded (the goal: unloading gives the weights back); the time to the
first token of a request for a model not loaded (its load included) against the same
request once it is loaded; and the tokens per second of C greedy streams on one model
against C/2 streams on each of two models decoding at once (each engine's batch stepped
in turn on the one thread).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import trio_mlx

NO_EOS = {0: -100.0, 2: -100.0}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


async def _ttft(host: trio_mlx.ModelHost, name: str, prompt: list[int]) -> float:
    """Seconds from asking for ``name`` to its first token (no engine kept after)."""
    params = trio_mlx.SamplingParams(max_tokens=4, logit_bias=NO_EOS)
    started = time.perf_counter()
    async with host.use(name) as engine, engine.generate(prompt, params) as stream:
        async for _ in stream:
            break
    return time.perf_counter() - started


async def _streams(
    host: trio_mlx.ModelHost, names: list[str], count: int, tokens: int, prompt: list[int]
) -> float:
    """Tokens per second of ``count`` streams spread over ``names``, all at once."""
    params = trio_mlx.SamplingParams(max_tokens=tokens, logit_bias=NO_EOS)
    done = [0]

    async def one(i: int) -> None:
        async with host.use(names[i % len(names)]) as engine:
            completion = await engine.complete(prompt[i % 7 :], params)
            done[0] += len(completion.token_ids)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return done[0] / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    folders = [Path(p) for p in args.model or ()]
    if not folders:
        from trio_mlx.testing import make_random_llama

        root = Path(tempfile.mkdtemp(prefix="bench-hosting-"))
        dims: dict[str, Any] = {
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "intermediate_size": args.hidden * 4,
            "num_attention_heads": max(4, args.hidden // 64),
            "num_key_value_heads": max(2, args.hidden // 256),
            "vocab_size": args.vocab,
            "dtype": args.dtype,
        }
        folders = [make_random_llama(root / n, seed=s, **dims) for s, n in ((1, "a"), (2, "b"))]
    prompt = list(range(3, 3 + args.prompt))
    out: dict[str, Any] = {"models": [str(f) for f in folders], "settings": vars(args).copy()}
    # Every stream in the batch at once, on one model or on two.
    batch = max(8, args.streams)
    async with trio_mlx.open_host(folders, preload=False, max_batch=batch) as host:
        a, b = host.names
        memory = {"nothing loaded": host.active_memory()}
        started = time.perf_counter()
        await host.load(a)
        out["load_seconds"] = time.perf_counter() - started
        memory["one loaded"] = host.active_memory()
        cold, warm = [], []
        for _ in range(args.rounds):
            await host.unload(b)
            cold.append(await _ttft(host, b, prompt))
            warm.append(await _ttft(host, b, prompt))
        memory["both loaded"] = host.active_memory()
        out["ttft_unloaded_s"] = statistics.median(cold)
        out["ttft_loaded_s"] = statistics.median(warm)
        await _streams(host, [a, b], 4, 8, prompt)  # warm both batches' shapes
        one, two = [], []
        for _ in range(args.rounds):
            one.append(await _streams(host, [a], args.streams, args.tokens, prompt))
            two.append(await _streams(host, [a, b], args.streams, args.tokens, prompt))
        out["tok_s_one_model"] = statistics.median(one)
        out["tok_s_two_models"] = statistics.median(two)
        for name in (a, b):
            await host.unload(name)
        memory["both unloaded"] = host.active_memory()
        out["weight_bytes"] = [i.weight_bytes for i in host.models()]
    out["memory"] = memory
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="a model folder (give two)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.model is not None and len(args.model) != 2:
        parser.error("give --model twice, or not at all")
    out = trio.run(run, args)
    memory = out["memory"]
    print(f"weights of each model: {', '.join(_mib(w) for w in out['weight_bytes'])}")
    for what, value in memory.items():
        print(f"MLX active memory, {what}: {_mib(value)}")
    freed = memory["both loaded"] - memory["both unloaded"]
    print(
        f"freed by unloading both: {_mib(freed)} ({freed / sum(out['weight_bytes']):.2f}x weights)"
    )
    print(f"load of one model: {out['load_seconds']:.3f} s")
    print(
        f"TTFT of a request for a model not loaded: {out['ttft_unloaded_s'] * 1e3:,.1f} ms; "
        f"loaded: {out['ttft_loaded_s'] * 1e3:,.1f} ms"
    )
    ratio = out["tok_s_two_models"] / out["tok_s_one_model"]
    print(
        f"{args.streams} streams x {args.tokens} tokens: one model {out['tok_s_one_model']:,.1f} "
        f"tok/s; spread over two models {out['tok_s_two_models']:,.1f} tok/s ({ratio:.2f}x)"
    )


if __name__ == "__main__":
    main()
