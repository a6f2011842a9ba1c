"""What every in-process job (:mod:`bench.suite.inproc`, :mod:`bench.suite.multilora`)
shares: its prompts and the result line it prints for the parent process."""

from __future__ import annotations

import json
import random
from typing import Any

from bench.suite.loadgen import WORDS


def prompt_text(rng: random.Random, words: int) -> str:
    """A prompt of ``words`` random words (about one token each)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def prompt_ids(tokenizer: Any, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``length`` tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = tokenizer.encode(prompt_text(rng, length * 2))
        out.append(ids[:length])
    return out


def emit(record: dict[str, Any]) -> None:
    """Print one result line for the parent process."""
    print("RESULT " + json.dumps(record), flush=True)
