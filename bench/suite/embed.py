"""Part 12: embeddings beside chat, through the engine (``--only embed``).

In a worker process (:func:`job`), for each chat concurrency N and each
``embedding_share``, one engine (``embedding_pooling="last"``) runs three
phases of ``seconds`` each, one after the other:

* **embed alone**: ``clients`` closed loops, each asking for ``inputs``
  inputs of ``input_tokens`` tokens per request: embeddings (inputs) per second;
* **chat alone**: N closed-loop greedy streams of ``max_tokens``: tok/s;
* **together**: both at once: each rate again, and its ratio to the phase alone.

``rounds`` rounds of the three, interleaved; each rate's median over the rounds
counts (all rounds are kept in ``results.json``).

The goal (issue: "chat tok/s kept >= 0.85x" beside the embeddings): the chat
ratio. What the share trades is visible across ``shares``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench.suite.jobs import emit, prompt_ids


def job(job: dict[str, Any]) -> None:
    """Run the part and print one result line per (N, share)."""
    import trio

    trio.run(_run, job)


async def _run(job: dict[str, Any]) -> None:
    import trio
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    import trio_mlx

    tokenizer = load_tokenizer(Path(job["model"]))
    inputs = prompt_ids(tokenizer, job["inputs"], job["input_tokens"], seed=1)
    prompts = prompt_ids(tokenizer, max(job["streams"]), job["prompt_len"], seed=2)
    bias = {int(k): v for k, v in (job.get("logit_bias") or {}).items()}
    params = trio_mlx.SamplingParams(max_tokens=job["max_tokens"], logit_bias=bias or None)
    seconds = job["seconds"]
    for share in job["shares"]:
        async with trio_mlx.open_engine(
            job["model"],
            # An embedding request holds a batch slot: room for every chat stream beside them.
            max_batch=max(job["streams"]) + job["clients"],
            embedding_pooling="last",
            embedding_share=share,
            embedding_batch_tokens=job.get("batch_tokens"),
        ) as engine:
            await engine.embed(inputs[:2])  # warm
            await engine.complete(prompts[0], params)
            for streams in job["streams"]:
                counts: dict[str, int] = {}

                async def embed_loop(until: float, counts: dict[str, int] = counts) -> None:
                    while trio.current_time() < until:
                        await engine.embed(inputs)
                        counts["inputs"] = counts.get("inputs", 0) + len(inputs)

                async def chat_loop(i: int, until: float, counts: dict[str, int] = counts) -> None:
                    while trio.current_time() < until:
                        done = await engine.complete(prompts[i], params)
                        counts["tokens"] = counts.get("tokens", 0) + len(done.token_ids)

                async def phase(
                    embed: bool, chat: bool, counts: dict[str, int] = counts, streams: int = streams
                ) -> dict[str, float]:
                    counts.clear()
                    start = time.perf_counter()
                    until = trio.current_time() + seconds
                    async with trio.open_nursery() as nursery:
                        if embed:
                            for _ in range(job["clients"]):
                                nursery.start_soon(embed_loop, until)
                        if chat:
                            for i in range(streams):
                                nursery.start_soon(chat_loop, i, until)
                    elapsed = time.perf_counter() - start
                    return {
                        "embeddings_s": counts.get("inputs", 0) / elapsed,
                        "chat_tok_s": counts.get("tokens", 0) / elapsed,
                        "seconds": elapsed,
                    }

                # Rounds of the three phases, interleaved; each rate's median counts
                # (a best-of would pick, beside chat, the round embeddings got least).
                runs: dict[str, list[dict[str, float]]] = {"e": [], "c": [], "t": []}
                for _ in range(job.get("rounds", 1)):
                    runs["e"].append(await phase(True, False))
                    runs["c"].append(await phase(False, True))
                    runs["t"].append(await phase(True, True))
                alone_embed = _median(runs["e"])
                alone_chat = _median(runs["c"])
                together = _median(runs["t"])
                emit(
                    {
                        "job": "embed",
                        "streams": streams,
                        "share": share,
                        "embed_alone": alone_embed,
                        "chat_alone": alone_chat,
                        "together": together,
                        "rounds": runs,
                        "chat_ratio": together["chat_tok_s"] / alone_chat["chat_tok_s"]
                        if alone_chat["chat_tok_s"]
                        else None,
                        "embed_ratio": together["embeddings_s"] / alone_embed["embeddings_s"]
                        if alone_embed["embeddings_s"]
                        else None,
                    }
                )


def _median(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each rate's median over the rounds."""
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def markdown(results: dict[str, Any]) -> list[str]:
    """The part's section of ``results.md``."""
    data = results.get("embed")
    if not data:
        return []
    s = data["settings"]
    lines = [
        f"## 12. Embeddings beside chat on `{data['model']}`",
        "",
        f"{s['clients']} closed-loop embedding clients, {s['inputs']} inputs of "
        f"{s['input_tokens']} tokens a request; N greedy chat streams of {s['max_tokens']} "
        f"tokens; passes of {s.get('batch_tokens') or 'the prefill budget in'} tokens; "
        f"{s['seconds']:g} s a phase, median of {s.get('rounds', 1)} interleaved rounds. Goal: chat tok/s beside embeddings >= 0.85x.",
        "",
        "| N | share | embeddings/s alone | beside chat | chat tok/s alone | beside embeddings "
        "| chat ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['streams']} | {r['share']:g} | {r['embed_alone']['embeddings_s']:,.1f} | "
            f"{r['together']['embeddings_s']:,.1f} | {r['chat_alone']['chat_tok_s']:,.0f} | "
            f"{r['together']['chat_tok_s']:,.0f} | {r['chat_ratio'] or 0:.2f}x |"
        )
    return [*lines, ""]
