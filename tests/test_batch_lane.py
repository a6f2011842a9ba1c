"""The batch lane on its own: rows in and out of one batch, driven step by step.

Every test here builds a :class:`~trio_mlx.testing.BatchLane` over the tiny model
and drives it with :class:`~trio_mlx.testing.StepPlan`\\ s, as the actor does,
without an engine: whatever joins, leaves, is cancelled, parked or prefilled in
chunks, every greedy row must produce exactly what it produces alone, a removed
row must stop at once and give its slot back within the stated bound, and a
burst must never run past news.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import NO_EOS, PROMPT
from trio_mlx import SamplingParams
from trio_mlx.testing import BatchLane, PromptCache, RowSpec, StepPlan

pytestmark = [pytest.mark.model]

#: Short prompts, and one past the lane's cache_min_prefix (it is served from the prompt cache).
PROMPTS = ["Hello world", "The quick brown fox", "def main():", " ".join([PROMPT] * 20)]


def _drain(
    lane: BatchLane, plans: dict[int, StepPlan], *, limit: int = 400
) -> dict[int, list[int]]:
    """Step ``lane`` (``plans[k]`` at step k, else a plain decode step) until every
    plan has run and no row is left; each row's tokens."""
    tokens: dict[int, list[int]] = {}
    for k in range(limit):
        if k > max(plans, default=0) and not lane.rows:
            return tokens
        for event in lane.step(plans.get(k, StepPlan())).events:
            assert event.error is None
            tokens.setdefault(event.id, []).extend(event.token_ids)
    raise AssertionError(f"rows still in the lane after {limit} steps")


def _alone(tiny_model: tuple[Any, Any], spec: RowSpec) -> list[int]:
    model, tokenizer = tiny_model
    return _drain(BatchLane(model, tokenizer, max_batch=8), {0: StepPlan([spec])})[spec.id]


def _row(tokenizer: Any, row_id: int, prompt: str, max_tokens: int) -> RowSpec:
    params = SamplingParams(max_tokens=max_tokens, logit_bias=NO_EOS)
    return RowSpec(row_id, tuple(tokenizer.encode(prompt)), params)


