"""Raw HTTP against a live server: framing, statuses and error shapes, byte for byte.

Every bad request must get its status and OpenAI's error shape, and leave the
server healthy.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import trio_mlx
from engine_helpers import make_adapter
from http_helpers import NO_EOS, LiveServer, live_server, sse_events
from trio_mlx_http._settings import Settings

pytestmark = pytest.mark.model

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def server(tiny_model_path: Path, tmp_path: Path) -> AsyncIterator[LiveServer]:
    adapters = tmp_path / "adapters"
    (adapters / "empty").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", adapters / "escape")
    settings = Settings(api_key=KEY, adapter_dir=adapters, max_body_bytes=64 * 1024)
    async with live_server(tiny_model_path, settings) as live:
        yield live


@pytest.fixture
async def http(server: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


def _expect_error(
    response: httpx.Response, status: int, param: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["param"] == param
    return error


async def _healthy(http: httpx.AsyncClient) -> None:
    response = await http.get("/health")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"
    assert response.json()["ranks"] == 1


async def test_stream_is_framed_as_openai_server_sent_events(http: httpx.AsyncClient) -> None:
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "logit_bias": NO_EOS}
    body["stream_options"] = {"include_usage": True}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    raw = response.content
    assert raw.startswith(b"data: {")
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_chat_stream_starts_with_the_role_and_ends_with_finish_reason(
    http: httpx.AsyncClient,
) -> None:
    body = {"messages": USER, "max_tokens": 3, "stream": True, "logit_bias": NO_EOS}
    events = sse_events((await http.post("/v1/chat/completions", json=body)).content)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize(
    "data", [b"{", b"not json", b"[1, 2]", b'"text"', b"\xff\xfe\x00", b"[" * 50_000]
)
async def test_malformed_json_is_400(http: httpx.AsyncClient, data: bytes) -> None:
    response = await http.post(
        "/v1/chat/completions", content=data, headers={"content-type": "application/json"}
    )
    assert _expect_error(response, 400)["code"] == "invalid_json"
    await _healthy(http)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": "ten"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "top_p": 2}, "top_p"),
        ("/v1/chat/completions", {"messages": USER, "stop": [1]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": 99}, "n"),
        ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {"1": 500}}, "logit_bias"),
        ("/v1/completions", {"prompt": 7}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
        ("/tokenize", {"prompt": ["x"]}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)
async def test_wrong_types_and_ranges_are_400_naming_the_field(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    _expect_error(await http.post(path, json=body), 400, param)
    await _healthy(http)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"prompt": ""}, None),
        ({"prompt": []}, None),
        ({"prompt": "Hello", "max_tokens": 0}, None),
        ({"prompt": "word " * 5000}, "context_length_exceeded"),
        ({"prompt": [5] * 3000}, "context_length_exceeded"),
    ],
)
async def test_edge_inputs_are_400_and_the_server_stays_healthy(
    http: httpx.AsyncClient, body: dict[str, Any], code: str | None
) -> None:
    error = _expect_error(await http.post("/v1/completions", json=body), 400, error_param(body))
    assert error["code"] == code
    await _healthy(http)
    ok = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def error_param(body: dict[str, Any]) -> str:
    return "max_tokens" if body.get("max_tokens") == 0 else "prompt"


async def test_huge_body_is_413_before_it_is_read(http: httpx.AsyncClient) -> None:
    huge = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    _expect_error(await http.post("/v1/completions", content=huge), 413)
    await _healthy(http)


async def test_huge_chunked_body_is_413(http: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(64):
            yield b" " * 4096

    _expect_error(await http.post("/v1/completions", content=chunks()), 413)
    await _healthy(http)


async def test_unknown_route_and_method(http: httpx.AsyncClient) -> None:
    _expect_error(await http.get("/v1/nothing"), 404)
    response = await http.delete("/v1/models")
    _expect_error(response, 405)
    assert "GET" in response.headers["allow"]


async def test_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    body = {"model": "gpt-4o", "messages": USER}
    assert _expect_error(await http.post("/v1/chat/completions", json=body), 404, "model")[
        "code"
    ] == ("model_not_found")
    _expect_error(await http.get("/v1/models/gpt-4o"), 404, "model")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}])
async def test_api_key_is_required_except_for_health(
    server: LiveServer, headers: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers=headers) as client:
        for path in ("/v1/models", "/metrics", "/openapi.json"):
            assert _expect_error(await client.get(path), 401)["type"] == "authentication_error"
        response = await client.post("/v1/completions", json={"prompt": "Hi"})
        _expect_error(response, 401)
        await _healthy(client)


@pytest.mark.parametrize(
    ("path", "status"),
    [("../outside", 400), ("escape", 403), ("/etc", 403), ("missing", 404)],
)
async def test_adapter_paths_outside_the_folder_are_refused(
    http: httpx.AsyncClient, tmp_path: Path, path: str, status: int
) -> None:
    response = await http.post("/v1/adapters", json={"name": "evil", "path": path})
    _expect_error(response, status, "path")
    assert (await http.get("/v1/adapters")).json() == {"object": "list", "data": []}
    await _healthy(http)


async def test_unmounting_an_unknown_adapter_is_404(http: httpx.AsyncClient) -> None:
    _expect_error(await http.delete("/v1/adapters/nothing"), 404, "adapter")


async def test_tokenize_and_detokenize_round_trip(
    server: LiveServer, http: httpx.AsyncClient
) -> None:
    tokens = (await http.post("/tokenize", json={"prompt": "Hello there"})).json()
    assert tokens["tokens"] == server.engine.encode("Hello there")
    assert tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == server.engine.context_length
    text = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
    assert text == {"prompt": "Hello there"}
    chat = (await http.post("/tokenize", json={"messages": USER})).json()
    assert chat["tokens"] == server.engine.encode(USER)


async def test_metrics_are_prometheus_text(http: httpx.AsyncClient) -> None:
    await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        'trio_mlx_http_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        "trio_mlx_running_rows 0.0",
        "trio_mlx_queued_rows",
        "trio_mlx_waiting_jobs",
        "trio_mlx_parked_rows",
        "trio_mlx_ranks 1.0",
        'trio_mlx_prompt_tokens_total{source="cached"}',
        "trio_mlx_prompt_cache_entries",
        'trio_mlx_prompt_cache_lookups_total{result="miss"}',
        "trio_mlx_prompt_cache_reused_tokens_total",
        'trio_mlx_prompt_cache_disk_operations_total{operation="write"} 0.0',
        "trio_mlx_time_to_first_token_seconds_bucket",
        "trio_mlx_request_duration_seconds_bucket",
        "trio_mlx_drains_total",
        "trio_mlx_preemptions_total",
        'trio_mlx_arbiter_state{state="admitting"} 1.0',
        'trio_mlx_http_generations_total{endpoint="/v1/completions",lane="batch",outcome="length"} 1.0',
    ):
        assert name in text, name
    # No stall bound on this server: none of its readings are exported.
    assert "trio_mlx_prompt_token_seconds" not in text
    assert "trio_mlx_decode_step_seconds" not in text
    memory = {
        name: float(re.findall(rf"^trio_mlx_{name} (\S+)$", text, re.MULTILINE)[0])
        for name in (
            "mlx_active_memory_bytes",
            "mlx_cache_memory_bytes",
            "mlx_peak_memory_bytes",
            "prompt_cache_bytes",
        )
    }
    # The model's weights are live arrays; the peak is at least what is active.
    assert memory["mlx_active_memory_bytes"] > 1_000_000
    assert memory["mlx_peak_memory_bytes"] >= memory["mlx_active_memory_bytes"]
    assert memory["mlx_cache_memory_bytes"] >= 0
    # The completion's prompt was stored in the prompt cache.
    assert memory["prompt_cache_bytes"] > 0


async def test_openapi_document_lists_every_route(http: httpx.AsyncClient) -> None:
    document = (await http.get("/openapi.json")).json()
    assert document["openapi"].startswith("3.")
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/models/{model_id}/load",
        "/v1/models/{model_id}/unload",
        "/v1/adapters",
        "/v1/adapters/{name}",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/openapi.json",
    }


async def test_adapter_mounts_serves_as_a_model_and_unmounts(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    make_adapter(tiny_model_path, adapters / "team" / "shout")
    settings = Settings(adapter_dir=adapters)
    async with (
        live_server(tiny_model_path, settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        mounted = await http.post("/v1/adapters", json={"name": "shout", "path": "team/shout"})
        assert mounted.status_code == 201, mounted.text
        assert mounted.json() == {"id": "shout", "object": "adapter", "path": "team/shout"}
        models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        assert models == [server.engine.model_id, "shout"]
        body = {"model": "shout", "prompt": "Hello", "max_tokens": 8, "logit_bias": NO_EOS}
        with_adapter = (await http.post("/v1/completions", json=body)).json()
        body["model"] = server.engine.model_id
        without = (await http.post("/v1/completions", json=body)).json()
        assert with_adapter["model"] == "shout"
        assert with_adapter["choices"][0]["text"] != without["choices"][0]["text"]
        assert (await http.delete("/v1/adapters/shout")).json()["deleted"] is True
        body["model"] = "shout"
        _expect_error(await http.post("/v1/completions", json=body), 404, "model")


async def test_mounting_past_max_loras_is_409_and_metrics_count_adapter_requests(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    make_adapter(tiny_model_path, adapters / "one")
    make_adapter(tiny_model_path, adapters / "two", seed=5)
    settings = Settings(adapter_dir=adapters)
    async with (
        live_server(tiny_model_path, settings, max_loras=1) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        mounted = await http.post("/v1/adapters", json={"name": "one", "path": "one"})
        assert mounted.status_code == 201, mounted.text
        refused = await http.post("/v1/adapters", json={"name": "two", "path": "two"})
        error = _expect_error(refused, 409, "name")
        assert error["code"] == "too_many_adapters"
        assert "max_loras=1" in error["message"]
        body = {"model": "one", "prompt": "Hello", "max_tokens": 4}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        metrics = (await http.get("/metrics")).text
    assert 'trio_mlx_adapter_requests_total{adapter="one",lane="batch"} 1.0' in metrics


async def _first_data_event(lines: AsyncIterator[str]) -> str:
    """Read an SSE stream's lines up to its first data event, and return that line."""
    async for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("the stream ended before its first data event")


