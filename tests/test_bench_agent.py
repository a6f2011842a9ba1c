"""The agent benchmark's session and replay, at a tiny size against a real server."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
from bench.suite.agent import replay, summarize
from bench.suite.agent_trace import AgentSize, build_session

from http_helpers import live_server

pytestmark = pytest.mark.model

SIZE = AgentSize(system_tokens=200, turns=3, tool_tokens=(60, 120), max_tokens=4)
NO_EOS = {"0": -100.0, "2": -100.0}


def _tokenizer(path: Path) -> object:
    from mlx_lm.tokenizer_utils import load

    return load(path)


def test_session_is_deterministic_and_each_turn_extends_the_last(tiny_model_path: Path) -> None:
    tokenizer = _tokenizer(tiny_model_path)
    session = build_session(tokenizer, SIZE)
    assert session == build_session(tokenizer, SIZE)
    assert session.turns == SIZE.turns
    for turn in range(1, session.turns):
        now, later = session.messages(turn), session.messages(turn + 1)
        assert later[: len(now)] == now
        assert later[-1]["role"] == "tool"
        assert later[-1]["content"] == session.tool_results[turn]


async def test_replay_records_every_turn_with_a_growing_prompt(tiny_model_path: Path) -> None:
    session = build_session(_tokenizer(tiny_model_path), SIZE)
    async with live_server(tiny_model_path) as server:
        run = partial(replay, server.url, session, model=None, max_tokens=4, logit_bias=NO_EOS)
        turns = await trio.to_thread.run_sync(run)
    assert [t["turn"] for t in turns] == [1, 2, 3]
    for t in turns:
        assert t["ttft_s"] is not None
        assert 0 < t["ttft_s"] <= t["latency_s"]
        assert t["completion_tokens"] == SIZE.max_tokens
        if t["cached_tokens"] is not None:
            assert t["prefilled_tokens"] == t["prompt_tokens"] - t["cached_tokens"]
    prompts = [t["prompt_tokens"] for t in turns]
    assert prompts == sorted(set(prompts))
    assert turns[0]["previous_prompt_tokens"] is None
    assert [t["previous_prompt_tokens"] for t in turns[1:]] == prompts[:-1]
    summary = summarize(turns)
    assert summary["turns"] == 3
    assert summary["prompt_tokens_last"] == prompts[-1]