def test_a_step_on_an_empty_lane_decodes_nothing_and_holds_no_row(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    lane = BatchLane(model, tokenizer, max_batch=4)
    for plan in (StepPlan(), StepPlan(steps=8), StepPlan(removes=[7])):
        result = lane.step(plan, seconds=60.0)
        assert result.events == []
        assert (result.steps, result.rows, result.decoding, result.dead) == (0, 0, 0, 0)
    assert (lane.rows, lane.dead_rows) == (0, 0)
    # Once a row has come and gone, the empty lane is as before.
    _drain(lane, {0: StepPlan([_row(tokenizer, 1, PROMPTS[0], 3)])})
    assert lane.step().steps == 0
    assert (lane.rows, lane.dead_rows) == (0, 0)


def test_rows_joining_and_leaving_mid_batch_keep_their_greedy_tokens(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    # Rows of different lengths joining at different steps: the batch grows and
    # shrinks around every row while it decodes.
    joins = {0: [(1, 0, 30), (2, 1, 6)], 3: [(3, 2, 12)], 5: [(4, 3, 9)], 9: [(5, 1, 20)]}
    plans = {
        k: StepPlan([_row(tokenizer, i, PROMPTS[p], n) for i, p, n in rows])
        for k, rows in joins.items()
    }
    together = _drain(BatchLane(model, tokenizer, max_batch=8), plans)
    for plan in plans.values():
        for spec in plan.inserts:
            assert together[spec.id] == _alone(tiny_model, spec), spec.id
            assert len(together[spec.id]) == spec.params.max_tokens


def test_a_row_cancelled_while_its_prompt_is_prefilled_never_decodes_and_spares_the_others(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    # A budget of 16 tokens a step: the long prompt takes several steps to prefill.
    lane = BatchLane(model, tokenizer, max_batch=4, prefill_budget=16)
    short = _row(tokenizer, 1, PROMPTS[1], 20)
    long = _row(tokenizer, 2, PROMPTS[3], 20)
    assert len(long.prompt) > 3 * 16
    tokens: dict[int, list[int]] = {}
    events = lane.step(StepPlan([short, long])).events + lane.step().events
    assert not any(e.id == 2 for e in events), "the long prompt is still being prefilled"
    events += lane.step(StepPlan(removes=[2])).events
    assert lane.rows == 1
    for _ in range(100):
        if not lane.rows:
            break
        events += lane.step().events
    for event in events:
        assert event.error is None
        tokens.setdefault(event.id, []).extend(event.token_ids)
    assert 2 not in tokens
    assert tokens[1] == _alone(tiny_model, short)
    assert (lane.rows, lane.dead_rows) == (0, 0)


def _lane(model: Any, tokenizer: Any) -> BatchLane:
    lane = BatchLane(model, tokenizer, max_batch=8)
    lane.removal_delay, lane.removal_fraction = 5, 0  # only age or an admission compacts
    return lane


def test_a_cancelled_row_stops_at_once_and_is_freed_within_the_removal_delay(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    lane = _lane(model, tokenizer)
    params = SamplingParams(max_tokens=200, logit_bias=NO_EOS)
    ids = [1, 2, 3]
    lane.step(StepPlan([RowSpec(i, tuple(tokenizer.encode(PROMPTS[i - 1])), params) for i in ids]))
    started: set[int] = set()
    for _ in range(10):  # prefill, then the rows' first decode step
        started |= {e.id for e in lane.step().events if e.token_ids}
        if started == set(ids):
            break
    assert started == set(ids)
    result = lane.step(StepPlan(removes=[2]))
    assert {e.id for e in result.events} == {1, 3}, "no output after the cancel"
    assert lane.rows == 2
    assert lane.dead_rows == 1
    steps = 0
    while lane.dead_rows:
        result = lane.step()
        assert all(e.id != 2 for e in result.events)
        steps += result.steps
    assert 1 <= steps <= lane.removal_delay
    # A finished row is freed within the same bound; an admission frees dead rows at once.
    lane.step(
        StepPlan([RowSpec(4, tuple(tokenizer.encode(PROMPTS[0])), SamplingParams(max_tokens=2))])
    )
    finished = False
    while not finished:
        finished = any(e.id == 4 and e.finish_reason for e in lane.step().events)
    assert lane.dead_rows == 1
    lane.step(StepPlan([RowSpec(5, tuple(tokenizer.encode(PROMPTS[1])), params)]))
    assert lane.dead_rows == 0, "an admission compacts the dead rows"
    assert lane.discard([1, 3, 5]) == 0
    assert lane.dead_rows == 0


def test_dead_rows_leave_the_batch_together(tiny_model: tuple[Any, Any]) -> None:
    model, tokenizer = tiny_model
    lane = _lane(model, tokenizer)
    lane.removal_delay = 10**6
    lane.removal_fraction = 1  # compact once dead rows are as many as the live ones
    prompt = tuple(tokenizer.encode(PROMPTS[1]))
    sizes = [3, 4, 5, 30, 30, 30]
    specs = [
        RowSpec(i, prompt, SamplingParams(max_tokens=n, logit_bias=NO_EOS))
        for i, n in enumerate(sizes)
    ]
    lane.step(StepPlan(specs))
    seen = []
    while lane.rows:
        lane.step()
        seen.append((lane.rows, lane.dead_rows))
    # One row finished per step; the dead stayed until they were as many as the
    # live ones (3 and 3), then left in one removal.
    assert {(5, 1), (4, 2), (3, 0)} <= set(seen), seen
    assert (3, 3) not in seen
    assert lane.dead_rows == 0


def test_a_row_dead_for_some_steps_is_cached_without_the_tokens_decoded_after_it_died(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    lane = _lane(model, tokenizer)
    lane.prompt_cache = PromptCache(1 << 30)
    lane.removal_delay = 4
    prompt = tuple(tokenizer.encode(PROMPTS[3]))
    params = SamplingParams(max_tokens=6, logit_bias=NO_EOS)
    busy = SamplingParams(max_tokens=200, logit_bias=NO_EOS)

    def run(row_id: int) -> tuple[list[int], int]:
        result = lane.step(StepPlan([RowSpec(row_id, prompt, params)]))
        cached, tokens = result.cached[row_id], []
        while True:
            events = [e for e in lane.step().events if e.id == row_id]
            tokens.extend(t for e in events for t in e.token_ids)
            if any(e.finish_reason for e in events):
                return tokens, cached

    lane.step(StepPlan([RowSpec(99, tuple(tokenizer.encode(PROMPTS[0])), busy)]))
    first, cached = run(1)
    assert cached == 0
    assert lane.dead_rows == 1
    while lane.dead_rows:  # it decodes junk for removal_delay steps, then is stored
        lane.step()
    second, cached = run(2)
    assert cached >= len(prompt) - 1
    assert second == first


def _padded_batch(model: Any, padding: list[int]) -> list[Any]:
    """Every layer's ``BatchKVCache`` after prefilling rows with these left paddings."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    prompt = mx.array([[(5 * r + 3 * i) % 50 + 1 for i in range(9)] for r in padding])
    caches = [BatchKVCache(padding) for _ in model.layers]
    mx.eval(model(prompt, cache=caches))
    return caches


@pytest.mark.parametrize("keep", [[1, 2], [0, 2], [2], [3, 1]])
def test_the_lanes_one_read_filter_and_extract_equal_mlx_lms(
    tiny_model: tuple[Any, Any], keep: list[int]
) -> None:
    """mlx-lm reads the left padding back once per layer (a wait on the running
    step); the lane reads it once. The caches that result must be the same."""
    import mlx.core as mx

    from trio_mlx._lanes.mlxlm_batch import extract_row, filter_caches

    model, _ = tiny_model
    padding = [0, 2, 5, 3]
    theirs, ours = _padded_batch(model, padding), _padded_batch(model, padding)
    for row in range(len(padding)):
        want = [c.extract(row) for c in theirs]
        got = extract_row(ours, row)
        for a, b in zip(want, got, strict=True):
            assert a.offset == b.offset == 9 - padding[row]
            assert mx.array_equal(a.keys, b.keys)
            assert mx.array_equal(a.values, b.values)
    for c in theirs:
        c.filter(keep)
    filter_caches(ours, keep)
    assert ours[0]._idx == theirs[0]._idx == 9 - min(padding[i] for i in keep)
    for a, b in zip(theirs, ours, strict=True):
        assert a._idx == b._idx
        for name in ("keys", "values", "offset", "left_padding"):
            assert mx.array_equal(getattr(a, name), getattr(b, name)), name


def _counted(calls: list[str], name: str, real: Any) -> Any:
    """``real``, recording ``name`` in ``calls`` at each call (a spy)."""

    def spy(*args: Any) -> Any:
        calls.append(name)
        return real(*args)

    return spy


def test_compaction_takes_the_lanes_filter_and_extract(
    tiny_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.models.cache import BatchKVCache

    from trio_mlx._lanes import mlxlm_batch as batch

    theirs: list[str] = []
    ours: list[str] = []
    monkeypatch.setattr(BatchKVCache, "filter", _counted(theirs, "filter", BatchKVCache.filter))
    monkeypatch.setattr(BatchKVCache, "extract", _counted(theirs, "extract", BatchKVCache.extract))
    monkeypatch.setattr(batch, "filter_caches", _counted(ours, "filter", batch.filter_caches))
    monkeypatch.setattr(batch, "extract_row", _counted(ours, "extract", batch.extract_row))
    model, tokenizer = tiny_model
    lane = _lane(model, tokenizer)
    lane.prompt_cache = PromptCache(1 << 30)
    lane.removal_delay = 0  # each finished row leaves at the end of its step
    specs = [
        RowSpec(i, tuple(tokenizer.encode(PROMPTS[i % len(PROMPTS)])), SamplingParams(
            max_tokens=3 + 2 * i, logit_bias=NO_EOS))
        for i in range(4)
    ]  # fmt: skip
    lane.step(StepPlan(specs))
    while lane.rows:
        lane.step()
    assert theirs == [], "neither of mlx-lm's per-layer reads ran"
    assert ours.count("filter") >= 2, "rows left the batch in more than one removal"
    assert ours.count("extract") >= 3, "finished rows went to the prompt cache"


def _long_and_short(model: Any, tokenizer: Any, ids: list[int]) -> dict[int, list[int]]:
    """Greedy tokens of a long prompt (0) and a short one (1), those in ``ids``
    arriving together at a lane that prefills 16 tokens a step."""
    prompts = [" ".join([PROMPT] * 3), PROMPTS[0]]
    params = SamplingParams(max_tokens=12, logit_bias=NO_EOS)
    lane = BatchLane(model, tokenizer, max_batch=4, prefill_budget=16)
    plan = StepPlan([RowSpec(i, tuple(tokenizer.encode(prompts[i])), params) for i in ids])
    out: dict[int, list[int]] = {}
    while plan.inserts or lane.rows:
        for e in lane.step(plan).events:
            assert e.error is None
            out.setdefault(e.id, []).extend(e.token_ids)
        plan = StepPlan()
    return out


def test_rows_whose_prompt_is_done_move_on_without_copying_the_others_caches(
    tiny_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short prompt done while a long one is still being prefilled leaves the prompt
    batch: the caches are filtered apart, not deep-copied first (mlx-lm's ``split``)."""
    from mlx_lm.generate import PromptProcessingBatch

    from trio_mlx._lanes import mlxlm_batch as batch

    model, tokenizer = tiny_model
    alone = {**_long_and_short(model, tokenizer, [0]), **_long_and_short(model, tokenizer, [1])}
    copies: list[str] = []
    ours: list[str] = []
    splits: list[int] = []
    prompt_class = batch.prompt_class()
    real_split = prompt_class.split

    def split(self: Any, indices: list[int]) -> Any:
        splits.append(len(self.uids) - len(set(indices)))  # rows left behind
        return real_split(self, indices)

    monkeypatch.setattr(prompt_class, "split", split)
    monkeypatch.setattr(
        PromptProcessingBatch, "_copy", _counted(copies, "copy", PromptProcessingBatch._copy)
    )
    monkeypatch.setattr(batch, "filter_caches", _counted(ours, "filter", batch.filter_caches))
    assert _long_and_short(model, tokenizer, [0, 1]) == alone
    assert any(left > 0 for left in splits), "the short row left the long one behind"
    assert copies == [], "no deep copy of the prompt batch"
    assert ours.count("filter") >= 2, "both sides filtered by the lane"


class _Forwards:
    """The model, recording the shape of every forward call's input."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.shapes.append((int(inputs.shape[0]), int(inputs.shape[1])))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _two_decoding(tokenizer: Any, params: SamplingParams) -> list[RowSpec]:
    """Rows 0 and 1 (PROMPTS[0], PROMPTS[1]): the rows that decode while others arrive."""
    return [RowSpec(i, tuple(tokenizer.encode(PROMPTS[i])), params) for i in (0, 1)]


def _long_setup(
    tokenizer: Any, decode_tokens: int
) -> tuple[list[RowSpec], SamplingParams, tuple[int, ...]]:
    """Rows 0 and 1 decoding ``decode_tokens`` each, the short arrivals' parameters
    (8 tokens), and the long prompt (PROMPTS[3], past 60 tokens)."""
    params = SamplingParams(max_tokens=decode_tokens, logit_bias=NO_EOS)
    words = tuple(tokenizer.encode(PROMPTS[3]))
    assert len(words) > 60
    short = SamplingParams(max_tokens=8, logit_bias=NO_EOS)
    return _two_decoding(tokenizer, params), short, words


def _run_lane(
    lane: BatchLane,
    first: list[RowSpec],
    later: list[RowSpec],
    *,
    until: int | None = None,
    warm: int = 4,
) -> tuple[dict[int, list[int]], list[set[int]]]:
    """``first`` decode a while, then ``later`` arrive; every row's tokens and each step's
    rows. Steps until no row is left, or with ``until``, until that row has finished."""
    tokens: dict[int, list[int]] = {}
    steps: list[set[int]] = []
    finished: set[int] = set()

    def step(specs: list[RowSpec]) -> None:
        events = lane.step(StepPlan(specs)).events
        assert all(e.error is None for e in events)
        steps.append({e.id for e in events if e.token_ids})
        for e in events:
            tokens.setdefault(e.id, []).extend(e.token_ids)
            if e.finish_reason is not None:
                finished.add(e.id)

    def done() -> bool:
        return not lane.rows if until is None else until in finished

    if first:
        step(first)
    for _ in range(warm):
        step([])
    step(later)
    for _ in range(200):
        if done():
            break
        step([])
    assert done()
    return tokens, steps


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget_and_equals_one_pass(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    first, short, long_prompt = _long_setup(tokenizer, 40)
    later = [RowSpec(10, long_prompt, short)] + [
        RowSpec(11 + i, tuple(tokenizer.encode(PROMPTS[i])), short) for i in (0, 1, 2)
    ]
    whole, _ = _run_lane(BatchLane(model, tokenizer, max_batch=8), first, later)
    forwards = _Forwards(model)
    lane = BatchLane(forwards, tokenizer, max_batch=8)
    lane.prefill_budget = 16
    chunked, steps = _run_lane(lane, first, later)
    assert chunked == whole, "chunked prefill changes no token"
    prefills = [rows * width for rows, width in forwards.shapes if width > 1]
    assert max(prefills) <= 16, "no forward pass prefills past the budget (padding counted)"
    assert len(prefills) >= len(long_prompt) // 16
    # The running rows got a token in every step while the long prompt was prefilled.
    arrived = 5  # the step call that inserted ``later``
    waited = next(i for i, s in enumerate(steps) if 10 in s) - arrived
    assert waited >= len(long_prompt) // 16
    assert all({0, 1} <= s for s in steps[arrived : arrived + waited]), steps


def test_a_prompt_longer_than_the_chunk_is_prefilled_alone_and_bounds_every_pass_meanwhile(
    tiny_model: tuple[Any, Any],
) -> None:
    """With a chunk below the budget, a prompt longer than the chunk is prefilled
    alone, a chunk a step, and while it waits or prefills no pass holds more than
    the chunk (short prompts still share one within it); once it is through, short
    arrivals share passes of up to the budget again. No token changes against one
    pass each."""
    model, tokenizer = tiny_model
    first, short, words = _long_setup(tokenizer, 60)
    # Three short prompts (7 tokens to prefill each), then the long one, arriving together.
    later = [RowSpec(10 + i, words[i : i + 8], short) for i in range(3)]
    later.append(RowSpec(20, words, short))
    after = [RowSpec(30 + i, words[i : i + 8], short) for i in range(3)]

    def run(lane: BatchLane) -> tuple[dict[int, list[int]], list[set[int]], int]:
        tokens, steps = _run_lane(lane, first, later, until=20)
        passes_before = len(getattr(lane.model, "shapes", ()))
        more, _ = _run_lane(lane, [], after, warm=0)
        for row_id, ids in more.items():
            tokens.setdefault(row_id, []).extend(ids)
        return tokens, steps, passes_before

    whole, _, _ = run(BatchLane(model, tokenizer, max_batch=8))
    forwards = _Forwards(model)
    lane = BatchLane(forwards, tokenizer, max_batch=8, prefill_budget=64, long_prompt_chunk=16)
    chunked, steps, split = run(lane)
    assert chunked == whole, "no token changes"
    passes = [(rows, width) for rows, width in forwards.shapes[:split] if width > 1]
    assert passes[0][0] == 2, "the two decoding rows' own prompts, before the arrivals"
    passes = passes[1:]
    assert all(rows * width <= 16 for rows, width in passes), f"one chunk at most: {passes}"
    assert any(rows >= 2 for rows, _ in passes), f"short ones still share a pass: {passes}"
    long_passes = [(rows, width) for rows, width in passes if width > 7]
    assert len(long_passes) >= (len(words) - 1) // 16
    assert all(rows == 1 for rows, _ in long_passes), f"the long prompt alone: {passes}"
    # The running rows got a token in every step while the long prompt was prefilled.
    arrived = 5
    waited = next(i for i, s in enumerate(steps) if 20 in s) - arrived
    assert all({0, 1} <= s for s in steps[arrived : arrived + waited]), steps
    # Through it, three short arrivals share one pass past the chunk's size again.
    assert (3, 7) in [shape for shape in forwards.shapes[split:] if shape[1] > 1]


def test_a_backlog_past_the_budget_lets_passes_take_the_budget_beside_a_long_prompt(
    tiny_model: tuple[Any, Any],
) -> None:
    """When the prompts waiting beside the longest hold more than the budget (the
    server is behind), passes take up to the budget again, the long prompt's chunk
    sharing one; once the backlog is within the budget, the long prompt goes alone
    again. No token changes against one pass each."""
    model, tokenizer = tiny_model
    first, short, words = _long_setup(tokenizer, 60)
    # The long prompt first, then five short ones (7 tokens to prefill each: 35 > 32).
    later = [RowSpec(20, words, short)]
    later += [RowSpec(10 + i, words[i : i + 8], short) for i in range(5)]
    whole, _ = _run_lane(BatchLane(model, tokenizer, max_batch=8), first, later)
    forwards = _Forwards(model)
    lane = BatchLane(forwards, tokenizer, max_batch=8, prefill_budget=32, long_prompt_chunk=16)
    chunked, _ = _run_lane(lane, first, later)
    assert chunked == whole, "no token changes"
    passes = [(rows, width) for rows, width in forwards.shapes if width > 1][1:]
    assert all(rows * width <= 32 for rows, width in passes), f"the budget bounds: {passes}"
    # 35 tokens beside the long prompt: behind, so its chunk shares the first pass.
    assert passes[0] == (2, 16), f"behind: the long prompt's chunk shares a pass: {passes}"
    # 28 left beside it: within the budget, so it goes alone and the rest wait for it.
    last_long = max(i for i, (_, width) in enumerate(passes) if width > 7)
    assert all(rows == 1 for rows, _ in passes[1 : last_long + 1]), passes
    assert sum(rows for rows, width in passes[last_long + 1 :] if width == 7) == 4, passes


def test_the_chunk_leaves_the_passes_of_prompts_shorter_than_it_as_they_were(
    tiny_model: tuple[Any, Any],
) -> None:
    """Arrivals no longer than the chunk (chat traffic): every forward pass the same
    shape as with no chunk, so the closed loop's admission groups are unchanged."""
    model, tokenizer = tiny_model
    first, short, words = _long_setup(tokenizer, 24)
    later = [RowSpec(10 + i, words[3 * i : 3 * i + 12 + i], short) for i in range(5)]
    shapes = []
    for chunk in (None, 16):  # every prompt prefills 11-15 tokens
        forwards = _Forwards(model)
        lane = BatchLane(
            forwards, tokenizer, max_batch=8, prefill_budget=40, long_prompt_chunk=chunk
        )
        _run_lane(lane, first, later)
        shapes.append(forwards.shapes)
    assert any(rows > 1 and rows * width > 16 for rows, width in shapes[1] if width > 1)
    assert shapes[1] == shapes[0]


@pytest.mark.parametrize(("budget", "multiple"), [(16, 8), (24, 16), (None, 32)])
def test_prefill_passes_rounded_to_a_width_multiple_change_no_token(
    tiny_model: tuple[Any, Any], budget: int | None, multiple: int
) -> None:
    model, tokenizer = tiny_model
    params = SamplingParams(max_tokens=30, logit_bias=NO_EOS)
    short = SamplingParams(max_tokens=8, logit_bias=NO_EOS)
    first = _two_decoding(tokenizer, params)
    later = [RowSpec(10, tuple(tokenizer.encode(PROMPTS[3])), short)] + [
        RowSpec(11 + i, tuple(tokenizer.encode(PROMPTS[i])), short) for i in (0, 2)
    ]

    def lane(width_multiple: int) -> tuple[BatchLane, _Forwards]:
        forwards = _Forwards(model)
        lane = BatchLane(forwards, tokenizer, max_batch=8, prefill_width_multiple=width_multiple)
        lane.prefill_budget = budget
        return lane, forwards

    plain, _ = lane(1)
    rounded, forwards = lane(multiple)
    assert _run_lane(rounded, first, later)[0] == _run_lane(plain, first, later)[0]
    widths = [width for _, width in forwards.shapes if width > 1]
    assert widths
    limit = budget or 2048
    # Every pass is a multiple wide, unless that would have passed the budget's chunk.
    assert all(w % multiple == 0 or -(-w // multiple) * multiple > limit for w in widths), widths
    assert max(rows * width for rows, width in forwards.shapes) <= (budget or 10**9)


def _lane_with_one_row(
    tiny_model: tuple[Any, Any], params: SamplingParams
) -> tuple[BatchLane, _Forwards, tuple[int, ...]]:
    """A lane (budget 64) whose forward passes are recorded, one row decoding (id 0);
    and the tokens of the longest prompt."""
    model, tokenizer = tiny_model
    words = tuple(tokenizer.encode(PROMPTS[3]))
    forwards = _Forwards(model)
    lane = BatchLane(forwards, tokenizer, max_batch=8, prefill_budget=64)
    lane.step(StepPlan([RowSpec(0, words[:6], params)]))
    lane.step()
    forwards.shapes.clear()
    return lane, forwards, words


def test_a_step_cuts_prompts_into_its_plans_chunk_and_reports_each_steps_timing(
    tiny_model: tuple[Any, Any],
) -> None:
    params = SamplingParams(max_tokens=40, logit_bias=NO_EOS)
    lane, forwards, long_prompt = _lane_with_one_row(tiny_model, params)
    timings: list[tuple[int, float]] = []
    plan = StepPlan([RowSpec(1, long_prompt, params)], prefill_chunk=8)
    for _ in range(len(long_prompt)):
        result = lane.step(plan)
        plan = StepPlan(prefill_chunk=8)
        assert len(result.timings) == result.steps
        timings.extend(result.timings)
        if any(e.id == 1 and e.token_ids for e in result.events):
            break  # its prompt is prefilled: its first token came
    prefills = [rows * width for rows, width in forwards.shapes if width > 1]
    assert prefills
    assert max(prefills) <= 8, "the plan's chunk, not the lane's 64"
    # Each step reports what it prefilled: the long prompt's tokens (all but its last).
    assert sum(tokens for tokens, _ in timings) == len(long_prompt) - 1
    assert all(tokens <= 8 and seconds > 0 for tokens, seconds in timings)
    lane.step(StepPlan(removes=[0, 1]))
    assert lane.step().timings == (), "no row decodes: no step is timed"


def test_a_plans_chunk_still_lets_arrivals_share_a_pass_within_the_lane_budget(
    tiny_model: tuple[Any, Any],
) -> None:
    params = SamplingParams(max_tokens=4, logit_bias=NO_EOS)
    lane, forwards, words = _lane_with_one_row(tiny_model, params)
    arrivals = [RowSpec(i, words[i : i + 20], params) for i in (1, 2, 3)]
    lane.step(StepPlan(arrivals, prefill_chunk=8))
    passes = [shape for shape in forwards.shapes if shape[1] > 1]
    assert passes[0] == (3, 8), "three rows in one pass, each cut to the plan's chunk"


def test_a_row_parked_again_before_its_first_step_back_continues_exactly(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    params = SamplingParams(max_tokens=30, logit_bias=NO_EOS)
    specs = [RowSpec(i, tuple(tokenizer.encode(PROMPTS[i])), params) for i in (0, 1)]

    def run(park: bool) -> dict[int, list[int]]:
        lane = BatchLane(model, tokenizer, max_batch=4)
        tokens: dict[int, list[int]] = {0: [], 1: []}

        def take(result: Any) -> None:
            for e in result.events:
                assert e.error is None
                tokens[e.id].extend(e.token_ids)

        take(lane.step(StepPlan(specs)))
        for k in range(100):
            if not lane.rows:
                break
            if park and k == 6:
                lane.park([1])
                take(lane.step(StepPlan(resumes=[1])))
                # The case under test: row 1 is back in the batch, not stepped yet.
                assert lane._fresh
                lane.park([1])
                take(lane.step(StepPlan(resumes=[1])))
            else:
                take(lane.step())
        assert not lane.rows
        return tokens

    assert run(park=True) == run(park=False)


def test_a_row_asking_for_logprobs_gets_the_same_ones_alone_and_joining_plain_rows(
    tiny_model: tuple[Any, Any],
) -> None:
    # The lane splits the step's log-probabilities per row only while such a row is in
    # the batch: one joining plain rows mid-run must still get its own, exactly.
    model, tokenizer = tiny_model
    plain = SamplingParams(max_tokens=30, logit_bias=NO_EOS)
    asks = SamplingParams(max_tokens=10, logit_bias=NO_EOS, logprobs=True, top_logprobs=3)
    spec = RowSpec(9, tuple(tokenizer.encode(PROMPTS[1])), asks)

    def run(first: list[RowSpec]) -> list[Any]:
        lane = BatchLane(model, tokenizer, max_batch=8)
        got: list[Any] = []
        for n in range(100):
            inserts = first if n == 0 else [spec] if n == 4 else []
            events = lane.step(StepPlan(inserts)).events
            for e in events:
                assert e.error is None
                if e.id == spec.id:
                    assert e.logprobs is not None
                    got.extend(e.logprobs)
                else:
                    assert e.logprobs is None
            if n > 4 and not lane.rows:
                break
        return got

    alone = run([])
    joined = run([RowSpec(i, tuple(tokenizer.encode(PROMPTS[i])), plain) for i in (0, 2)])
    assert len(alone) == len(joined) == 10
    for a, b in zip(alone, joined, strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_slow_decode_step_is_logged_with_what_it_carried_at_most_once_per_quiet_period(
    tiny_model: tuple[Any, Any],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every step counts as slow here (threshold 0): the first one logs, the rest are
    counted until the quiet period ends, and the next line says how many were not logged."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))  # no module compiled there
    model, tokenizer = tiny_model
    lane = _lane(model, tokenizer)
    lane.slow_step_seconds, lane.slow_step_quiet = 0.0, 3600.0
    params = SamplingParams(max_tokens=6, logit_bias=NO_EOS)
    prompts = [tuple(tokenizer.encode(p)) for p in PROMPTS[:3]]

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if "slow decode step" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="trio_mlx"):
        steps = lane.step(StepPlan([RowSpec(i, p, params) for i, p in enumerate(prompts)])).steps
        while lane.rows:
            steps += lane.step().steps
        assert len(logged()) == 1
        assert steps > 3
        first = logged()[0]
        # One pass prefills the three prompts, as wide as the longest but its last token.
        width = 3 * (max(map(len, prompts)) - 1)
        assert re.fullmatch(
            r"slow decode step: \d+ ms; step 1, \d+ ms of it in Python's garbage collector; "
            r"no decode pass; "
            rf"3 rows in the batch, a prefill pass of {width} positions, "
            r"3 rows prefilling, buffer None positions, eager; no kernel compiled; memory active \d+ -> \d+ MiB, "
            r"cached \d+ -> \d+ MiB, peak \d+ MiB; 0 slow steps not logged before it",
            first,
        ), first
        lane.slow_step_quiet = 0.0
        lane.step(StepPlan([RowSpec(9, prompts[0], params)]))
        while lane.rows:
            lane.step()
    assert logged()[1].endswith(f"; {steps - 1} slow steps not logged before it")
    assert all(
        re.search(
            r"eager; no kernel compiled; memory [^;]+; 0 slow steps not logged before it$", line
        )
        for line in logged()[2:]
    )


def test_a_slow_step_without_a_decode_pass_says_so_rather_than_an_earlier_passs_phases(
    tiny_model: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A long prompt alone is prefilled in chunks: those steps run no decode pass,
    and their lines must not repeat the phases of the pass before them."""
    model, tokenizer = tiny_model
    words = tuple(tokenizer.encode(PROMPTS[3]))
    lane = BatchLane(model, tokenizer, max_batch=8, prefill_budget=4)
    lane.slow_step_seconds, lane.slow_step_quiet = 0.0, 0.0
    params = SamplingParams(max_tokens=3, logit_bias=NO_EOS)
    with caplog.at_level(logging.INFO, logger="trio_mlx"):
        lane.step(StepPlan([RowSpec(0, words[:5], params)]))
        while lane.rows:
            lane.step()
        lane.step(StepPlan([RowSpec(1, words, params)]))  # the first of several chunks
    lines = [r.getMessage() for r in caplog.records if "slow decode step" in r.getMessage()]
    assert len(words) > 12
    # The first row: its prompt prefilled (no pass), its first step on an idle
    # batch (mlx-lm's), then the lane's own decode passes.
    assert "; no decode pass; 1 rows in the batch, a prefill pass of 4 positions" in lines[0]
    assert "; the arrivals' first step (mlx-lm's own) took " in lines[1]
    assert "; the decode pass built in " in lines[2]
    assert "; no decode pass; 1 rows in the batch, a prefill pass of 4 positions" in lines[-1]


def test_a_slow_admission_is_logged_with_the_rows_it_compacted_and_inserted(
    tiny_model: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The work before a step's decoding is timed too: a row cancelled, then two
    inserted, is one compaction of one dead row and two inserts."""
    model, tokenizer = tiny_model
    lane = _lane(model, tokenizer)
    params = SamplingParams(max_tokens=50, logit_bias=NO_EOS)
    prompts = [tuple(tokenizer.encode(p)) for p in PROMPTS[:3]]

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if "slow admission" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="trio_mlx"):
        lane.step(StepPlan([RowSpec(0, prompts[0], params)]))
        lane.slow_step_seconds, lane.slow_step_quiet = 0.0, 3600.0
        lane.step()  # nothing removed or admitted: nothing to say
        assert logged() == []
        both = [RowSpec(1, prompts[1], params), RowSpec(2, prompts[2], params)]
        lane.step(StepPlan(both, removes=[0]))
        lane.discard([1, 2])
    assert len(logged()) == 1
    assert re.fullmatch(
        r"slow admission: \d+ ms; 1 dead rows compacted, 2 rows inserted, 0 resumed, "
        r"0 rows in the batch; memory active \d+ MiB, cached \d+ MiB, peak \d+ MiB; "
        r"0 slow steps not logged before it",
        logged()[0],
    ), logged()[0]


def test_a_slow_traced_step_says_whether_it_traced_a_new_shape(
    tiny_model: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    model, tokenizer = tiny_model
    lane = _lane(model, tokenizer)
    lane.traced_decode = True
    lane.slow_step_seconds, lane.slow_step_quiet = 0.0, 0.0
    params = SamplingParams(max_tokens=6, logit_bias=NO_EOS)
    with caplog.at_level(logging.INFO, logger="trio_mlx"):
        lane.step(
            StepPlan(
                [RowSpec(i, tuple(tokenizer.encode(p)), params) for i, p in enumerate(PROMPTS[:3])]
            )
        )
        while lane.rows:
            lane.step()
    shapes = [
        int(m.group(1))
        for r in caplog.records
        if (m := re.search(r"traced, (\d+) new shapes", r.getMessage()))
    ]
    assert lane.traced is not None
    # A step that met a new batch shape says so (the build's own check traces once more).
    assert 1 <= sum(shapes) <= lane.traced.traces
    assert shapes.count(0) >= 2  # and the steps that replayed one say so


def test_the_slow_step_log_names_the_kernel_modules_mlx_compiled_during_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLX's CUDA backend writes each module it compiles to its PTX cache directory:
    the ones written since the step began are named, the older ones are not."""
    import os

    from trio_mlx._lanes.slow_steps import kernels_compiled

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert kernels_compiled(0.0) == "no kernel compiled"
    old = tmp_path / "gather_bfloat16_int32_1.ptx"
    old.write_bytes(b"")
    os.utime(old, (1000.0, 1000.0))
    for i in range(6):
        (tmp_path / f"scatter_axis_{i}.ptx").write_bytes(b"")
        (tmp_path / f"scatter_axis_{i}.cu").write_text("source")
    assert kernels_compiled(2000.0) == (
        "6 kernel modules compiled: scatter_axis_0, scatter_axis_1, scatter_axis_2, "
        "scatter_axis_3 and 2 more"
    )
    assert kernels_compiled(0.0).startswith("7 kernel modules compiled: gather_bfloat16_int32_1")
    # A module name past 245 characters is cut into folders: still one module.
    nested = tmp_path / "nested"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(nested))
    (nested / ("fused_" + "x" * 239)).mkdir(parents=True)
    (nested / ("fused_" + "x" * 239) / "_tail.ptx").write_bytes(b"")
    assert kernels_compiled(2000.0) == f"1 kernel modules compiled: fused_{'x' * 54}"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "absent"))
    assert kernels_compiled(0.0) == "no kernel compiled"


def _small_lane(tiny_model: tuple[Any, Any]) -> BatchLane:
    model, tokenizer = tiny_model
    return BatchLane(model, tokenizer, max_batch=4)


def _spec(row_id: int, tokenizer: Any, max_tokens: int) -> RowSpec:
    prompt = tuple(tokenizer.encode(f"Hello number {row_id}"))
    return RowSpec(row_id, prompt, SamplingParams(max_tokens=max_tokens, logit_bias=NO_EOS))


def _first_tokens(lane: BatchLane, specs: list[RowSpec]) -> dict[int, list[int]]:
    """Insert rows and single-step through their prefill; return their first tokens."""
    ids: dict[int, list[int]] = {spec.id: [] for spec in specs}
    events = lane.step(StepPlan(specs)).events
    while True:
        for event in events:
            ids[event.id].extend(event.token_ids)
        if all(ids.values()):
            return ids
        events = lane.step().events


def test_a_burst_yields_the_same_tokens_as_single_steps(tiny_model: tuple[Any, Any]) -> None:
    tokenizer = tiny_model[1]
    single, burst = _small_lane(tiny_model), _small_lane(tiny_model)
    specs = [_spec(i, tokenizer, 40) for i in (1, 2)]
    expected = _first_tokens(single, specs)
    first = burst.step(StepPlan(specs, steps=16), seconds=60.0)
    # The burst runs through the prefill and stops at the step of the first tokens.
    assert 1 <= first.steps < 16
    assert {e.id: list(e.token_ids) for e in first.events} == expected
    ids = {e.id: list(e.token_ids) for e in first.events}
    for _ in range(10):
        for event in single.step().events:
            expected[event.id].extend(event.token_ids)
    result = burst.step(StepPlan(steps=10), seconds=60.0)
    assert result.steps == 10
    # One event per row for the whole burst.
    assert sorted(e.id for e in result.events) == [1, 2]
    for event in result.events:
        assert len(event.token_ids) == 10
        assert event.generated == 11
        ids[event.id].extend(event.token_ids)
    assert ids == expected


def test_a_burst_stops_at_a_finished_row(tiny_model: tuple[Any, Any]) -> None:
    tokenizer = tiny_model[1]
    lane = _small_lane(tiny_model)
    _first_tokens(lane, [_spec(1, tokenizer, 4), _spec(2, tokenizer, 40)])
    result = lane.step(StepPlan(steps=16), seconds=60.0)
    assert result.steps == 3
    by_id = {e.id: e for e in result.events}
    assert by_id[1].finish_reason == "length"
    assert by_id[1].generated == 4
    assert len(by_id[1].token_ids) == 3
    assert by_id[2].finish_reason is None
    assert len(by_id[2].token_ids) == 3


def test_a_burst_stops_when_interrupted_or_out_of_time(tiny_model: tuple[Any, Any]) -> None:
    tokenizer = tiny_model[1]
    lane = _small_lane(tiny_model)
    _first_tokens(lane, [_spec(1, tokenizer, 100)])
    assert lane.step(StepPlan(steps=16), seconds=60.0, interrupt=lambda: True).steps == 1
    calls: list[int] = []

    def after_three() -> bool:
        calls.append(1)
        return len(calls) >= 3

    assert lane.step(StepPlan(steps=16), seconds=60.0, interrupt=after_three).steps == 3
    assert lane.step(StepPlan(steps=16), seconds=0.0).steps == 1
    assert lane.step(StepPlan(steps=5), seconds=60.0).steps == 5
