"""Several models behind one server: requests reach the model they name (loading it on
demand), /v1/models lists every model with its state, operators load and unload."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

import trio_mlx
from http_helpers import live_server
from trio_mlx import ModelState, SamplingParams
from trio_mlx.testing import make_random_llama
from trio_mlx_http._cli import build_parser
from trio_mlx_http._server.run import hosted
from trio_mlx_http._settings import Settings
from trio_mlx_http.testing import LiveServer

MAX_TOKENS = 10
PROMPT = "Tell me about foxes"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("served") / "models"
    for seed, name in enumerate(("alpha", "beta"), start=1):
        make_random_llama(root / name, seed=seed)
    return root


@pytest.fixture(scope="module")
def alone(models: Path) -> dict[str, str]:
    """Each model's greedy chat answer, served alone by an engine."""

    async def answer(name: str) -> str:
        async with trio_mlx.open_engine(models / name) as engine:
            chat = [{"role": "user", "content": PROMPT}]
            return (await engine.complete(chat, SamplingParams(max_tokens=MAX_TOKENS))).text

    return {name: trio.run(answer, name) for name in ("alpha", "beta")}


@pytest.fixture
async def server(models: Path) -> AsyncIterator[LiveServer]:
    async with live_server(
        None, Settings(api_key="sesame"), hosted={"model_dir": models, "load_timeout": 60.0}
    ) as live:
        yield live


def _client(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="sesame", max_retries=0)


def _states(live: LiveServer) -> dict[str, ModelState]:
    assert live.host is not None
    return {info.name: info.state for info in live.host.models()}


async def test_each_request_reaches_the_model_it_names(
    server: LiveServer, alone: dict[str, str]
) -> None:
    assert _states(server) == {"alpha": ModelState.LOADED, "beta": ModelState.UNLOADED}
    async with _client(server) as client:
        for name in ("beta", "alpha"):
            reply = await client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            assert reply.model == name
            assert reply.choices[0].message.content == alone[name]
            stream = await client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == alone[name]
    assert _states(server) == {"alpha": ModelState.LOADED, "beta": ModelState.LOADED}


async def test_anthropic_messages_reach_the_named_model(
    server: LiveServer, alone: dict[str, str]
) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=server.url, api_key="sesame", max_retries=0
    ) as client:
        message = await client.messages.create(
            model="beta",
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
        )
    assert message.model == "beta"
    assert message.content[0].text == alone["beta"]  # type: ignore[union-attr]


async def test_models_lists_every_model_with_its_state(server: LiveServer) -> None:
    async with _client(server) as client:
        listed = {m.id: m.model_dump() for m in (await client.models.list()).data}
    assert listed["alpha"]["state"] == "loaded"
    assert listed["alpha"]["context_length"] == 2048
    assert listed["beta"]["state"] == "unloaded"
    assert "context_length" not in listed["beta"]


