"""Speculative decoding in the batch (prompt lookup): greedy outputs equal plain decoding
token for token, drafts get accepted where the text repeats, the rejection rule keeps a
sampled row's distribution, and models that cannot speculate say so and stay unchanged."""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from engine_helpers import generate_across_a_park
from trio_mlx.testing import batch_lane, make_random_llama, make_random_model

#: A prompt that repeats itself: its n-grams come back in the output.
REPEATING = "alpha beta gamma delta epsilon alpha beta gamma delta epsilon alpha beta gamma"
PROMPTS = [
    REPEATING,
    "The quick brown fox jumps over the lazy dog",
    "one two three one two three one two",
    "def f(x): return x + 1\ndef g(x): return f(x) * 2\ndef f(x): return",
    "Hello",
    "a b c d e f g a b c d e f g a b c",
    "lorem ipsum dolor sit amet lorem ipsum",
    "zeta eta theta iota kappa lambda mu",
]


@pytest.fixture(scope="module")
def loopy_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama with small weights: its greedy text soon repeats itself, so
    prompt lookup finds drafts in its own output."""
    return make_random_llama(tmp_path_factory.mktemp("models") / "loopy", weight_scale=1.0)


async def _run(
    path: Path | None, requests: list[tuple[Any, trio_mlx.SamplingParams]], **settings: Any
) -> tuple[list[tuple[int, ...]], trio_mlx.EngineStatistics, bool]:
    """Every request's token ids (all at once in one engine), its statistics, and
    whether the lane had a speculator. The governor is off unless asked for: it reads
    the clock, and these tests count drafts."""
    outs: list[tuple[int, ...]] = [()] * len(requests)
    settings = {"speculation_governor": False, **settings}
    async with trio_mlx.open_engine(path, max_batch=8, **settings) as engine:

        async def one(i: int, prompt: Any, params: trio_mlx.SamplingParams) -> None:
            outs[i] = (await engine.complete(prompt, params)).token_ids

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i, (prompt, params) in enumerate(requests):
                    nursery.start_soon(one, i, prompt, params)
        return outs, engine.statistics(), batch_lane(engine).speculator is not None


def _greedy(n: int = 40, **extra: Any) -> trio_mlx.SamplingParams:
    return trio_mlx.SamplingParams(max_tokens=n, ignore_eos=True, **extra)


@pytest.mark.parametrize("model", ["tiny", "loopy"])
async def test_a_batch_of_8_mixing_speculating_and_plain_rows_equals_plain_decoding(
    tiny_model_path: Path, loopy_model_path: Path, model: str
) -> None:
    path = tiny_model_path if model == "tiny" else loopy_model_path
    requests = [(p, _greedy(speculate=i % 2 == 0)) for i, p in enumerate(PROMPTS)]
    plain, _, _ = await _run(path, requests)
    spec, stats, on = await _run(path, requests, prompt_lookup=True)
    assert on
    assert spec == plain
    assert stats.draft_tokens["prompt_lookup"] > 0
    assert 0 < stats.draft_accepted_tokens["prompt_lookup"] <= stats.draft_tokens["prompt_lookup"]


async def test_a_row_alone_accepts_drafts_and_equals_plain_decoding(
    tiny_model_path: Path, endless_model_path: Path
) -> None:
    # The endless model says "a" forever: after a few tokens every draft is right.
    chat = [{"role": "user", "content": REPEATING}]
    plain, _, _ = await _run(endless_model_path, [(chat, _greedy(60))])
    spec, stats, _ = await _run(
        endless_model_path,
        [(chat, _greedy(60))],
        prompt_lookup=True,
        num_draft_tokens=6,
    )
    assert spec == plain
    drafted, taken = (
        stats.draft_tokens["prompt_lookup"],
        stats.draft_accepted_tokens["prompt_lookup"],
    )
    assert taken > 0.8 * drafted
    # The random tiny model alone, on a prompt that repeats itself: unchanged.
    requests = [(REPEATING, _greedy(60))]
    plain, _, _ = await _run(tiny_model_path, requests)
    spec, _, _ = await _run(tiny_model_path, requests, prompt_lookup=True, num_draft_tokens=6)
    assert spec == plain


async def test_rejected_drafts_leave_the_output_unchanged(endless_model_path: Path) -> None:
    # "aaab aaac ...": the prompt's drafts after "aa" say b, c, ... where the model says a.
    chat = [{"role": "user", "content": "aaab aaac aaad aaae aaaf aaag"}]
    for requests in ([(chat, _greedy(40))], [(chat, _greedy(40)), (PROMPTS[3], _greedy(40))]):
        plain, _, _ = await _run(endless_model_path, requests)
        spec, stats, _ = await _run(endless_model_path, requests, prompt_lookup=True)
        assert spec == plain
        drafted = stats.draft_tokens["prompt_lookup"]
        assert 0 < stats.draft_accepted_tokens["prompt_lookup"] < drafted


@pytest.mark.parametrize("wrong_at", [0, 1, 2, "mixed"])
async def test_drafts_wrong_from_a_position_roll_back_exactly(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, wrong_at: int | str
) -> None:
    """Fault injection: each row's drafts are the tokens plain decoding produced, made
    wrong from position ``wrong_at`` on (0: every draft rejected; "mixed": a different
    position per row), so each step cuts and shifts rows by known amounts."""
    from trio_mlx._lanes.drafter import PromptLookup

    requests = [(p, _greedy(30)) for p in PROMPTS]
    plain, _, _ = await _run(tiny_model_path, requests)
    async with trio_mlx.open_engine(tiny_model_path) as engine:
        prompts = [engine.encode(p) for p in PROMPTS]
    known = list(zip(prompts, plain, strict=True))

    def oracle(self: PromptLookup, history: list[int], limit: int) -> list[int]:
        # The tokens after the pending one (``history`` is what comes before it).
        for row, (prompt, out) in enumerate(known):
            if history[: len(prompt)] == prompt and len(history) >= len(prompt):
                truth = list(out[len(history) - len(prompt) + 1 :][:limit])
                at = (row + 1) % 4 if wrong_at == "mixed" else int(wrong_at)
                return [t if i < at else (t + 1) % 512 for i, t in enumerate(truth)]
        raise AssertionError("a row the test does not know")

    monkeypatch.setattr(PromptLookup, "following", oracle)
    for batch in (requests[:1], requests):
        spec, stats, _ = await _run(tiny_model_path, batch, prompt_lookup=True)
        assert spec == plain[: len(batch)]
        drafted, taken = (
            stats.draft_tokens["prompt_lookup"],
            stats.draft_accepted_tokens["prompt_lookup"],
        )
        assert drafted > 0
        if wrong_at == 0:
            assert taken == 0
        else:
            assert 0 < taken < drafted


async def test_constrained_penalised_and_logprob_rows_share_a_speculating_batch(
    loopy_model_path: Path,
) -> None:
    requests = [
        (PROMPTS[0], trio_mlx.SamplingParams(max_tokens=30, regex="[a-z ]{5,40}")),
        (PROMPTS[1], _greedy(30, repetition_penalty=1.3)),
        (PROMPTS[2], _greedy(30, logprobs=True)),
        (PROMPTS[5], _greedy(30)),
        (PROMPTS[6], _greedy(30)),
    ]
    plain, _, _ = await _run(loopy_model_path, requests)
    spec, stats, _ = await _run(loopy_model_path, requests, prompt_lookup=True)
    assert spec == plain
    assert stats.draft_tokens["prompt_lookup"] > 0
    # A sampled row speculates in the batch too (its tokens are random: only counted).
    sampled = [(PROMPTS[0], _greedy(30, temperature=0.7, top_k=50)), *requests[3:]]
    spec, stats, _ = await _run(loopy_model_path, sampled, prompt_lookup=True)
    assert [len(tokens) for tokens in spec] == [30, 30, 30]


async def test_above_the_speculation_batch_bound_no_row_drafts(tiny_model_path: Path) -> None:
    requests = [(p, _greedy(20)) for p in PROMPTS[:4]]
    plain, _, _ = await _run(tiny_model_path, requests, burst_steps=1)
    spec, stats, _ = await _run(
        tiny_model_path, requests, prompt_lookup=True, speculation_max_batch=1, burst_steps=1
    )
    assert spec == plain
    # Only once the batch is down to one row may it speculate.
    assert stats.draft_tokens.get("prompt_lookup", 0) < sum(map(len, plain))


@pytest.mark.parametrize(
    ("family", "kind"), [("qwen3_next", "ArraysCache"), ("gemma3_text", "RotatingKVCache")]
)
async def test_a_model_whose_caches_cannot_roll_back_does_not_speculate_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, family: str, kind: str
) -> None:
    path = make_random_model(tmp_path / family, family)
    requests = [(p, _greedy(20)) for p in PROMPTS[:3]]
    plain, _, _ = await _run(path, requests)
    with caplog.at_level(logging.INFO, logger="trio_mlx"):
        spec, stats, on = await _run(path, requests, prompt_lookup=True)
    assert not on
    assert spec == plain
    assert stats.draft_tokens == {}
    lines = [
        r.getMessage() for r in caplog.records if "speculative decoding is off" in r.getMessage()
    ]
    assert len(lines) == 1
    assert kind in lines[0]


async def test_a_draft_model_with_another_vocabulary_is_refused_at_load(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    other = make_random_llama(tmp_path / "small-vocab", vocab_size=256)
    with pytest.raises(trio_mlx.InvalidRequest, match="vocab_size") as info:
        async with trio_mlx.open_engine(tiny_model_path, draft_model=other):
            pass  # pragma: no cover - refused above
    assert info.value.param == "draft_model"
    assert info.value.code == "draft_vocabulary_mismatch"
    # One whose caches cannot be cut back cannot draft.
    hybrid = make_random_model(tmp_path / "hybrid-draft", "qwen3_next")
    with pytest.raises(trio_mlx.InvalidRequest) as cannot:
        async with trio_mlx.open_engine(hybrid, draft_model=hybrid):
            pass  # pragma: no cover - refused above
    assert cannot.value.code == "draft_model_unsupported"
    with pytest.raises(trio_mlx.NotFound):
        trio_mlx.EngineSettings(draft_model=tmp_path / "nowhere")
    with pytest.raises(trio_mlx.InvalidRequest, match="choose one"):
        trio_mlx.EngineSettings(draft_model=tiny_model_path, prompt_lookup=True)


@pytest.mark.parametrize("draft", ["itself", "weak"])
async def test_a_draft_model_leaves_greedy_outputs_unchanged(
    tiny_model_path: Path, tmp_path: Path, draft: str
) -> None:
    """The target as its own draft (nearly every draft accepted) and a weak one (another
    random model with the same tokenizer: most rejected), in a batch mixing rows that
    speculate, rows that opted out and a penalised row, and a row alone."""
    path = tiny_model_path
    if draft == "weak":
        path = make_random_llama(tmp_path / "weak", seed=7, num_hidden_layers=1)
    requests = [(p, _greedy(24, speculate=i != 1)) for i, p in enumerate(PROMPTS[:4])]
    requests.append((PROMPTS[4], _greedy(24, repetition_penalty=1.2)))
    for batch in (requests[:1], requests):
        plain, _, _ = await _run(tiny_model_path, batch)
        spec, stats, on = await _run(tiny_model_path, batch, draft_model=path)
        assert on
        assert spec == plain
        drafted = stats.draft_tokens["draft_model"]
        taken = stats.draft_accepted_tokens["draft_model"]
        assert drafted > 0
        if draft == "itself":
            assert taken > 0.9 * drafted
        else:
            assert taken < 0.5 * drafted


#: Pydoc-like requests for the bundled model: chat questions its answers come from the
#: documentation for, and raw documentation openings it continues.
DOC_PROMPTS: list[Any] = [
    [{"role": "user", "content": "What is the with statement?"}],
    "The with statement",
    [{"role": "user", "content": "Explain lambdas."}],
    'The "if" statement is used for conditional execution:',
]


async def test_the_bundled_draft_drafts_for_the_bundled_model_without_changing_its_output() -> None:
    """``pydoc-llama-draft``, by name: its tokenizer is the bundled model's (accepted at
    load), greedy outputs equal plain decoding, alone and four at once, and its drafts
    are accepted on documentation text (the statistics report how many)."""
    from trio_mlx.default_model import default_draft_path

    assert trio_mlx.EngineSettings(draft_model="pydoc-llama-draft").draft_model == str(
        default_draft_path()
    )
    for batch in ([(DOC_PROMPTS[0], _greedy(40))], [(p, _greedy(40)) for p in DOC_PROMPTS]):
        plain, _, _ = await _run(None, batch)  # None: the bundled model
        spec, stats, on = await _run(None, batch, draft_model="pydoc-llama-draft")
        assert on
        assert spec == plain
        drafted = stats.draft_tokens["draft_model"]
        taken = stats.draft_accepted_tokens["draft_model"]
        assert 0 < taken <= drafted


def test_the_rejection_rule_keeps_the_target_distribution() -> None:
    """Draft token 1 against p = (0.1, 0.3, 0.6): accepted with probability 0.3, and
    the emitted token follows p (rejections draw from p without 1). Fixed seed."""
    import math

    import mlx.core as mx

    from trio_mlx._lanes.speculative import accepted, target_filter

    p = [0.1, 0.3, 0.6]
    logits = mx.log(mx.array([[p, p]]))  # one row, its pending token and one draft
    how = target_filter(trio_mlx.SamplingParams(temperature=1.0))
    assert how is not None
    mx.random.seed(1234)
    trials = 3000
    emitted: Counter[int] = Counter()
    taken = 0
    for _ in range(trials):
        counts, nexts = accepted(logits, [[1]], [how])
        taken += counts[0]
        emitted[1 if counts[0] else nexts[0] or 0] += 1
    # Bounds of about 4.5 standard deviations for 3,000 draws.
    assert abs(taken / trials - 0.3) < 4.5 * math.sqrt(0.3 * 0.7 / trials)
    for token, q in enumerate(p):
        assert abs(emitted[token] / trials - q) < 4.5 * math.sqrt(q * (1 - q) / trials)


def test_a_greedy_row_accepts_its_longest_matching_prefix() -> None:
    import mlx.core as mx

    from trio_mlx._lanes.speculative import accepted

    # Argmax per position: 3, 1, 2, 0.
    logits = mx.eye(4)[mx.array([[3, 1, 2, 0], [3, 1, 2, 0]])]
    counts, nexts = accepted(logits, [[3, 1, 0], [2]], [None, None])
    assert counts == [2, 0]
    assert nexts == [2, 3]


def test_the_speculation_flags_reach_the_engine() -> None:
    from trio_mlx.default_model import default_draft_path
    from trio_mlx_http._cli import build_parser
    from trio_mlx_http._server.run import _engine_settings

    args = ["serve", "--prompt-lookup", "--num-draft-tokens", "6", "--speculation-max-batch", "2"]
    settings = _engine_settings(build_parser().parse_args(args))
    assert settings.prompt_lookup is True
    assert (settings.num_draft_tokens, settings.speculation_max_batch) == (6, 2)
    plain = _engine_settings(build_parser().parse_args(["serve"]))
    assert (plain.prompt_lookup, plain.draft_model) == (False, None)
    bundled = _engine_settings(
        build_parser().parse_args(["serve", "--draft-model", "pydoc-llama-draft"])
    )
    assert bundled.draft_model == str(default_draft_path())
    with pytest.raises(trio_mlx.InvalidRequest):
        trio_mlx.EngineSettings(num_draft_tokens=0)


async def test_metrics_count_draft_and_accepted_tokens(endless_model_path: Path) -> None:
    import httpx
    import openai

    from http_helpers import live_server

    async with (
        live_server(endless_model_path, prompt_lookup=True, speculation_governor=False) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        await client.chat.completions.create(
            model=server.engine.model_id,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=30,
            temperature=0,
        )
        stats = server.engine.statistics()
        metrics = (await http.get("/metrics")).text
    drafted = stats.draft_tokens["prompt_lookup"]
    taken = stats.draft_accepted_tokens["prompt_lookup"]
    assert 0 < taken <= drafted
    assert f'trio_mlx_draft_tokens_total{{method="prompt_lookup"}} {float(drafted)}' in metrics
    assert (
        f'trio_mlx_draft_accepted_tokens_total{{method="prompt_lookup"}} {float(taken)}' in metrics
    )


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    from trio_mlx._lanes.drafter import PromptLookup

    cases = [
        ([1, 2, 3, 4, 5, 1, 2], 3, 4, [4, 5, 1, 2]),  # the prompt's run
        ([7, 7, 7], 7, 4, [7, 7, 7, 7]),  # a loop goes on from the draft itself
        ([1, 2, 1, 2, 1], 2, 5, [1, 2, 1, 2, 1]),
        ([5, 6, 9, 1, 5, 6], 9, 2, [1, 5]),  # the longest n-gram first
        ([1, 2, 3], 9, 3, []),  # no match: no draft
    ]
    for history, last, limit, want in cases:
        lookup = PromptLookup()
        lookup.feed(history)
        assert lookup.draft(last, limit) == want, history
    lookup = PromptLookup()
    lookup.feed([1, 2, 3])
    lookup.feed([1, 2, 3, 1, 2])  # fed incrementally
    assert lookup.draft(3, 2) == [1, 2]
    # Before the pending token is read: what followed its guess (3, after 1 2 before).
    history = [1, 2, 3, 4, 5, 1, 2]
    assert PromptLookup().following(history, 2) == [4, 5]
    assert PromptLookup().following([1, 2, 3], 2) == []
    growing = PromptLookup()  # a loop: guess 9, then 7 8 9
    assert growing.following([7, 8, 9, 7, 8], 3) == [7, 8, 9]
    assert growing.following([7, 8, 9, 7, 8, 9], 3) == [8, 9, 7]  # the index follows the row


@pytest.mark.parametrize("method", ["prompt_lookup", "draft_model"])
async def test_speculating_rows_parked_and_resumed_continue_token_for_token(
    loopy_model_path: Path, method: str
) -> None:
    """Parked rows leave the draft cache and come back to it (the model as its own draft)."""
    params = _greedy(60)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    plain, _, _ = await _run(loopy_model_path, [(p, params) for p in prompts])
    drafting: dict[str, Any] = (
        {"prompt_lookup": True} if method == "prompt_lookup" else {"draft_model": loopy_model_path}
    )
    async with trio_mlx.open_engine(
        loopy_model_path,
        drain_timeout=0.0,
        min_batch_steps=0,
        speculation_governor=False,
        **drafting,
    ) as engine:
        with trio.fail_after(120):
            parked = await generate_across_a_park(engine, prompts, params, after=20)
        stats = engine.statistics()
    assert stats.preemptions >= 1
    assert stats.draft_accepted_tokens[method] > 0
    assert parked == plain


async def test_adapter_rows_speculate_in_the_same_forward(
    loopy_model_path: Path, tiny_adapter_path: Path
) -> None:
    # The tiny model's adapter fits the loopy model (same shapes).
    requests = [
        (p, _greedy(30, adapter="shout" if i % 2 else None)) for i, p in enumerate(PROMPTS[:4])
    ]
    outs: dict[bool, list[tuple[int, ...]]] = {}
    for lookup in (False, True):
        async with trio_mlx.open_engine(
            loopy_model_path, prompt_lookup=lookup, speculation_governor=False
        ) as engine:
            await engine.mount_adapter("shout", tiny_adapter_path)
            got: list[tuple[int, ...]] = [()] * len(requests)

            async def one(
                i: int, prompt: str, params: trio_mlx.SamplingParams, got: list[Any] = got
            ) -> None:
                got[i] = (await engine.complete(prompt, params)).token_ids

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i, (prompt, params) in enumerate(requests):
                        nursery.start_soon(one, i, prompt, params)
            outs[lookup] = got
            stats = engine.statistics()
            assert stats.adapter_requests.get("batch:shout") == 2
            if lookup:
                assert stats.draft_accepted_tokens["prompt_lookup"] > 0
    assert outs[True] == outs[False]
    assert outs[True][1] != outs[True][0]


def _govern(
    speculator: Any,
    uids: list[int],
    n: int,
    spec_rate: float,
    plain_rate: float,
    spec_tokens: int = 1,
) -> list[bool]:
    """``n`` governed steps of ``uids``, each observed at its kind's rate a row (a
    speculative step emits ``spec_tokens`` a row, a plain one 1); whether each tried."""
    runs = []
    for _ in range(n):
        tried = speculator.wanted(uids)
        per_row = spec_tokens if tried else 1
        rate = spec_rate if tried else plain_rate
        speculator.observe(len(uids), tried, len(uids) * per_row, per_row / rate)
        runs.append(tried)
    return runs


def test_the_governor_keeps_steps_plain_where_speculating_measured_slower() -> None:
    from trio_mlx._lanes.speculative import PROBE_EVERY, PROBE_STEPS, Speculation, Speculator

    speculator = Speculator(Speculation())
    speculator.join(7, _greedy())

    def steps(n: int, spec_rate: float, plain_rate: float) -> list[bool]:
        return _govern(speculator, [7], n, spec_rate, plain_rate)

    # Nothing measured: speculation first, then a plain probe to compare.
    first = steps(2 + PROBE_STEPS, 490.0, 500.0)
    assert first == [True, True] + [False] * PROBE_STEPS
    # Speculating measured slower: plain steps, but for a probe every PROBE_EVERY.
    runs = steps(3 * PROBE_EVERY, 490.0, 500.0)
    assert 2 * PROBE_STEPS <= runs.count(True) <= 3 * PROBE_STEPS
    assert speculator.held_back >= 2 * PROBE_EVERY
    # Speculation got faster (the text began to repeat): the probes see it, and it
    # speculates again but for the plain probes.
    runs = steps(6 * PROBE_EVERY, 1_500.0, 500.0)
    later = runs[3 * PROBE_EVERY :]
    assert 3 * PROBE_EVERY - 3 * PROBE_STEPS <= later.count(True) < 3 * PROBE_EVERY
    # A step after a change of kind, and an idle lane's interval, are not rates; 2 and
    # 3 rows are one class, its rates per row.
    before = dict(speculator.rates)
    speculator.observe(2, True, 2, 0.01)
    speculator.observe(3, True, 3, 5.0)
    assert speculator.rates == before
    speculator.observe(3, True, 6, 0.01)
    assert speculator.rates[(2, True)] == 200.0


def _probe_starts(runs: list[bool]) -> list[int]:
    """The steps at which a speculative run began after plain steps."""
    return [i for i in range(1, len(runs)) if runs[i] and not runs[i - 1]]


def test_the_governor_probes_less_often_while_its_probes_change_nothing() -> None:
    from trio_mlx._lanes.speculative import PROBE_EVERY, PROBE_MAX, Speculation, Speculator

    speculator = Speculator(Speculation())
    speculator.join(7, _greedy())

    # Speculating stays a little slower: the speculative probes drift apart, to PROBE_MAX.
    runs = _govern(speculator, [7], 8 * PROBE_MAX, 490.0, 500.0)
    gaps = [b - a for a, b in itertools.pairwise(_probe_starts(runs))]
    assert gaps == sorted(gaps)
    assert gaps[0] < 2 * PROBE_EVERY
    assert PROBE_MAX <= gaps[-1] < PROBE_MAX + 2 * PROBE_EVERY
    # Speculation became faster: a probe within PROBE_MAX steps sees it, and from then
    # on the steps speculate but for a plain probe now and then.
    runs = _govern(speculator, [7], 4 * PROBE_MAX, 3_000.0, 500.0)
    assert runs[PROBE_MAX + PROBE_EVERY :].count(False) < PROBE_EVERY


def test_the_governor_probes_seldom_where_a_probe_is_dear() -> None:
    from trio_mlx._lanes.speculative import PROBE_SHARE, PROBE_STEPS, Speculation, Speculator

    speculator = Speculator(Speculation(max_batch=64))
    for uid in range(64):
        speculator.join(uid, _greedy())
    # 64 rows: a speculative step takes 6 plain steps' time for 4 tokens a row (40 a
    # second and row against 60), so a probe of 4 such steps loses 8 plain steps.
    runs = _govern(speculator, list(range(64)), 3_000, 40.0, 60.0, spec_tokens=4)
    began = _probe_starts(runs)
    dear = PROBE_STEPS * 6 * (1 - 40 / 60) / PROBE_SHARE
    assert began
    assert all(b - a >= dear for a, b in itertools.pairwise(began))
    assert len(began) <= 3_000 / dear + 1


async def test_greedy_outputs_with_the_governor_on_equal_plain_decoding(
    loopy_model_path: Path,
) -> None:
    requests = [(p, _greedy(48)) for p in PROMPTS[:4]]
    plain, _, _ = await _run(loopy_model_path, requests)
    spec, _, on = await _run(
        loopy_model_path, requests, prompt_lookup=True, speculation_governor=True
    )
    assert on
    assert spec == plain


def test_a_size_class_the_batch_passes_through_is_probed_by_its_own_steps() -> None:
    from trio_mlx._lanes.speculative import PROBE_EVERY, PROBE_STEPS, Speculation, Speculator

    speculator = Speculator(Speculation(max_batch=64))
    for uid in range(16):
        speculator.join(uid, _greedy())

    def steps(rows: int, n: int) -> list[bool]:
        return _govern(speculator, list(range(rows)), n, 490.0, 500.0)

    # Both kinds measured at 8 rows, then at 16, where the batch then stays a while.
    assert steps(8, 2 + PROBE_STEPS) == [True, True] + [False] * PROBE_STEPS
    assert steps(16, 2 + PROBE_STEPS) == [True, True] + [False] * PROBE_STEPS
    assert not any(steps(16, PROBE_EVERY - PROBE_STEPS))
    # Back at 8 rows for a few steps: 8 rows' own steps since its probe are few.
    assert not any(steps(8, 2 * PROBE_STEPS))


@pytest.mark.parametrize(("spec_rate", "speculates"), [(515.0, False), (600.0, True)])
def test_the_governor_speculates_where_it_measured_clearly_faster(
    spec_rate: float, speculates: bool
) -> None:
    from trio_mlx._lanes.speculative import MARGIN, PROBE_EVERY, Speculation, Speculator

    assert 515.0 < MARGIN * 500.0 < 600.0
    speculator = Speculator(Speculation())
    speculator.join(7, _greedy())
    runs = _govern(speculator, [7], 4 * PROBE_EVERY, spec_rate, 500.0)
    assert (runs[PROBE_EVERY:].count(True) > 2 * PROBE_EVERY) == speculates


def test_the_governor_does_not_count_steps_that_carry_prefill() -> None:
    from trio_mlx._lanes.speculative import PROBE_STEPS, Speculation, Speculator

    speculator = Speculator(Speculation())
    speculator.join(7, _greedy())
    # Both kinds measured: speculating is slower (490 against 500 tokens a second).
    assert _govern(speculator, [7], 2 + PROBE_STEPS, 490.0, 500.0)[:2] == [True, True]
    before = dict(speculator.rates)
    # Plain steps that prefilled a prompt took ten times as long: not a decode rate.
    for _ in range(3):
        speculator.observe(1, False, 1, 10 / 500.0, settled=False)
    assert speculator.rates == before
    # A settled step after unsettled ones of its kind counts (the kind did not change).
    speculator.observe(1, False, 1, 1 / 400.0)
    assert speculator.rates[(1, False)] < before[(1, False)]


async def test_the_lane_marks_a_step_that_prefills_and_the_next_ones_unsettled(
    loopy_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_mlx._lanes.batch import BatchLane
    from trio_mlx._lanes.speculative import UNSETTLED_STEPS, Speculator

    settled: list[bool] = []
    prefilled: list[tuple[int, bool]] = []  # (observations before the step, it prefilled)
    observe, decode = Speculator.observe, BatchLane._decode

    def spy_observe(self: Speculator, *args: Any) -> None:
        settled.append(args[4] if len(args) > 4 else True)
        observe(self, *args)

    def spy_decode(self: BatchLane, *args: Any) -> bool:
        seen = len(settled)
        news = decode(self, *args)
        prefilled.append((seen, bool(self._timings and self._timings[-1][0])))
        return news

    monkeypatch.setattr(Speculator, "observe", spy_observe)
    monkeypatch.setattr(BatchLane, "_decode", spy_decode)
    async with trio_mlx.open_engine(
        loopy_model_path, max_batch=8, prompt_lookup=True, speculation_governor=True
    ) as engine:
        long = " ".join(PROMPTS) * 3

        async def late(delay: int) -> None:
            await trio.sleep(0.05 * delay)
            await engine.complete(long, _greedy(16))

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for prompt in PROMPTS[:3]:
                    nursery.start_soon(engine.complete, prompt, _greedy(96))
                for delay in (1, 3):
                    nursery.start_soon(late, delay)
    # A step that prefilled, and the steps that decode after it until UNSETTLED_STEPS
    # have decoded (the first may pay for a queued prefill), are not rates; every other
    # observed step is. (A step where no row decodes yet observes nothing.)
    assert any(did for _seen, did in prefilled)
    left, checked = 0, 0
    for step, (seen, did) in enumerate(prefilled):
        left = UNSETTLED_STEPS if did else left
        after = prefilled[step + 1][0] if step + 1 < len(prefilled) else len(settled)
        assert after - seen <= 1  # each step observed at most once
        if after == seen + 1:
            assert settled[seen] == (left <= 0), step
            left, checked = left - 1, checked + 1
    assert checked > UNSETTLED_STEPS * 2
    assert settled.count(True) > UNSETTLED_STEPS


def test_a_row_whose_drafts_keep_missing_pauses_twice_as_long_each_time() -> None:
    from trio_mlx._lanes.speculative import MAX_PAUSE, Speculation, Speculator

    speculator = Speculator(Speculation())
    speculator.join(7, _greedy())
    pauses = []
    for _ in range(9):
        speculator.record([7], [[1, 2]], [0])
        pauses.append(speculator.rows[7].pause)
        speculator.rows[7].pause = 0
    assert pauses == [min(MAX_PAUSE, 1 << i) for i in range(9)]
    assert pauses[-1] == MAX_PAUSE == 64
    # One accepted draft ends the run of misses: the next miss pauses one step.
    speculator.record([7], [[1, 2]], [1])
    speculator.record([7], [[1, 2]], [0])
    assert speculator.rows[7].pause == 1


async def test_a_batch_with_no_speculating_row_skips_the_governor(
    loopy_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_mlx._lanes.speculative import Speculator

    calls: Counter[str] = Counter()
    observe, wanted = Speculator.observe, Speculator.wanted

    def spy_observe(self: Speculator, *args: Any, **kwargs: Any) -> None:
        calls["observe"] += 1
        observe(self, *args, **kwargs)

    def spy_wanted(self: Speculator, *args: Any) -> bool:
        calls["wanted"] += 1
        return wanted(self, *args)

    monkeypatch.setattr(Speculator, "observe", spy_observe)
    monkeypatch.setattr(Speculator, "wanted", spy_wanted)
    async with trio_mlx.open_engine(
        loopy_model_path, max_batch=8, prompt_lookup=True, speculation_governor=True
    ) as engine:
        calls.clear()  # the load's warm-up rows
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for prompt in PROMPTS[:3]:
                    nursery.start_soon(engine.complete, prompt, _greedy(24, speculate=False))
        assert calls == Counter(), calls
        # A speculating row brings the governor back for the steps it shares.
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for prompt in PROMPTS[:3]:
                    nursery.start_soon(engine.complete, prompt, _greedy(24, speculate=False))
                nursery.start_soon(engine.complete, PROMPTS[0], _greedy(24))
        assert calls["wanted"] >= 20
        assert calls["observe"] >= 10