async def test_metrics_gauge_adapter_rows_while_a_streaming_row_runs_and_after() -> None:
    # The bundled model and its bundled shout adapter (a plain LoRA: the batch lane).
    shout = trio_mlx.default_adapter_path("shout")
    settings = Settings(adapter_dir=shout.parent)
    series = 'trio_mlx_adapter_rows{adapter="shout",lane="batch"}'
    async with (
        live_server(trio_mlx.default_model_path(), settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        mounted = await http.post("/v1/adapters", json={"name": "shout", "path": "shout"})
        assert mounted.status_code == 201, mounted.text
        body = {"model": "shout", "prompt": "Hello", "max_tokens": 64, "stream": True,
                "logit_bias": NO_EOS}  # fmt: skip
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            await _first_data_event(lines)  # the row decodes under the adapter
            during = (await http.get("/metrics")).text
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        after = ""
        for _ in range(100):  # the engine ends the row as the stream closes
            after = (await http.get("/metrics")).text
            if series not in after:
                break
            await trio.sleep(0.05)
    assert f"{series} 1.0" in during
    assert series not in after
    assert 'trio_mlx_adapter_requests_total{adapter="shout",lane="batch"} 1.0' in after


async def test_unmounting_an_adapter_that_a_streaming_row_uses_is_409_and_changes_nothing(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    make_adapter(tiny_model_path, adapters / "one")
    settings = Settings(adapter_dir=adapters)
    # drain_timeout=0: the unmount job parks the row at once, so it is still the row's.
    async with (
        live_server(tiny_model_path, settings, drain_timeout=0) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        mounted = await http.post("/v1/adapters", json={"name": "one", "path": "one"})
        assert mounted.status_code == 201, mounted.text
        body = {"model": "one", "prompt": "Hello", "max_tokens": 2000, "stream": True,
                "logit_bias": NO_EOS}  # fmt: skip
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            await _first_data_event(lines)  # the row decodes under the adapter
            refused = await http.delete("/v1/adapters/one")
            error = _expect_error(refused, 409, "name")
            assert error["code"] == "adapter_in_use"
            listed = (await http.get("/v1/adapters")).json()["data"]
            assert [a["id"] for a in listed] == ["one"]
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2][6:])["choices"][0]["finish_reason"]
        assert finish == "length"  # parked for the refused job, resumed, ran to its end
        assert (await http.delete("/v1/adapters/one")).json()["deleted"] is True


async def test_cors_preflight_needs_no_key_and_responses_carry_the_origin(
    tiny_model_path: Path,
) -> None:
    settings = Settings(api_key=KEY, cors_origin="https://app.example")
    async with (
        live_server(tiny_model_path, settings) as server,
        httpx.AsyncClient(base_url=server.url) as http,
    ):
        headers = {
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        preflight = await http.options("/v1/chat/completions", headers=headers)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "Authorization" in preflight.headers["access-control-allow-headers"]
        denied = await http.get("/v1/models")
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "https://app.example"


def _gauge(text: str, name: str) -> float | None:
    found = re.findall(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found[0]) if found else None


async def test_metrics_show_the_prefill_stall_bounds_readings_once_measured(
    tiny_model_path: Path,
) -> None:
    names = ("trio_mlx_decode_step_seconds", "trio_mlx_prompt_token_seconds")
    async with (
        live_server(tiny_model_path, prefill_stall=1.5) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        before = (await http.get("/metrics")).text
        body = {"prompt": "Hello", "max_tokens": 400, "stream": True, "logit_bias": NO_EOS}
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            await _first_data_event(lines)
            readings: dict[str, float | None] = {}
            for _ in range(100):  # a prompt prefilled while the stream decodes: both timed
                prompt = {"prompt": "The quick brown fox " * 8, "max_tokens": 1}
                assert (await http.post("/v1/completions", json=prompt)).status_code == 200
                text = (await http.get("/metrics")).text
                readings = {name: _gauge(text, name) for name in names}
                if None not in readings.values():
                    break
    assert all(_gauge(before, name) is None for name in names), "nothing measured yet"
    decode, token = (readings[name] for name in names)
    assert decode is not None, readings
    assert decode > 0
    # Read, though maybe 0: on the tiny model a few prompt tokens cost less than the
    # spread of a decode step, and a window faster than decoding counts them as free.
    assert token is not None, readings
    assert token >= 0


async def test_an_adapter_with_lora_b_only_is_a_400_naming_the_missing_matrix(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    import mlx.core as mx

    adapters = tmp_path / "adapters"
    folder = make_adapter(tiny_model_path, adapters / "b-only")
    weights = dict(mx.load(str(folder / "adapters.safetensors")))  # type: ignore[arg-type]
    only_b = {k: v for k, v in weights.items() if not k.endswith(".lora_a")}
    mx.save_safetensors(str(folder / "adapters.safetensors"), only_b)
    async with (
        live_server(tiny_model_path, Settings(adapter_dir=adapters)) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as http,
    ):
        refused = await http.post("/v1/adapters", json={"name": "b", "path": "b-only"})
        error = _expect_error(refused, 400, "path")
        assert error["code"] == "invalid_adapter"
        assert "lora_a" in error["message"]
        assert (await http.get("/v1/adapters")).json()["data"] == []