async def test_an_unknown_model_is_a_404_in_each_endpoints_shape(server: LiveServer) -> None:
    headers = {"Authorization": "Bearer sesame"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
        chat = await http.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        )
        messages = await http.post(
            "/v1/messages",
            json={
                "model": "nope",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
    assert chat.status_code == 404
    assert chat.json()["error"]["code"] == "model_not_found"
    assert messages.status_code == 404
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "not_found_error"


async def test_operators_load_and_unload_behind_the_api_key(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        refused = await http.post("/v1/models/beta/load")
        assert refused.status_code == 401
        # Without the key a generation never loads a model either.
        sneaky = await http.post(
            "/v1/chat/completions",
            json={"model": "beta", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert sneaky.status_code == 401
        assert _states(server)["beta"] is ModelState.UNLOADED
        http.headers["Authorization"] = "Bearer sesame"
        loaded = await http.post("/v1/models/beta/load")
        assert (loaded.json()["id"], loaded.json()["state"]) == ("beta", "loaded")
        unloaded = await http.post("/v1/models/alpha/unload")
        assert unloaded.json()["state"] == "unloaded"
        assert _states(server) == {"alpha": ModelState.UNLOADED, "beta": ModelState.LOADED}
        missing = await http.post("/v1/models/nope/load")
        assert missing.status_code == 404


async def test_a_model_not_ready_in_time_is_a_503_with_retry_after(models: Path) -> None:
    hosted_options: dict[str, Any] = {"model_dir": models, "max_models": 1, "load_timeout": 0.3}
    settings = Settings(cors_origin="https://app.example")
    async with live_server(None, settings, hosted=hosted_options) as live:
        assert live.host is not None
        async with live.host.use("alpha"), httpx.AsyncClient(base_url=live.url) as http:
            # alpha is held: beta cannot take its place before the timeout.
            answer = await http.post(
                "/v1/chat/completions",
                json={"model": "beta", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "model_unavailable"
        assert int(answer.headers["Retry-After"]) >= 1
        assert answer.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert _states(live)["alpha"] is ModelState.LOADED


async def test_metrics_and_health_show_each_models_state(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics", headers={"Authorization": "Bearer sesame"})).text
    assert health["models"] == {"alpha": "loaded", "beta": "unloaded"}
    assert 'trio_mlx_model_state{model="beta",state="unloaded"} 1.0' in metrics
    assert 'trio_mlx_model_loads_total{model="alpha"} 1.0' in metrics
    assert "trio_mlx_host_active_memory_bytes" in metrics


async def test_a_single_model_server_refuses_to_load_models(tiny_model_path: Path) -> None:
    async with live_server(tiny_model_path) as live, httpx.AsyncClient(base_url=live.url) as http:
        answer = await http.post("/v1/models/other/load")
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "single_model"


async def test_a_large_body_is_routed_by_its_model(server: LiveServer, models: Path) -> None:
    long_text = "fox " * 20_000  # about 80 kB: parsed off the event loop
    async with httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": "Bearer sesame"}, timeout=60
    ) as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "beta", "messages": [{"role": "user", "content": long_text}]},
        )
    # beta answered (its context is too short for the prompt): it was loaded for it.
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert _states(server)["beta"] is ModelState.LOADED


def test_the_flags_that_serve_several_models(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert not hosted(parse(["serve"]))
    assert not hosted(parse(["serve", "--model", "a"]))
    args = parse(["serve", "--model", "a", "--model", "b"])
    assert (args.model, args.models, hosted(args)) == ("a", ["a", "b"], True)
    assert hosted(parse(["serve", "--model-dir", str(tmp_path)]))
    assert hosted(parse(["serve", "--idle-unload", "60"]))
    assert parse(["serve", "--max-model-memory", "2G"]).max_model_memory == 2 * 1024**3


async def test_a_hosted_server_keeps_the_default_models_aliases(
    models: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "gamma"
    shutil.copytree(models / "alpha", folder)
    settings = Settings(served_model_names=("claude-*",))
    hosted_options = {"models": [folder, models / "beta"]}
    async with (
        live_server(None, settings, hosted=hosted_options) as live,
        _client(live) as client,
    ):
        reply = await client.chat.completions.create(
            model="claude-haiku-4-5",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
        )
    assert reply.choices[0].message.content is not None
    assert _states(live)["beta"] is ModelState.UNLOADED


async def test_an_oversized_body_is_a_413_and_loads_nothing(models: Path) -> None:
    settings = Settings(max_body_bytes=4096)
    async with (
        live_server(None, settings, hosted={"model_dir": models}) as live,
        httpx.AsyncClient(base_url=live.url) as http,
    ):
        assert live.host is not None
        await live.host.unload("alpha")  # the default: an oversized body loads it neither
        body = {"model": "beta", "messages": [{"role": "user", "content": "x" * 8000}]}
        declared = await http.post("/v1/chat/completions", json=body)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read until past the cap
            yield b'{"model": "beta", "messages": [{"role": "user", "content": "'
            for _ in range(8):
                yield b"x" * 1000
            yield b'"}]}'

        streamed = await http.post(
            "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert _states(live) == {"alpha": ModelState.UNLOADED, "beta": ModelState.UNLOADED}
    assert declared.status_code == 413
    assert streamed.status_code == 413
