"""Images beside text: an image request's TTFT, and what one costs the text streams.

In process, on a random llava (``trio_mlx.testing.make_random_vlm``) or a model folder:

    python -m bench.vision                       # CPU: hidden 512, 4 layers, 112 px images
    python -m bench.vision --model PATH --streams 8 32 --tokens 256   # a GPU, a real VLM
    python -m bench.vision --prefill-budget 64   # image prompts (~206 tokens) in chunks

Per stream count C it runs C greedy text streams of ``--tokens`` tokens alone, then the
same C streams while image requests (a new image each, so none is cached) run one after
another beside them, and reports the text streams' tokens per second in both (the goal:
with images at least 0.9x of text-only) and their gap p99 between deltas (where a step
that prefills a whole image prompt shows), the image requests' TTFT alone and among the
streams, and a repeated image's TTFT (served from the prompt cache); each measurement
is the best of ``--rounds`` runs. ``--twins`` runs the streams a third time beside text
requests with as many prompt tokens as an image request (random tokens, never cached):
what the same prefill costs without an image.
``--one`` runs them once more beside a single image request, sent once the streams
decode: the cost of one image arriving, where the default measures a steady supply.
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import trio_mlx

NO_EOS = {0: -100.0, 2: -100.0}


def _png(seed: int, size: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _image_chat(seed: int, size: int) -> list[dict[str, Any]]:
    image = trio_mlx.ImageInput(_png(seed, size))
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]
    return [{"role": "user", "content": parts}]


async def _ttft(engine: trio_mlx.Engine, prompt: Any, tokens: int) -> float:
    params = trio_mlx.SamplingParams(max_tokens=tokens, logit_bias=NO_EOS)
    start = time.perf_counter()
    first = None
    async with engine.generate(prompt, params) as stream:
        async for _delta in stream:
            if first is None:
                first = time.perf_counter() - start
    assert first is not None
    return first


async def _text_rate(
    engine: trio_mlx.Engine,
    streams: int,
    tokens: int,
    image_size: int | None,
    twin: int = 0,
    one: bool = False,
) -> tuple[float, list[float], list[float]]:
    """The text streams' tokens per second and their gaps between deltas after the first
    (seconds); the image requests' TTFTs beside them (or, ``twin`` tokens, text requests'
    of that many random prompt tokens; ``one``: a single image request, sent once every
    stream has its first token)."""
    params = trio_mlx.SamplingParams(max_tokens=tokens, logit_bias=NO_EOS)
    done, decoding = trio.Event(), trio.Event()
    first: set[int] = set()
    left = streams
    ttfts: list[float] = []
    ends: list[float] = []
    gaps: list[float] = []

    async def text(i: int) -> None:
        nonlocal left
        chat = [{"role": "user", "content": f"Tell me about topic {i}."}]
        last = None
        async with engine.generate(chat, params) as stream:
            async for _delta in stream:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                first.add(i)
                if len(first) == streams:
                    decoding.set()
        ends.append(time.perf_counter())
        left -= 1
        if not left:
            done.set()

    async def images(size: int) -> None:
        seed = 1000
        if one:
            await decoding.wait()
            ttfts.append(await _ttft(engine, _image_chat(seed, size), 16))
            return
        while not done.is_set():
            if twin:
                rng = random.Random(seed)
                prompt: Any = [rng.randrange(3, 500) for _ in range(twin)]
            else:
                prompt = _image_chat(seed, size)
            ttfts.append(await _ttft(engine, prompt, 16))
            seed += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(text, i)
        if image_size is not None:
            nursery.start_soon(images, image_size)
    return streams * tokens / (max(ends) - start), gaps, ttfts


async def _best(rounds: int, *args: Any, **kwargs: Any) -> tuple[float, list[float], list[float]]:
    """The round of ``_text_rate`` with the most text tokens per second (the first of a
    new batch shape may wait on kernels compiled for it: seconds on a GPU)."""
    runs = [await _text_rate(*args, **kwargs) for _ in range(rounds)]
    return max(runs, key=lambda run: run[0])


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, len(values) * 99 // 100)] if values else 0.0


async def run(args: argparse.Namespace) -> None:
    if args.model is None:
        from trio_mlx.testing import make_random_vlm

        folder = Path(tempfile.mkdtemp()) / "llava"
        model = make_random_vlm(
            folder, hidden_size=args.hidden, num_hidden_layers=args.layers, image_size=args.image
        )
    else:
        model = Path(args.model)
    size = args.image
    budget = {} if args.prefill_budget is None else {"prefill_budget": args.prefill_budget}
    one = trio_mlx.SamplingParams(max_tokens=1)
    async with trio_mlx.open_engine(model, max_batch=max(args.streams) + 1, **budget) as engine:
        await _ttft(engine, _image_chat(0, size), 2)  # warm
        alone = [await _ttft(engine, _image_chat(seed, size), 2) for seed in range(1, 6)]
        cached = [await _ttft(engine, _image_chat(1, size), 2) for _ in range(3)]
        print(f"model {model}; image {size} px")
        print(f"image TTFT alone: median {statistics.median(alone) * 1000:.0f} ms (5 images)")
        print(f"repeated image TTFT (cached): median {statistics.median(cached) * 1000:.0f} ms")
        for streams in args.streams:
            text_only, gaps_alone, _ = await _best(args.rounds, engine, streams, args.tokens, None)
            mixed, gaps, ttfts = await _best(args.rounds, engine, streams, args.tokens, size)
            beside = statistics.median(ttfts) * 1000 if ttfts else float("nan")
            print(
                f"C={streams}: text {text_only:.0f} tok/s alone, {mixed:.0f} with images "
                f"({mixed / text_only:.2f}x); {len(ttfts)} image requests, TTFT median "
                f"{beside:.0f} ms among the streams; the streams' gap p99 "
                f"{_p99(gaps_alone) * 1000:.0f} ms alone, {_p99(gaps) * 1000:.0f} ms with images"
            )
            if args.twins:
                n = (await engine.complete(_image_chat(0, size), one)).result.prompt_tokens
                twins, _, twin_ttfts = await _best(
                    args.rounds, engine, streams, args.tokens, size, n
                )
                print(
                    f"C={streams}: beside text requests of {n} prompt tokens instead: "
                    f"{twins:.0f} tok/s ({twins / text_only:.2f}x); {len(twin_ttfts)} requests, "
                    f"TTFT median {statistics.median(twin_ttfts) * 1000:.0f} ms"
                )
            if args.one:
                single, _, one_ttft = await _best(
                    args.rounds, engine, streams, args.tokens, size, one=True
                )
                print(
                    f"C={streams}: beside one image request: {single:.0f} tok/s "
                    f"({single / text_only:.2f}x); its TTFT {one_ttft[0] * 1000:.0f} ms"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a VLM folder (default: a random llava)")
    parser.add_argument("--streams", type=int, nargs="+", default=[8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--image", type=int, default=112, help="image side in pixels")
    parser.add_argument("--twins", action="store_true", help="also beside text twins")
    parser.add_argument("--rounds", type=int, default=2, help="best of this many runs each")
    parser.add_argument("--one", action="store_true", help="also beside one image request")
    parser.add_argument(
        "--prefill-budget", type=int, default=None, help="the lane's budget (default: the device's)"
    )
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
