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
