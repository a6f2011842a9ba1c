"""The decode step traced once per batch shape (``trio_mlx._accel.traced_decode``).

The traced step writes and reads the same ``BatchKVCache`` buffers as the
model's own step, with positions as arrays; whatever the batch does around it
(rows joining at different lengths, removal, parking, a buffer growing past
mlx-lm's 256-position step), every greedy row must produce exactly the tokens
of the eager lane. It is off unless asked for; these tests ask.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest

import trio_mlx
from engine_helpers import NO_EOS, PROMPT
from trio_mlx import SamplingParams
from trio_mlx._accel import traced_decode as traced_decode
from trio_mlx.testing import BatchLane, RowSpec, StepPlan, batch_lane

pytestmark = [pytest.mark.model]

PROMPTS = ["Hello world", "The quick brown fox", " ".join([PROMPT] * 6), "def main():"]


def _run(
    model: Any, tokenizer: Any, *, traced: bool, sizes: tuple[int, ...], park_at: int | None = None
) -> tuple[dict[int, list[int]], BatchLane]:
    """Row i (prompt i, ``sizes[i]`` tokens) arrives at step 3 i; row 0 is parked at ``park_at``."""
    lane = BatchLane(model, tokenizer, max_batch=4, traced_decode=traced)
    lane.removal_fraction, lane.removal_delay = 0, 3
    specs = [
        RowSpec(
            i, tuple(tokenizer.encode(PROMPTS[i])), SamplingParams(max_tokens=n, logit_bias=NO_EOS)
        )
        for i, n in enumerate(sizes)
    ]
    tokens: dict[int, list[int]] = {}
    for k in range(2000):
        if k > 3 * len(specs) and not lane.rows:
            break
        if k % 3 == 0 and k // 3 < len(specs):
            plan = StepPlan([specs[k // 3]])
        elif k == park_at:
            lane.park([0])
            plan = StepPlan(resumes=[0])
        else:
            plan = StepPlan()
        for e in lane.step(plan).events:
            assert e.error is None
            tokens.setdefault(e.id, []).extend(e.token_ids)
    assert not lane.rows
    return tokens, lane


def test_rows_joining_leaving_and_parked_decode_the_same_tokens_traced(
    tiny_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_model
    sizes = (40, 12, 30, 25)
    want, eager = _run(model, tokenizer, traced=False, sizes=sizes, park_at=10)
    got, lane = _run(model, tokenizer, traced=True, sizes=sizes, park_at=10)
    assert eager.traced is None
    assert got == want
    assert lane.traced is not None
    assert lane.traced.traced_steps > 20, "the traced step ran"


def test_a_row_past_the_buffers_end_decodes_on_traced_in_a_grown_buffer(
    tiny_model: tuple[Any, Any],
) -> None:
    """A full buffer is grown by the traced step itself, as mlx-lm's step would grow
    it: no step runs eagerly (an eager step at a served batch's size compiles
    kernels nothing else met), and the rows decode the eager lane's tokens."""
    model, tokenizer = tiny_model
    sizes = (300, 280)  # two rows of a few prompt tokens each cross position 256
    want, _ = _run(model, tokenizer, traced=False, sizes=sizes)
    got, lane = _run(model, tokenizer, traced=True, sizes=sizes)
    assert got == want
    assert lane.traced is not None
    assert lane.traced.grown >= 1, "a full buffer was met"
    assert lane.traced.eager_steps == 0
    assert lane.traced.traced_steps > 250


def _raises(self: Any, keys: Any, values: Any) -> Any:  # fault: a cache the trace cannot take
    raise RuntimeError("injected trace failure")


