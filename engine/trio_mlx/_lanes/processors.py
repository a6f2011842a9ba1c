"""Each row's sampler and logits processors (mlx-lm's samplers and processors, per row)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from trio_mlx._lanes.records import RowSpec
from trio_mlx._params import SamplingParams

__all__ = ["LogitBias", "eos_processors", "make_processors", "make_row_sampler", "row_processors"]

#: The smallest top_p handed to mlx-lm (a normal float32, far below any token's mass).
_TOP_P_FLOOR = 1e-30


def make_row_sampler(params: SamplingParams, tokenizer: Any) -> Callable[[Any], Any] | None:
    """mlx-lm's sampler for ``params``, or None for greedy (the batch's shared fallback)."""
    if params.temperature == 0:
        return None
    from mlx_lm.sample_utils import make_sampler

    special = list(tokenizer.encode("\n", add_special_tokens=False)) + sorted(
        tokenizer.eos_token_ids
    )
    # mlx-lm compares the mass above each token with top_p in float32: a top_p that
    # underflows to 0 there drops every token and indexes past the vocabulary. Any
    # p below the top token's mass keeps that token alone, so the floor changes nothing.
    top_p = max(params.top_p, _TOP_P_FLOOR) if params.top_p < 1.0 else 0.0
    return make_sampler(
        params.temperature,
        top_p=top_p,
        min_p=params.min_p,
        top_k=params.top_k,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=special,
    )


def _min_tokens_processor(minimum: int, eos_ids: Sequence[int]) -> Callable[[Any, Any], Any]:
    """Bans the end-of-sequence tokens until ``minimum`` tokens were generated.

    The count is the growth of ``tokens`` since the first call (the tokens a
    processor sees start with however much of the prompt the lane fed), so a
    row parked and re-inserted with its history keeps counting where it was.
    """
    import mlx.core as mx

    banned = mx.array(sorted(eos_ids), dtype=mx.int32)
    base: list[int] = []

    def processor(tokens: Any, logits: Any) -> Any:
        if not base:
            base.append(len(tokens))
        if len(tokens) - base[0] >= minimum:
            return logits
        logits[..., banned] = -float("inf")
        return logits

    return processor


def _reasoning_budget_processor(
    budget: int, start: Sequence[int], end: Sequence[int], opened: bool
) -> Callable[[Any, Any], Any]:
    """Ends a reasoning block once ``budget`` of its tokens were generated.

    It reads the row's new tokens (as a grammar does): inside the block (from
    the prompt's end when ``opened``, else from a generated ``start`` marker)
    it counts tokens until the ``end`` marker; once ``budget`` are spent it
    allows only the marker's next token until the whole marker is out. A
    block ended by the model itself, or a second block, is left alone.
    """
    import mlx.core as mx

    start, end = list(start), list(end)
    seen: list[int] = []
    state = {"base": -1, "fed": 0, "inside": opened, "done": False, "spent": 0, "forced": 0}

    def processor(tokens: Any, logits: Any) -> Any:
        length = int(tokens.shape[-1])
        if state["base"] < 0:
            state["base"] = length
        new = length - state["base"] - state["fed"]
        if new > 0:
            state["fed"] += new
            for token in tokens[length - new :].tolist():
                seen.append(token)
                if state["done"]:
                    continue
                if not state["inside"]:
                    state["inside"] = seen[-len(start) :] == start
                    continue
                state["spent"] += 1
                if seen[-len(end) :] == end:
                    state["inside"], state["done"] = False, True
        if not state["inside"] or state["done"] or state["spent"] < budget:
            return logits
        index = min(state["forced"], len(end) - 1)
        state["forced"] += 1
        keep = mx.arange(logits.shape[-1]) == end[index]
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))

    return processor


def eos_processors(
    params: SamplingParams, eos_ids: Sequence[int]
) -> list[Callable[[Any, Any], Any]]:
    """The processor that holds ``eos_ids`` back for ``min_tokens`` (empty when none applies)."""
    if params.min_tokens > 0 and eos_ids and not params.ignore_eos:
        return [_min_tokens_processor(params.min_tokens, eos_ids)]
    return []


class LogitBias:
    """mlx-lm's logit bias processor, as an object the lane can recognise.

    Adds the same values as ``make_logits_processors``' closure; ``key``
    tells two rows with the same bias apart from others, so a decode step
    whose rows all carry the same bias and nothing else adds it to the whole
    batch at once (``generation_class``).
    """

    __slots__ = ("indices", "key", "values")

    def __init__(self, bias: dict[int, float]) -> None:
        import mlx.core as mx

        self.key = tuple(bias.items())
        self.indices = mx.array(list(bias.keys()))
        self.values = mx.array(list(bias.values()))

    def __call__(self, tokens: Any, logits: Any) -> Any:
        return logits.at[:, self.indices].add(self.values)


def make_processors(params: SamplingParams) -> list[Callable[[Any, Any], Any]]:
    """mlx-lm's logits processors for ``params`` (empty when none apply)."""
    from mlx_lm.sample_utils import make_logits_processors

    size = params.repetition_context_size
    bias = [LogitBias(dict(params.logit_bias))] if params.logit_bias else []
    return bias + list(
        make_logits_processors(
            None,
            params.repetition_penalty,
            size,
            params.presence_penalty or None,
            size,
            params.frequency_penalty or None,
            size,
        )
    )


def row_processors(spec: RowSpec, eos_ids: Sequence[int]) -> list[Callable[[Any, Any], Any]]:
    """Every logits processor of a row: ``eos_processors``, ``make_processors``, the
    reasoning budget's and, last, its grammar mask.

    The grammar (structured output) comes last so no bias or penalty can bring
    back a token it forbids.
    """
    grammar = [spec.constraint.processor()] if spec.constraint is not None else []
    params = spec.params
    budget: list[Callable[[Any, Any], Any]] = []
    if params.reasoning_budget is not None and params.reasoning_markers is not None:
        start, end = params.reasoning_markers
        budget = [
            _reasoning_budget_processor(
                params.reasoning_budget, start, end, params.reasoning_opened
            )
        ]
    return [*eos_processors(params, eos_ids), *make_processors(params), *budget, *grammar]
