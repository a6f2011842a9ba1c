"""Images over HTTP: OpenAI chat image_url parts, Responses input_image, Anthropic
image blocks, each with its official client, on a tiny random llava; the bounds."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (the 'vision' extra; nox -s tests installs it)"
)

from http_helpers import NO_EOS, LiveServer, live_server
from trio_mlx_http._settings import Settings
from vision_helpers import QUESTION, data_url, png


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trio_mlx.testing import make_random_vlm

    return make_random_vlm(tmp_path_factory.mktemp("models") / "tiny-llava")


QUESTION_BLOCK = {"type": "text", "text": QUESTION}


def _openai(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(url: str) -> list[Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


async def _chat_text(server: LiveServer, client: openai.AsyncOpenAI, url: str) -> str:
    model = server.engine.model_id
    reply = await client.chat.completions.create(model=model, messages=_chat(url), max_tokens=8)
    return reply.choices[0].message.content or ""


async def test_every_api_sees_the_image(vlm_path: Path) -> None:
    image = png(1)
    async with live_server(vlm_path) as server, _openai(server) as client:
        model = server.engine.model_id
        card = await client.models.retrieve(model)
        assert card.model_extra is not None
        assert card.model_extra["input_modalities"] == ["text", "image"]
        whole = await _chat_text(server, client, data_url(image))
        other = await _chat_text(server, client, data_url(png(2)))
        stream = await client.chat.completions.create(
            model=model, messages=_chat(data_url(image)), max_tokens=8, stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        items: Any = [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ]
        response = await client.responses.create(model=model, max_output_tokens=8, input=items)
        events = await client.responses.create(
            model=model, max_output_tokens=8, input=items, stream=True
        )
        response_streamed = "".join(
            [e.delta async for e in events if e.type == "response.output_text.delta"]
        )
        async with anthropic.AsyncAnthropic(
            base_url=server.url, api_key="unused", max_retries=0
        ) as claude:
            source = {
                "type": "base64",
                "media_type": "image/png",
                "data": base64.b64encode(image).decode(),
            }
            blocks: Any = [
                {"role": "user", "content": [{"type": "image", "source": source}, QUESTION_BLOCK]}
            ]
            message = await claude.messages.create(model=model, max_tokens=8, messages=blocks)
            async with claude.messages.stream(
                model=model, max_tokens=8, messages=blocks
            ) as claude_stream:
                claude_streamed = await claude_stream.get_final_text()
    claude_text = "".join(b.text for b in message.content if b.type == "text")
    assert whole
    assert whole == streamed == response.output_text == response_streamed
    assert whole == claude_text == claude_streamed
    assert other != whole


async def test_a_repeated_image_reports_cached_tokens(vlm_path: Path) -> None:
    async with live_server(vlm_path) as server, _openai(server) as client:
        replies = [
            await client.chat.completions.create(
                model=server.engine.model_id,
                messages=_chat(data_url(png(3))),
                max_tokens=4,
                logit_bias=NO_EOS,
            )
            for _ in range(2)
        ]
    first, again = (r.usage for r in replies)
    assert first is not None
    assert again is not None
    assert again.prompt_tokens == first.prompt_tokens
    details = again.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens == first.prompt_tokens - 1
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content


async def test_counts_and_stored_responses_see_the_image(vlm_path: Path) -> None:
    image = data_url(png(4))
    async with live_server(vlm_path) as server, _openai(server) as client:
        model = server.engine.model_id
        reply = await client.chat.completions.create(
            model=model, messages=_chat(image), max_tokens=2
        )
        status, counted = await _status(server, "/tokenize", {"messages": _chat(image)})
        block = {"type": "image", "source": {"type": "url", "url": image}}
        anthropic_body = {"messages": [{"role": "user", "content": [block, QUESTION_BLOCK]}]}
        count_status, count = await _status(server, "/v1/messages/count_tokens", anthropic_body)
        first = await client.responses.create(
            model=model,
            max_output_tokens=4,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": image}]}],
        )
        follow = await client.responses.create(
            model=model, max_output_tokens=4, input="And?", previous_response_id=first.id
        )
    assert reply.usage is not None
    assert status == 200
    assert counted["count"] == reply.usage.prompt_tokens
    assert count_status == 200
    assert count["input_tokens"] == reply.usage.prompt_tokens
    assert follow.usage is not None
    assert first.usage is not None
    # The stored turn's image is in the follow-up's prompt: the cache entry of the
    # first prompt, keyed by that image, serves it.
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1


async def _status(server: LiveServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http_client:
        answer = await http_client.post(path, json=body)
    return answer.status_code, answer.json()


async def test_bad_images_are_400s_naming_them(vlm_path: Path) -> None:
    settings = Settings(max_images=2, max_image_bytes=4096)
    big = png(1, (64, 64))  # random pixels do not compress: over 4 KiB
    assert len(big) > 4096
    two = [{"type": "image_url", "image_url": {"url": data_url(png(1))}}] * 3
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        (
            "/v1/chat/completions",
            {"messages": _chat("data:image/png;base64,@@@not-base64")},
            "messages[0].content[0]",
            "invalid_image",
        ),
        (
            "/v1/chat/completions",
            {"messages": _chat(data_url(b"not an image"))},
            "messages",
            "invalid_image",
        ),
        (
            "/v1/chat/completions",
            {"messages": _chat(data_url(big))},
            "messages[0].content[0]",
            "image_too_large",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": two}]},
            "messages[0].content[2]",
            "too_many_images",
        ),
        (
            "/v1/chat/completions",
            {"messages": _chat("https://example.com/cat.png")},
            "messages[0].content[0]",
            "image_urls_disabled",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": data_url(png(1)), "detail": "low"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].image_url.detail",
            "unsupported_parameter",
        ),
        (
            "/v1/chat/completions",
            {"messages": _chat("ftp://example.com/cat.png")},
            "messages[0].content[0]",
            "invalid_image",
        ),
    ]
    async with live_server(vlm_path, settings, max_image_pixels=48 * 48) as server:
        for path, body, param, code in cases:
            status, answer = await _status(server, path, {"max_tokens": 2, **body})
            assert status == 400, (body, answer)
            assert answer["error"]["code"] == code, answer
            assert answer["error"]["param"] == param, answer
        huge = {"messages": _chat(data_url(png(1, (40, 60), flat=True))), "max_tokens": 2}
        status, answer = await _status(server, "/v1/chat/completions", huge)
        assert status == 400
        assert answer["error"]["code"] == "image_too_large"
        assert "40 x 60 pixels" in answer["error"]["message"]
        anthropic_bad = {
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "base64", "data": "!!"}}],
                }
            ],
        }
        status, answer = await _status(server, "/v1/messages", anthropic_bad)
        assert status == 400
        assert answer["type"] == "error"
        assert "messages[0].content[0]" in answer["error"]["message"]
        # Still serving.
        status, _ = await _status(
            server, "/v1/chat/completions", {"messages": _chat(data_url(png(1))), "max_tokens": 2}
        )
        assert status == 200


async def test_a_text_model_answers_an_image_with_400(tiny_model_path: Path) -> None:
    async with live_server(tiny_model_path) as server:
        body = {"messages": _chat(data_url(png(1))), "max_tokens": 2}
        status, answer = await _status(server, "/v1/chat/completions", body)
        async with httpx.AsyncClient(base_url=server.url) as http_client:
            models = (await http_client.get("/v1/models")).json()
    assert status == 400
    assert answer["error"]["code"] == "images_unsupported"
    assert answer["error"]["param"] == "messages[0].content[0]"
    assert models["data"][0]["input_modalities"] == ["text"]


@pytest.fixture
def image_host() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 serving ``/cat.png``; yields its URL and the paths asked."""
    asked: list[str] = []
    image = png(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *_: Any) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}", asked
    finally:
        host.shutdown()
        host.server_close()
        thread.join(timeout=10)


async def test_image_urls_are_fetched_only_when_allowed(
    vlm_path: Path, image_host: tuple[str, list[str]]
) -> None:
    base, asked = image_host
    async with live_server(vlm_path) as server:
        status, answer = await _status(
            server, "/v1/chat/completions", {"messages": _chat(f"{base}/cat.png"), "max_tokens": 2}
        )
    assert status == 400
    assert answer["error"]["code"] == "image_urls_disabled"
    assert asked == []
    allowed = Settings(allow_image_urls=True)
    async with live_server(vlm_path, allowed) as server, _openai(server) as client:
        fetched = await _chat_text(server, client, f"{base}/cat.png")
        inline = await _chat_text(server, client, data_url(png(1)))
        status, answer = await _status(
            server,
            "/v1/chat/completions",
            {"messages": _chat(f"{base}/missing.png"), "max_tokens": 2},
        )
    assert fetched == inline
    assert asked == ["/cat.png", "/missing.png"]
    assert status == 400
    assert answer["error"]["code"] == "image_fetch_failed"
