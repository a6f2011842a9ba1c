"""Part 11 (``--only spec``): speculative decoding, on and off.

Four traces, each at several batch sizes B, through ``engine.complete`` (B requests
submitted together, greedy, a fixed number of tokens each):

* ``edit`` (prompt lookup): the bundled model asked, as raw text, to write a Python
  file out again with a function renamed (the prompt holds the file and the answer's
  first line): an editor's request. Whether drafts are accepted depends on whether
  the model copies what it was shown.
* ``recite`` (prompt lookup): the bundled model shown a documentation passage, then
  its first line again: the answer repeats text the prompt holds (and the model knows).
* ``draft`` (draft model): the bundled model with the bundled draft
  (``pydoc-llama-draft``) answering documentation questions through its chat template.
* ``draft-1b`` (draft model; the GPU profile): ``llama-1b`` (random, bf16, Llama-3.2-1B's
  shape) drafted for by its own first block (:func:`bench.suite.models.first_layers`:
  its embedding, block 0, final norm and head; self-speculative, nothing trained). A
  random llama's greedy text repeats one token for tens of tokens, and so does its first
  block's: acceptance is near the ceiling, and the trace shows what a draft model's
  forwards and the wide verification cost at a real model's size.
* ``repeat`` (prompt lookup): a random llama with small weights (``weight_scale=1``:
  its greedy text soon repeats itself), the case where nearly every draft is right:
  what accepted drafts are worth on this machine.

Decode tok/s is each row's ``(tokens - 1) / (duration - TTFT)`` summed over the rows.
One engine runs both sides: a round alternates passes of its B requests plain
(``SamplingParams(speculate=False)``) and speculating until it has run ``min_seconds``
(one pass of 128 tokens at B = 1 lasts 0.1 s on a GPU, too short to time) and at least
``min_passes`` passes a side (a pass at B = 64 lasts 4-19 s on the CPU: one pass a side
read 0.85x with 4 tokens drafted), and averages
each side's passes; the best round of each side counts (the engine stays open across its
rounds: the governor has learned from the rounds before); acceptance is accepted /
drafted tokens of the best speculating round.
``speculation_max_batch`` is set to the largest B, so every B speculates: the
ratio shows where speculation stops paying.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from bench.suite.jobs import emit

_NAMES = ["parse", "load", "read", "write", "merge", "split", "check", "build", "render", "save"]
_THINGS = ["config", "line", "record", "table", "entry", "header", "value", "path", "item", "row"]


def code_file(rng: random.Random, functions: int = 4) -> tuple[str, str, str]:
    """A small Python file, one of its function names, and a new name for it."""
    parts, names = [], []
    for _ in range(functions):
        name = f"{rng.choice(_NAMES)}_{rng.choice(_THINGS)}"
        arg = rng.choice(_THINGS)
        names.append(name)
        parts.append(
            f'def {name}({arg}, strict=False):\n    """{name.replace("_", " ").capitalize()} '
            f'a {arg}."""\n    result = []\n    for part in {arg}.split(","):\n'
            f"        if strict and not part:\n            raise ValueError({arg})\n"
            f"        result.append(part.strip())\n    return result\n"
        )
    old = rng.choice(names)
    return "\n\n".join(parts), old, "new_" + old


def edit_prompt(rng: random.Random) -> str:
    code, old, new = code_file(rng)
    first = code.splitlines()[0].replace(old, new)
    return f"File util.py:\n\n{code}\n\nThe same file, with {old} renamed to {new}:\n\n{first}\n"


#: Each trace's way of drafting.
METHODS = {
    "edit": "prompt_lookup",
    "recite": "prompt_lookup",
    "draft": "draft_model",
    "draft-1b": "draft_model",
}
#: Subjects of the ``draft`` trace's questions (topics of the bundled model's corpus).
SUBJECTS = ["the with statement", "lambdas", "the if statement", "generators", "classes",
            "the try statement", "dictionaries", "the for statement"]  # fmt: skip


def recite_prompt(rng: random.Random) -> str:
    """A documentation passage (one topic's opening), then its first line again."""
    from pydoc_data.topics import topics

    text = topics[rng.choice(sorted(topics))].strip()[:600]
    return f"{text}\n\n{text.splitlines()[0]}\n"


def trace_prompt(trace: str, rng: random.Random) -> Any:
    """One request of ``trace``."""
    if trace == "recite":
        return recite_prompt(rng)
    if trace == "draft":
        return [{"role": "user", "content": f"What is {rng.choice(SUBJECTS)}?"}]
    return edit_prompt(rng) if trace == "edit" else edit_prompt(rng)[:200]


def _model(trace: str, job: dict[str, Any]) -> str | None:
    if trace == "draft-1b":
        from bench.suite.models import prepare

        return str(prepare("llama-1b").path)
    if trace != "repeat":
        return None  # the bundled model
    from trio_mlx.testing import make_random_llama

    path = Path(job["cache"]) / "spec-repeat-llama"
    if not (path / "config.json").exists():
        make_random_llama(
            path, hidden_size=512, num_hidden_layers=8, intermediate_size=1024, weight_scale=1.0
        )
    return str(path)


async def _pass(engine: Any, prompts: list[Any], params: Any) -> float:
    """Every prompt submitted at once; the rows' decode tok/s, summed."""
    import trio

    rates: list[float] = []

    async def one(prompt: Any) -> None:
        r = (await engine.complete(prompt, params)).result
        decode = r.duration - (r.time_to_first_token or 0.0)
        rates.append((r.completion_tokens - 1) / decode if decode > 0 else 0.0)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    return sum(rates)


