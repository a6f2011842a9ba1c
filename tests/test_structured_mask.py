"""Grammar masks at batch level: the bitmask unpack and the lane's one-fill-per-step path.

The batch lane computes every constrained row's mask of a decode step together
(``trio_mlx._lanes.structured.GrammarBatch``); these tests check that it yields token
for token what each row's processor alone yields, with rows of different
schemas and rows without one in the same batch, and that the MLX unpack of
llguidance's bitmask equals numpy's bit for bit.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine_helpers import NO_EOS
from trio_mlx import SamplingParams
from trio_mlx._lanes.structured import GrammarCompiler, unpack_bitmask
from trio_mlx.testing import BatchLane, RowSpec, StepPlan

_S = {"type": "string", "maxLength": 8}
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": _S, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _S, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
]


def _reference(words: np.ndarray, width: int) -> np.ndarray:
    """Bit j of word i allows token 32 i + j; tokens past the mask are forbidden."""
    out = np.zeros((words.shape[0], width), dtype=bool)
    for r in range(words.shape[0]):
        for token in range(min(width, words.shape[1] * 32)):
            word = int(words[r, token // 32]) & 0xFFFFFFFF
            out[r, token] = bool((word >> (token % 32)) & 1)
    return out


@pytest.mark.parametrize("width", [1, 31, 33, 95, 100, 130])
def test_mlx_and_numpy_unpack_llguidance_bitmasks_bit_for_bit(width: int) -> None:
    rng = np.random.default_rng(width)
    for rows in (1, 3):
        # 3 words = 96 tokens: widths below, at and past the mask's end.
        words = rng.integers(-(2**31), 2**31, size=(rows, 3), dtype=np.int64).astype(np.int32)
        words[0, 0] = -1  # every bit set, the sign bit included
        expected = _reference(words, width)
        for device in (True, False):
            got = unpack_bitmask(words, width, device=device)
            assert got.dtype == mx.bool_
            assert got.shape == (rows, width)
            assert np.array_equal(np.array(got), expected), device


def test_mlx_unpack_equals_numpy_at_a_large_odd_vocabulary() -> None:
    width = 128_257  # not a multiple of 32
    words = (
        np.random.default_rng(0)
        .integers(-(2**31), 2**31, size=(4, (width + 31) // 32), dtype=np.int64)
        .astype(np.int32)
    )
    on_device = np.array(unpack_bitmask(words, width, device=True))
    on_host = np.array(unpack_bitmask(words, width, device=False))
    assert np.array_equal(on_device, on_host)
    assert on_host.sum() > 0


def _run(tiny_model: Any, *, grammar_batch: bool) -> tuple[dict[int, list[int]], BatchLane]:
    model, tokenizer = tiny_model
    compiler = GrammarCompiler(tokenizer)
    lane = BatchLane(model, tokenizer, max_batch=8, grammar_batch=grammar_batch)
    specs = []
    for i in range(6):
        # Rows 0-2 and 4 constrained (two share a schema), 3 and 5 free; row 4 has a bias too.
        schema = None if i in (3, 5) else SCHEMAS[i % len(SCHEMAS)]
        bias = {**NO_EOS, 5: 2.0} if i in (4, 5) else None
        params = SamplingParams(max_tokens=60, json_schema=schema, logit_bias=bias)
        constraint = compiler.compile(params)
        prompt = tuple(tokenizer.encode(f"Row {i} says"))
        specs.append(RowSpec(i, prompt, params, constraint))
    tokens: dict[int, list[int]] = {spec.id: [] for spec in specs}
    events = lane.step(StepPlan(specs[:4])).events
    for _ in range(400):
        for event in events:
            assert event.error is None, event.error
            tokens[event.id].extend(event.token_ids)
        if not lane.rows:
            break
        # Two rows join mid-way: the batch path then runs with rows at different steps.
        late = specs[4:] if len(tokens[0]) == 3 else ()
        events = lane.step(StepPlan(late)).events
    assert not lane.rows
    return tokens, lane


@pytest.mark.parametrize("gpu_path", [False, True])
def test_batched_grammar_masks_give_each_rows_own_tokens(
    tiny_model: Any, gpu_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone, reference = _run(tiny_model, grammar_batch=False)
    if gpu_path:
        # The GPU's choices on this CPU: MLX unpack, forward pass queued before the read-back.
        from trio_mlx._lanes import structured as _structured

        monkeypatch.setattr(_structured, "_on_gpu", lambda: True)
    batched, lane = _run(tiny_model, grammar_batch=True)
    assert batched == alone
    assert all(batched.values())
    # The batch path ran: several steps, with several rows each.
    assert lane.grammar.steps > 5
    assert lane.grammar.rows > 2 * lane.grammar.steps
    assert reference.grammar.steps == 0


def _mixed_lane(tiny_model: Any) -> tuple[BatchLane, list[RowSpec]]:
    model, tokenizer = tiny_model
    compiler = GrammarCompiler(tokenizer)
    lane = BatchLane(model, tokenizer, max_batch=4)
    specs = []
    for i in range(3):
        schema = {"type": "array", "items": {"type": "integer"}} if i < 2 else None
        params = SamplingParams(max_tokens=30, json_schema=schema, logit_bias=NO_EOS)
        prompt = tuple(tokenizer.encode(f"Row {i} says"))
        specs.append(RowSpec(i, prompt, params, compiler.compile(params)))
    return lane, specs


def _drive(lane: BatchLane, specs: list[RowSpec], fault: Any) -> dict[int, Any]:
    """Step until every row ended; ``fault(step)`` runs before each step. Row -> error or text."""
    ended: dict[int, Any] = {}
    tokens: dict[int, int] = {spec.id: 0 for spec in specs}
    events = lane.step(StepPlan(specs)).events
    for step in range(200):
        for event in events:
            tokens[event.id] += len(event.token_ids)
            if event.error is not None:
                ended[event.id] = event.error
            elif event.finish_reason is not None:
                ended[event.id] = event.finish_reason
        if not lane.rows:
            break
        fault(step)
        events = lane.step().events
    assert not lane.rows
    return ended


def test_a_row_that_leaves_its_grammar_fails_alone_in_a_batched_step(tiny_model: Any) -> None:
    from trio_mlx import GenerationFailed

    lane, specs = _mixed_lane(tiny_model)
    bad = specs[0].constraint.matcher

    def fault(step: int) -> None:
        if step == 1:
            # Knock row 0's matcher out of its grammar between two steps.
            bad.consume_token(specs[0].prompt[0])

    ended = _drive(lane, specs, fault)
    assert isinstance(ended[0], GenerationFailed)
    assert "left its grammar" in str(ended[0]) or "matcher failed" in str(ended[0])
    assert ended[1] in ("stop", "length")  # its value may complete
    assert ended[2] == "length"
    assert lane.grammar.steps > 3


def test_a_failing_mask_fill_fails_the_steps_constrained_rows_only(tiny_model: Any) -> None:
    from trio_mlx import GenerationFailed

    class BrokenExecutor:
        def unsafe_compute_mask_ptr(self, *args: Any) -> None:
            raise RuntimeError("injected fill failure")

    lane, specs = _mixed_lane(tiny_model)

    def fault(step: int) -> None:
        if step == 0:  # before the first batched step
            lane.grammar._executor = BrokenExecutor()

    ended = _drive(lane, specs, fault)
    assert isinstance(ended[0], GenerationFailed)
    assert "injected fill failure" in str(ended[0])
    assert isinstance(ended[1], GenerationFailed)
    assert ended[2] == "length"  # the unconstrained row decodes on