def test_a_traced_step_that_disagrees_with_the_model_is_refused(
    tiny_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, tokenizer = tiny_model
    assert traced_decode.build(model) is not None
    real = traced_decode.TracedCache.update_and_fetch

    def one_too_far(self: Any, keys: Any, values: Any) -> Any:  # fault: writes past its slot
        self.idx = self.idx + 1
        return real(self, keys, values)

    monkeypatch.setattr(traced_decode.TracedCache, "update_and_fetch", one_too_far)
    with caplog.at_level(logging.WARNING, logger="trio_mlx"):
        assert traced_decode.build(model) is None
    assert "did not match" in caplog.text
    monkeypatch.setattr(traced_decode.TracedCache, "update_and_fetch", _raises)
    assert traced_decode.build(model) is None, "a step that cannot be traced is refused too"
    lane = BatchLane(model, tokenizer, max_batch=2, traced_decode=True)
    spec = RowSpec(0, (5, 6, 7), SamplingParams(max_tokens=4, logit_bias=NO_EOS))
    lane.step(StepPlan([spec]))
    while lane.rows:
        lane.step()
    assert lane.traced is None
    assert lane.traced_decode is False, "the lane decodes eagerly from now on"


@pytest.mark.parametrize(
    ("setting", "cuda", "on"),
    [(None, True, True), ("0", True, False), ("1", True, True), ("", True, True),
     (None, False, False), ("0", False, False), ("1", False, True)],
)  # fmt: skip
def test_the_traced_step_is_on_by_default_on_cuda_only(
    setting: str | None, cuda: bool, on: bool
) -> None:
    environ = {} if setting is None else {"TRIO_MLX_TRACED_DECODE": setting}
    assert traced_decode.wanted(environ, cuda=cuda) is on


@pytest.mark.parametrize(("setting", "on"), [("1", True), ("0", False), (None, None)])
async def test_the_setting_turns_the_traced_step_on_and_the_default_follows_the_device(
    tiny_model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    setting: str | None,
    on: bool | None,
) -> None:
    """1 turns it on and 0 off anywhere; unset, it is on on CUDA only (the CPU leaves it off)."""
    import mlx.core as mx

    if on is None:
        on = bool(mx.cuda.is_available())
    if setting is None:
        monkeypatch.delenv("TRIO_MLX_TRACED_DECODE", raising=False)
    else:
        monkeypatch.setenv("TRIO_MLX_TRACED_DECODE", setting)
    caplog.set_level(logging.INFO, logger="trio_mlx")
    async with trio_mlx.open_engine(tiny_model_path, max_batch=4) as engine:
        assert ("traced once per batch shape" in caplog.text) is on, "start-up logs it"
        lane = batch_lane(engine)
        assert (lane.traced is not None) is on
        params = SamplingParams(max_tokens=16, logit_bias=NO_EOS)
        results = [await engine.complete(p, params) for p in PROMPTS[:2]]
    assert all(len(r.token_ids) == 16 for r in results)


def _negate_final_norm(model: Any, _tokenizer: Any) -> None:
    """An exclusive job that changes a weight (as a fine-tuning job would): new arrays."""
    model.model.norm.weight = -model.model.norm.weight


async def _two_rows(engine: trio_mlx.Engine) -> list[list[int]]:
    """The greedy tokens of two rows decoding together."""
    params = SamplingParams(max_tokens=24, logit_bias=NO_EOS)
    got: list[list[int]] = [[], []]
    async with engine.generate(PROMPTS[0], params) as a, engine.generate(PROMPTS[1], params) as b:
        for i, stream in enumerate((a, b)):
            async for delta in stream:
                got[i].extend(delta.token_ids)
    return got


async def _two_rows_after(model_path: Path, job: Any) -> tuple[list[list[int]], Any, Any]:
    """Two rows decoding together before the job and after it: the tokens after, the
    lane's traced step before and after. No prompt cache: the rows after the job
    have the shapes the traced step met before it (a new shape is traced anew)."""
    async with trio_mlx.open_engine(model_path, max_batch=4, prompt_cache_bytes=0) as engine:
        lane = batch_lane(engine)
        await _two_rows(engine)
        before = lane.traced
        steps = before.traced_steps if before is not None else 0
        await engine.run_exclusive(job)
        got = await _two_rows(engine)
        if before is not None:
            assert steps > 0, "the shape was traced before the job"
        return got, before, lane.traced


async def test_a_job_that_changes_the_weights_gets_a_new_traced_step(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_MLX_TRACED_DECODE", "0")
    want, _, _ = await _two_rows_after(tiny_model_path, _negate_final_norm)
    monkeypatch.setenv("TRIO_MLX_TRACED_DECODE", "1")
    got, before, after = await _two_rows_after(tiny_model_path, _negate_final_norm)
    assert got == want, "the rows decode with the job's weights"
    assert before is not None
    assert after is not None
    assert after is not before, "traced and checked again"
    assert after.traced_steps > 0
    _, before, after = await _two_rows_after(tiny_model_path, lambda m, t: None)
    assert after is before, "a job that changed nothing keeps the traced step"


async def _adapter_and_base_rows(model_path: Path, adapter: Path) -> tuple[list[list[int]], Any]:
    """A row under a LoRA adapter and a base row decoding together; the lane's traced step."""
    async with trio_mlx.open_engine(model_path, max_batch=4, prompt_cache_bytes=0) as engine:
        await engine.mount_adapter("shout", adapter)
        await _two_rows(engine)  # base rows together: the traced step meets the shape
        got: list[list[int]] = [[], []]
        base = SamplingParams(max_tokens=24, logit_bias=NO_EOS)
        lora = SamplingParams(max_tokens=24, logit_bias=NO_EOS, adapter="shout")
        async with engine.generate(PROMPTS[0], lora) as a, engine.generate(PROMPTS[1], base) as b:
            for i, stream in enumerate((a, b)):
                async for delta in stream:
                    got[i].extend(delta.token_ids)
        return got, batch_lane(engine).traced


async def test_rows_under_adapters_decode_with_their_layers_not_the_traced_base(
    tiny_model_path: Path, tiny_adapter_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_MLX_TRACED_DECODE", "0")
    want, _ = await _adapter_and_base_rows(tiny_model_path, tiny_adapter_path)
    monkeypatch.setenv("TRIO_MLX_TRACED_DECODE", "1")
    got, traced = await _adapter_and_base_rows(tiny_model_path, tiny_adapter_path)
    assert got == want
    assert traced is not None
    assert traced.traced_steps > 0, "base rows alone took the traced step"


def test_a_shape_that_fails_to_trace_falls_back_without_failing_a_row(
    tiny_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, tokenizer = tiny_model
    sizes = (30, 20, 25, 30)
    want, _ = _run(model, tokenizer, traced=False, sizes=sizes)
    real = traced_decode.TracedDecode._step
    rows_seen: list[int] = []

    def fails_at_four_rows(self: Any, tokens: Any, *args: Any) -> Any:  # fault injection
        rows_seen.append(tokens.shape[0])
        if tokens.shape[0] == 4:
            raise RuntimeError("injected trace failure")
        return real(self, tokens, *args)

    monkeypatch.setattr(traced_decode.TracedDecode, "_step", fails_at_four_rows)
    with caplog.at_level(logging.WARNING, logger="trio_mlx"):
        got, lane = _run(model, tokenizer, traced=True, sizes=sizes)
    assert got == want, "every row finished with its own tokens"
    assert 4 in rows_seen
    assert lane.traced is not None
    assert lane.traced.failed
    assert lane.traced.traced_steps > 0, "fewer rows took traced steps before the failure"
    assert "a new shape failed" in caplog.text


def _churn(model: Any, tokenizer: Any, *, traced: bool) -> tuple[dict[int, list[int]], BatchLane]:
    """Served traffic in small: 120 rows of random prompts and lengths, up to two
    arriving per step while twelve decode, so rows leave and join all the time."""
    rng = random.Random(0)
    lane = BatchLane(model, tokenizer, max_batch=16, traced_decode=traced)
    tokens: dict[int, list[int]] = {}
    arrived = 0
    for _ in range(2000):
        specs = []
        while lane.rows + len(specs) < 12 and arrived < 120 and len(specs) < 2:
            prompt = tuple(rng.randint(1, 200) for _ in range(rng.randint(3, 40)))
            n = rng.randint(5, 60)
            specs.append(RowSpec(arrived, prompt, SamplingParams(max_tokens=n, logit_bias=NO_EOS)))
            arrived += 1
        for e in lane.step(StepPlan(specs)).events:
            assert e.error is None
            tokens.setdefault(e.id, []).extend(e.token_ids)
        if arrived == 120 and not lane.rows:
            break
    assert len(tokens) == 120
    return tokens, lane


def test_rows_coming_and_going_replay_a_few_traced_shapes(
    tiny_model: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A removal trims the rows' shared left padding (mlx-lm's ``filter``), leaving
    a buffer of any length; padded back to the cache's step, the lengths repeat and
    the traced graphs are a few, not one per removal."""
    model, tokenizer = tiny_model
    want, _ = _churn(model, tokenizer, traced=False)
    got, lane = _churn(model, tokenizer, traced=True)
    assert got == want
    traced = lane.traced
    assert traced is not None
    assert traced.traced_steps > 300
    assert traced.padded > 10, "removals left buffers of other lengths"
    # 1-12 rows over buffers of 256 positions (no row here passes 100 positions);
    # without the padding this schedule traced 45 shapes.
    assert traced.traces <= 16
    with caplog.at_level(logging.INFO, logger="trio_mlx"):
        lane.close()
    assert f"{traced.traces} shapes traced" in caplog.text, "shutdown logs what it did"


def test_a_traced_step_past_its_shape_limit_starts_afresh_and_decodes_the_same(
    tiny_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny_model
    want, _ = _churn(model, tokenizer, traced=False)
    monkeypatch.setattr(traced_decode, "MAX_SHAPES", 3)
    got, lane = _churn(model, tokenizer, traced=True)
    assert got == want
    assert lane.traced is not None
    # Shapes met again after a fresh start are traced again: more traces than shapes.
    assert lane.traced.traces > 16
