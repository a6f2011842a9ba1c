"""The answers of the OpenAI endpoints conform to OpenAI's response schemas.

``http_helpers.live_server`` checks every HTTP test's answers; these tests
show that the checker sees what is sent and that it rejects what OpenAI's
schemas reject (the shapes the server sent before: ``system_fingerprint:
null``, a chat message without ``refusal``).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from http_helpers import NO_EOS, sse_events
from openai_schemas import SchemaChecker, problems
from trio_mlx_http.testing import live_server

USER = [{"role": "user", "content": "Hi"}]


def _chat_completion() -> dict[str, object]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def test_the_schemas_reject_what_openai_rejects() -> None:
    assert problems("chat.completion", _chat_completion()) == []
    body = _chat_completion()
    body["system_fingerprint"] = None
    assert problems("chat.completion", body)
    body = _chat_completion()
    del body["choices"][0]["message"]["refusal"]  # type: ignore[index]
    assert problems("chat.completion", body)
    body = _chat_completion()
    body["choices"][0]["finish_reason"] = None  # type: ignore[index]
    assert problems("chat.completion", body)
    assert problems("error", {"error": {"message": "m", "type": "t", "param": None}})


@pytest.mark.model
async def test_every_openai_endpoint_answer_is_checked(tiny_model_path: Path) -> None:
    checker = SchemaChecker()
    async with (
        live_server(tiny_model_path, wrap_asgi=checker.wrap) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        common = {"max_tokens": 4, "logit_bias": NO_EOS}
        sent = [
            await http.post("/v1/chat/completions", json={"messages": USER, **common}),
            await http.post(
                "/v1/chat/completions",
                json={
                    "messages": USER,
                    "stream": True,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "stream_options": {"include_usage": True},
                    **common,
                },
            ),
            await http.post("/v1/completions", json={"prompt": "Hi", "logprobs": 1, **common}),
            await http.post("/v1/completions", json={"prompt": "Hi", "stream": True, **common}),
            await http.get("/v1/models"),
            await http.get(f"/v1/models/{server.engine.model_id}"),
            await http.post("/v1/chat/completions", json={"messages": USER, "n": 0}),
        ]
    assert [r.status_code for r in sent] == [200] * 6 + [400]
    events = len(sse_events(sent[1].content)) - 1 + len(sse_events(sent[3].content)) - 1
    assert checker.checked == 5 + events
    assert checker.problems == []