async def _round(engine: Any, prompts: list[Any], job: dict[str, Any]) -> dict[bool, Any]:
    """One round: passes of every prompt at once, plain and speculating in turn, until
    ``min_seconds`` have run; by side, the passes' mean decode tok/s, and acceptance."""
    import trio_mlx

    sides = {
        on: trio_mlx.SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True, speculate=on)
        for on in (False, True)
    }
    passes: dict[bool, list[float]] = {False: [], True: []}
    before = engine.statistics()
    start = time.perf_counter()
    floor, least = job.get("min_seconds", 0.0), job.get("min_passes", 1)
    while len(passes[True]) < least or time.perf_counter() - start < floor:
        for on, params in sides.items():
            passes[on].append(await _pass(engine, prompts, params))
    after = engine.statistics()
    # Plain passes' rows opt out of speculation: every draft is the speculating passes'.
    drafted = sum(after.draft_tokens.values()) - sum(before.draft_tokens.values())
    taken = sum(after.draft_accepted_tokens.values()) - sum(before.draft_accepted_tokens.values())
    return {
        on: {
            "decode_tok_s": sum(rates) / len(rates),
            "passes": len(rates),
            "drafted": drafted if on else 0,
            "accepted": taken if on else 0,
            "acceptance": (taken / drafted if drafted else None) if on else None,
        }
        for on, rates in passes.items()
    }


def _draft(trace: str, model: str | None) -> str | None:
    """The trace's draft model: the bundled draft, or the target's first block."""
    if METHODS.get(trace) != "draft_model":
        return None
    if model is None:
        return "pydoc-llama-draft"
    from bench.suite.models import first_layers

    return str(first_layers(Path(model)))


async def _compare(
    model: str | None, prompts: list[Any], draft: str | None, job: dict[str, Any]
) -> dict[bool, Any]:
    """Plain and speculating passes interleaved in one engine, kept open across
    ``rounds`` rounds (so the speculation governor has learned from the rounds before,
    as in a server that has been running); the best round of each side. One engine for
    both sides: two engines' plain steps differed by up to 20% over 2-s rounds on a GPU."""
    import trio_mlx

    best: dict[bool, Any] = {}
    async with trio_mlx.open_engine(
        model,
        max_batch=max(2, len(prompts)),  # max_batch=1 is the serial lane: no speculation
        prompt_lookup=draft is None,
        draft_model=draft,
        num_draft_tokens=job.get("num_draft_tokens", 4),
        speculation_max_batch=max(job["batches"]),
    ) as engine:
        for on in (False, True):  # a pass of each side first: compiling is in neither
            params = trio_mlx.SamplingParams(max_tokens=8, ignore_eos=True, speculate=on)
            await _pass(engine, prompts, params)
        for _ in range(job["rounds"]):
            got = await _round(engine, prompts, job)
            for on, side in got.items():
                if on not in best or side["decode_tok_s"] > best[on]["decode_tok_s"]:
                    best[on] = side
    return best


def job(job: dict[str, Any]) -> None:
    """The worker process's side: every trace and B, off and on, ``rounds`` times."""
    import trio

    for trace in job["traces"]:
        model = _model(trace, job)
        for b in job["batches"]:
            rng = random.Random(b)
            prompts = [trace_prompt(trace, rng) for _ in range(b)]
            method = METHODS.get(trace, "prompt_lookup")
            best = trio.run(_compare, model, prompts, _draft(trace, model), job)
            off, on = best[False], best[True]
            emit({
                "job": "spec", "trace": trace, "method": method, "batch": b, "off": off, "on": on,
                "ratio": on["decode_tok_s"] / off["decode_tok_s"] if off["decode_tok_s"] else None,
            })  # fmt: skip


def markdown(results: dict[str, Any]) -> list[str]:
    """The part's section of ``results.md``."""
    data = results.get("spec")
    if not data:
        return []
    s = data["settings"]
    lines = [
        "## 11. Speculative decoding",
        "",
        f"{s['max_tokens']} greedy tokens a row, K = {s.get('num_draft_tokens', 4)}, best of "
        f"{s['rounds']} rounds of at least {s.get('min_seconds', 0.0):g} s and "
        f"{s.get('min_passes', 1)} passes a side each (passes "
        "of B requests, plain and speculating in turn in one engine, averaged); `edit`: the bundled model rewriting a file it was shown, "
        "`recite`: the bundled model repeating a documentation passage it was shown "
        "(both prompt lookup), `draft`: the bundled model answering documentation questions "
        "with the bundled draft, `draft-1b`: a random llama of Llama-3.2-1B's shape "
        "drafted for by its own first block (its text repeats one token for tens of "
        "tokens), `repeat`: a random llama whose text repeats itself (prompt "
        "lookup). Decode tok/s summed over rows.",
        "",
        "| trace | B | off tok/s | on tok/s | on/off | passes | drafted | accepted | acceptance |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in data["rows"]:
        off, on = r["off"], r["on"]
        acc = "-" if on["acceptance"] is None else f"{on['acceptance']:.0%}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(
            f"| {r['trace']} | {r['batch']} | {off['decode_tok_s']:,.0f} | "
            f"{on['decode_tok_s']:,.0f} | {ratio} | {on.get('passes', 1)} | {on['drafted']} | "
            f"{on['accepted']} | {acc} |"
        )
    return [*lines, ""]
