"""Input size: tokenizing off the event loop and bounded by the context; max_tokens fits it."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from http_helpers import NO_EOS, live_server, sse_events

pytestmark = pytest.mark.model

JSON = {"content-type": "application/json"}


async def test_max_tokens_past_the_context_is_clamped_and_reported(tiny_model_path: Path) -> None:
    prompt = [5] * 2040  # the tiny model's context is 2,048
    body = {"prompt": prompt, "max_tokens": 2048, "logit_bias": NO_EOS}
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert reply.headers["x-max-tokens-clamped"] == "8"
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.headers["x-max-tokens-clamped"] == "8"
            events = sse_events(await s.aread())
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        fits = await http.post("/v1/completions", json={**body, "max_tokens": 8})
        assert "x-max-tokens-clamped" not in fits.headers
        full = await http.post("/v1/completions", json={**body, "prompt": [5] * 2048})
        assert full.status_code == 400
        assert full.json()["error"]["code"] == "context_length_exceeded"


async def test_a_4mb_prompt_is_refused_from_its_length_without_tokenizing(
    tiny_model_path: Path,
) -> None:
    text = "a " * 1_950_000
    chat = [{"role": "user", "content": ""}] * 120_000
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        for path, body, said in [
            ("/tokenize", {"prompt": text}, "bytes are more tokens"),
            ("/v1/completions", {"prompt": text}, "bytes are more tokens"),
            ("/tokenize", {"messages": chat}, "120000 messages"),
        ]:
            data = json.dumps(body).encode()
            assert len(data) < 4 * 1024 * 1024
            reply = await http.post(path, content=data, headers=JSON)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert said in error["message"]


class _SlowEncode:
    """Fault injection: the tokenizer's ``encode`` blocks its thread until ``release``.

    A CPU-heavy prompt, held as long as the test needs rather than for a fixed
    time, so a loaded machine cannot let it finish before the test looks.
    """

    def __init__(self, encode: Any) -> None:
        self.encode = encode
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = 0

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if len(text) <= 1024:
            return self.encode(text, **kwargs)
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(timeout=60)  # blocks whichever thread runs it
        with self.lock:
            self.running -= 1
        return self.encode(text, **kwargs)


async def test_slow_tokenizing_runs_off_the_loop_a_few_prompts_at_once(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    large = {"prompt": "word " * 300}  # past the inline size: tokenized in a thread
    tiny = {"prompt": "Hi"}
    order: list[str] = []
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as http,
    ):
        hf_tokenizer = server.engine.tokenizer._tokenizer  # under mlx-lm's wrapper
        slow = _SlowEncode(hf_tokenizer.encode)
        monkeypatch.setattr(hf_tokenizer, "encode", slow)

        async def tokenize_large() -> None:
            reply = await http.post("/tokenize", json=large)
            assert reply.status_code == 200
            order.append("large")

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(tokenize_large)
                with trio.fail_after(60):  # several prompts at once, or this fails
                    while slow.running < 2:  # noqa: ASYNC110 - a counter of other threads
                        await trio.sleep(0.01)
                # While they are blocked: the loop answers, and a small prompt does
                # not queue behind them.
                for _ in range(3):
                    assert (await http.get("/health")).status_code == 200
                assert (await http.post("/tokenize", json=tiny)).status_code == 200
                order.append("tiny")
                slow.release.set()
        finally:
            slow.release.set()
    assert order == ["tiny", "large", "large", "large"]
    assert slow.most >= 2


async def test_tokenize_and_detokenize_answer_large_bodies_exactly(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        text = "word " * 400
        tokens = (await http.post("/tokenize", json={"prompt": text})).json()["tokens"]
        assert tokens == server.engine.encode(text)
        ids = [5] * 2048  # the context's worth: decoded off the loop
        reply = await http.post("/detokenize", json={"tokens": ids})
        assert reply.json()["prompt"] == server.engine.tokenizer.decode(ids)
        for too_many in ([5] * 2049, [5] * 1_300_000):  # refused counted, or from the size
            reply = await http.post("/detokenize", json={"tokens": too_many})
            assert reply.status_code == 400
            assert reply.json()["error"]["code"] == "context_length_exceeded"


def _many_calls(route: str, count: int, model: str) -> tuple[str, dict[str, Any]]:
    """A body whose tool calls (or tool definitions) alone render past the context."""
    hi = {"role": "user", "content": "hi"}
    if route == "chat":
        calls = [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for i in range(count)
        ]
        chat = [hi, {"role": "assistant", "content": None, "tool_calls": calls}]
        return "/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 4}
    if route == "tokenize":
        path, body = _many_calls("chat", count, model)
        return "/tokenize", {"messages": body["messages"]}
    if route == "tools":
        tools = [
            {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
            for i in range(count)
        ]
        return "/v1/chat/completions", {"model": model, "messages": [hi], "tools": tools}
    if route == "responses":
        items = [
            {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
            for i in range(count)
        ]
        return "/v1/responses", {"model": model, "input": [hi, *items], "max_output_tokens": 4}
    # Each tool result becomes a message of its own: a few, so the bytes decide.
    blocks = [{"type": "tool_use", "id": f"c{i}", "name": "f", "input": {}} for i in range(count)]
    results = [
        {"type": "tool_result", "tool_use_id": f"c{i}", "content": "x" * 30_000} for i in range(8)
    ]
    chat = [hi, {"role": "assistant", "content": blocks}, {"role": "user", "content": results}]
    path = "/v1/messages" if route == "messages" else "/v1/messages/count_tokens"
    return path, {"model": model, "messages": chat, "max_tokens": 4}


_ROUTES = ["chat", "tokenize", "tools", "responses", "messages", "count_tokens"]


async def test_tool_calls_and_tool_definitions_count_toward_the_prompt_size(
    tool_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        live_server(tool_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as http,
    ):
        rendered: list[int] = []
        tokenizer = server.engine.tokenizer
        render = tokenizer.apply_chat_template
        monkeypatch.setattr(
            tokenizer,
            "apply_chat_template",
            lambda *a, **k: rendered.append(1) or render(*a, **k),
        )
        model = server.engine.model_id
        for route in _ROUTES:
            path, body = _many_calls(route, 40_000, model)
            reply = await http.post(path, json=body)
            assert reply.status_code == 400, (route, reply.text)
            error = reply.json()["error"]
            assert error.get("code", "context_length_exceeded") == "context_length_exceeded"
            assert "more than the model's context" in error["message"], (route, error)
        assert rendered == []  # refused before the chat template ran
        path, body = _many_calls("chat", 3, model)  # a few calls fit, and are rendered
        assert (await http.post(path, json=body)).status_code == 200
        assert rendered


class _HeldCheck:
    """Fault injection: the prompt size check blocks its thread until ``release``."""

    def __init__(self, check: Any) -> None:
        self.check = check
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.started.set()
        self.release.wait(timeout=30)  # on the event loop this would hold everything
        return self.check(*args, **kwargs)


@pytest.mark.parametrize("route", ["chat", "count_tokens", "responses"])
async def test_health_is_answered_while_a_huge_tool_call_body_is_refused(
    tool_model_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    import trio_mlx._core.prompts

    held = _HeldCheck(trio_mlx._core.prompts.rendered_bytes)
    monkeypatch.setattr(trio_mlx._core.prompts, "rendered_bytes", held)
    order: list[str] = []
    async with (
        live_server(tool_model_path) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as http,
    ):
        path, body = _many_calls(route, 40_000, server.engine.model_id)

        async def huge() -> None:
            reply = await http.post(path, json=body)
            assert reply.status_code == 400, reply.text
            order.append("huge refused")

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(huge)
                with trio.fail_after(60):
                    while not held.started.is_set():  # noqa: ASYNC110 - set by another thread
                        await trio.sleep(0.01)
                assert (await http.get("/health")).status_code == 200
                order.append("health")
                held.release.set()
        finally:
            held.release.set()
    assert order == ["health", "huge refused"]
