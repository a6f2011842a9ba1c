"""Seeded random bodies against every POST endpoint of a live server: never a 500.

A cheap stand-in for schema fuzzing: values of every JSON kind, in every field the
server reads, at every endpoint; each answer must be a success or a 4xx in OpenAI's
error shape, and the server must stay healthy.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from http_helpers import LiveServer, live_server
from trio_mlx_http._settings import Settings

pytestmark = pytest.mark.model

FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "stop", "seed", "n", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options",
    "adapter", "user", "tools", "tool_choice", "tokens", "name", "path",
]  # fmt: skip
PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/adapters"]
SCALARS: list[Any] = [
    None, True, False, 0, 1, 2, -1, 3, 10**20, 0.5, -0.5, 1e308, "", "x", "<|im_end|>",
    "\x00", "💥", [], {}, [1, 2], ["a"], [[1]], {"1": 1}, {"role": "user", "content": "hi"},
]  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.6:
        return rng.choice(SCALARS)
    if roll < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {
        rng.choice(["role", "content", "type", "text", "function", "name"]): _value(rng, depth + 1)
    }


#: Values the server accepts, so that random bodies also reach the engine.
VALID: dict[str, list[Any]] = {
    "max_tokens": [1, 3],
    "temperature": [0, 0.7],
    "top_p": [0.9, 1],
    "top_k": [0, 5],
    "min_p": [0.0, 0.1],
    "stop": ["x", ["a", "b"]],
    "seed": [0, 7],
    "n": [1, 2],
    "repetition_penalty": [1.1],
    "presence_penalty": [0.5],
    "frequency_penalty": [-0.5],
    "logit_bias": [{"5": 1}],
    "logprobs": [True, 2],
    "top_logprobs": [1],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}],
    "user": ["u"],
    "tool_choice": ["none"],
    "tokens": [[1, 2, 3]],
}


def _field(rng: random.Random, name: str) -> Any:
    if name in VALID and rng.random() < 0.7:
        return rng.choice(VALID[name])
    return _value(rng)


def _body(rng: random.Random) -> dict[str, Any]:
    chosen = rng.sample(FIELDS, rng.randrange(1, 6))
    body: dict[str, Any] = {name: _field(rng, name) for name in chosen}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": _value(rng)}]
    if rng.random() < 0.5:
        body["prompt"] = rng.choice(["Hello", [1, 2, 3], ["a", "b"], _value(rng)])
    # Keep generation short: the point is the parsing, not the decoding.
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)
    body.pop("max_completion_tokens", None)
    return body


@pytest.fixture
async def server(tiny_model_path: Path, tmp_path: Path) -> AsyncIterator[LiveServer]:
    (tmp_path / "adapters").mkdir()
    settings = Settings(max_tokens=4, max_choices=4, adapter_dir=tmp_path / "adapters")
    async with live_server(tiny_model_path, settings) as live:
        yield live


async def test_random_bodies_never_get_a_500(server: LiveServer) -> None:
    rng = random.Random(20261130)
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for _ in range(300):
            path = rng.choice(PATHS)
            response = await http.post(path, json=_body(rng))
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (path, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get("/health")).status_code == 200
    assert statuses.get(200, 0) > 20
    assert statuses.get(400, 0) > 50
