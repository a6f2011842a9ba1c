"""The log-probabilities of a prompt's own tokens, for ``echo`` with ``logprobs``.

OpenAI's legacy completions score a text this way (``echo: true, logprobs: k,
max_tokens: 0``; evaluation harnesses rely on it). Each prompt token after the
first gets the log-probability the model gives it after the tokens before it,
with the ``k`` most likely alternatives; the first token has none (``null``).

It is one forward pass over the prompt, in chunks, run as an exclusive engine
job (``engine.run_exclusive``): the batch drains for it, so it suits scoring,
not a hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trio_mlx import Engine, TokenLogprob

__all__ = ["prompt_logprobs"]

#: Prompt tokens per forward pass (bounds the logits held at once: CHUNK x vocabulary).
CHUNK = 256


def _score(model: Any, ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """On the MLX thread: ``TokenLogprob`` of ``ids[1:]`` given what precedes each."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out: list[TokenLogprob] = []
    inputs = list(ids[:-1])
    for start in range(0, len(inputs), CHUNK):
        chunk = inputs[start : start + CHUNK]
        targets = mx.array(list(ids[start + 1 : start + 1 + len(chunk)]))
        logits = model(mx.array([chunk]), cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        alternatives: list[tuple[tuple[int, float], ...]] = [()] * len(chunk)
        if top > 0:
            best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
            values = mx.take_along_axis(logprobs, best, axis=-1)
            mx.eval(chosen, best, values)
            best_ids: list[list[int]] = best.tolist()  # type: ignore[assignment]
            best_values: list[list[float]] = values.tolist()  # type: ignore[assignment]
            alternatives = [
                tuple(sorted(zip(i, v, strict=True), key=lambda p: -p[1]))
                for i, v in zip(best_ids, best_values, strict=True)
            ]
        else:
            mx.eval(chosen)
        tokens: list[int] = targets.tolist()  # type: ignore[assignment]
        values_chosen: list[float] = chosen.tolist()  # type: ignore[assignment]
        for token, logprob, alts in zip(tokens, values_chosen, alternatives, strict=True):
            out.append(TokenLogprob(int(token), float(logprob), alts))
    return out


async def prompt_logprobs(
    engine: Engine, ids: Sequence[int], top: int
) -> tuple[int, list[TokenLogprob]]:
    """The first token and the scored rest of ``ids`` (``top`` alternatives each)."""
    ids = list(ids)
    if len(ids) < 2:
        return ids[0], []
    scored = await engine.run_exclusive(lambda model, _tokenizer: _score(model, ids, top))
    return ids[0], scored
