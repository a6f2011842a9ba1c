"""``/v1/embeddings`` with the ``openai`` client against a live server on the tiny model.

References are computed here with the mlx-lm model itself: its inner transformer's
final hidden states, pooled and normalized as the server says it does.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import trio
import trio.lowlevel

import trio_mlx
from engine_helpers import PROMPT, make_embedder, wait_until
from http_helpers import NO_EOS, LiveServer, live_server

pytestmark = pytest.mark.model

TEXTS = [
    "The quick brown fox jumps over the lazy dog",
    "a",
    "Generators yield values one at a time.",
    "Hello world, hello again",
]
#: The tiny model's id (its folder's name).
MODEL = "tiny-llama"
#: Float32 sums over a padded batch against one row: equal within rounding.
ATOL = 2e-5


def reference(tiny_model: tuple[Any, Any], tokens: Sequence[int], pooling: str) -> Any:
    """The model's own pooled, normalized final hidden state for one input alone."""
    import mlx.core as mx

    model, _ = tiny_model
    hidden = np.array(model.model(mx.array([list(tokens)]))[0].astype(mx.float32))
    vector = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    return vector / np.linalg.norm(vector)


def tokens_of(tiny_model: tuple[Any, Any], text: str) -> list[int]:
    return list(tiny_model[1].encode(text))


@pytest.fixture
async def server(tiny_model_path: Path) -> AsyncIterator[LiveServer]:
    async with live_server(
        tiny_model_path, embedding_pooling="last", max_embedding_inputs=8
    ) as live:
        yield live


@pytest.fixture
async def client(server: LiveServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


def vectors(response: Any) -> list[Any]:
    assert [item.index for item in response.data] == list(range(len(response.data)))
    return [np.array(item.embedding, dtype=np.float32) for item in response.data]


async def test_vectors_equal_a_direct_forward_pass(
    server: LiveServer, client: openai.AsyncOpenAI, tiny_model: tuple[Any, Any]
) -> None:
    response = await client.embeddings.create(
        model=server.engine.model_id, input=TEXTS, encoding_format="float", user="tester"
    )
    assert response.object == "list"
    assert response.model == server.engine.model_id
    counts = [len(tokens_of(tiny_model, text)) for text in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(counts)
    for text, got in zip(TEXTS, vectors(response), strict=True):
        want = reference(tiny_model, tokens_of(tiny_model, text), "last")
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=ATOL)
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5


async def test_a_batch_equals_each_input_alone(client: openai.AsyncOpenAI) -> None:
    together = vectors(await client.embeddings.create(model=MODEL, input=TEXTS))
    # More inputs than one pass holds at once would split; these fit one pass.
    for text, batched in zip(TEXTS, together, strict=True):
        alone = vectors(await client.embeddings.create(model=MODEL, input=text))
        np.testing.assert_allclose(batched, alone[0], atol=ATOL)
    assert not np.allclose(together[0], together[1], atol=1e-3)  # the inputs differ


async def test_base64_is_the_float_vectors_little_endian(server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        floats = (
            await http.post("/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "float"})
        ).json()
        packed = (
            await http.post(
                "/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "base64"}
            )
        ).json()
    for plain, coded in zip(floats["data"], packed["data"], strict=True):
        assert isinstance(coded["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(coded["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.array(plain["embedding"], dtype=np.float32).tolist()


async def test_token_arrays_embed_as_their_text(
    client: openai.AsyncOpenAI, tiny_model: tuple[Any, Any]
) -> None:
    ids = [tokens_of(tiny_model, text) for text in TEXTS[:2]]
    by_text = vectors(await client.embeddings.create(model=MODEL, input=TEXTS[:2]))
    by_ids = vectors(await client.embeddings.create(model=MODEL, input=ids))
    one = vectors(await client.embeddings.create(model=MODEL, input=ids[0]))
    np.testing.assert_allclose(by_ids[0], by_text[0], atol=ATOL)
    np.testing.assert_allclose(by_ids[1], by_text[1], atol=ATOL)
    np.testing.assert_allclose(one[0], by_text[0], atol=ATOL)


async def test_dimensions_truncate_and_renormalize(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path, embedding_pooling="last", embedding_matryoshka=True) as live,
        openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0) as client,
    ):
        full = vectors(await client.embeddings.create(model=live.engine.model_id, input=TEXTS[0]))[
            0
        ]
        cut = vectors(
            await client.embeddings.create(
                model=live.engine.model_id, input=TEXTS[0], dimensions=16
            )
        )[0]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(
                model=live.engine.model_id, input=TEXTS[0], dimensions=100_000
            )
        assert caught.value.body["param"] == "dimensions"  # type: ignore[index]
    assert cut.shape == (16,)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=ATOL)


async def _status(http: httpx.AsyncClient, body: Any) -> tuple[int, dict[str, Any]]:
    response = await http.post("/v1/embeddings", content=json.dumps(body))
    return response.status_code, response.json()


async def test_bad_inputs_are_400_in_openais_shape(server: LiveServer) -> None:
    too_long = list(range(3, 300)) * 8  # 2,376 ids, past the 2,048-token context
    bodies: list[tuple[Any, str | None]] = [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a"] * 9}, "input"),  # max_embedding_inputs=8
        ({"input": too_long}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [{"role": "user"}]}, "input"),
        ({"input": ["a", 5]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": [10**9]}, "input"),  # outside the vocabulary
        ({}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 8}, "dimensions"),  # no Matryoshka support
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "user": 3}, "user"),
        ({"input": "a", "model": 3}, "model"),
        ({"input": "a", "temperature": 1}, "temperature"),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for body, param in bodies:
            status, payload = await _status(http, body)
            assert status == 400, (body, payload)
            assert payload["error"]["type"] == "invalid_request_error", body
            assert payload["error"]["param"] == param, (body, payload)
        status, payload = await _status(http, {"input": "a", "model": "no-such-model"})
        assert status == 404, payload
        response = await http.post("/v1/embeddings", content=b"{not json")
        assert response.status_code == 400
    # The server still serves.
    assert server.engine.statistics().worker_alive


async def test_a_chat_model_without_pooling_refuses_embeddings(tiny_model_path: Path) -> None:
    async with (
        live_server(tiny_model_path) as live,
        openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0) as client,
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model=live.engine.model_id, input="hello")
    assert caught.value.code == "embeddings_unsupported"


async def test_pooling_comes_from_the_sentence_transformers_files(
    tiny_model_path: Path, tiny_model: tuple[Any, Any], tmp_path: Path
) -> None:
    folder = make_embedder(tiny_model_path, tmp_path / "embedder")
    async with (
        live_server(folder) as live,
        openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0) as client,
    ):
        assert live.engine.embedding_pooling == "mean"
        got = vectors(await client.embeddings.create(model=live.engine.model_id, input=TEXTS))
    for text, vector in zip(TEXTS, got, strict=True):
        want = reference(tiny_model, tokens_of(tiny_model, text), "mean")
        np.testing.assert_allclose(vector, want, atol=ATOL)


async def _chat(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        logit_bias={str(k): v for k, v in NO_EOS.items()},  # type: ignore[misc]
        stream=True,
    )
    parts = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


async def test_embeddings_beside_chat_streams_finish_and_leave_chat_unchanged(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    prompts = [f"Tell me about number {i}." for i in range(4)]
    # Long streams, so that the embeddings (given their share) finish among them.
    alone: dict[int, str] = {}

    async def baseline(i: int) -> None:
        alone[i] = await _chat(client, prompts[i], 1500)

    async with trio.open_nursery() as nursery:  # a batch equals each row alone on the CPU
        for i in range(4):
            nursery.start_soon(baseline, i)
    embedded_alone = vectors(
        await client.embeddings.create(model=server.engine.model_id, input=TEXTS)
    )
    chats: dict[int, str] = {}
    embedded: list[list[Any]] = []
    chats_left_when_embedded: list[int] = []

    async def chat(i: int) -> None:
        chats[i] = await _chat(client, prompts[i], 1500)

    async def embed() -> None:
        # Wait until every stream decodes, then embed a few times beside them.
        while server.engine.statistics().running_rows < 4:  # noqa: ASYNC110
            await trio.sleep(0.01)
        for _ in range(3):
            embedded.append(
                vectors(await client.embeddings.create(model=server.engine.model_id, input=TEXTS))
            )
        chats_left_when_embedded.append(4 - len(chats))

    with trio.fail_after(300):  # a hang guard, not a timing assertion
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(chat, i)
            nursery.start_soon(embed)
    assert chats == alone
    for got in embedded:
        for a, b in zip(got, embedded_alone, strict=True):
            np.testing.assert_allclose(a, b, atol=ATOL)
    # The embeddings were not held back until the chat ended.
    assert chats_left_when_embedded[0] > 0
    stats = server.engine.statistics()
    assert stats.requests["embed:finished"] == 4
    assert stats.embedding_inputs == 4 * len(TEXTS)


async def test_metrics_count_embedding_requests_and_tokens(
    server: LiveServer, client: openai.AsyncOpenAI
) -> None:
    response = await client.embeddings.create(model=server.engine.model_id, input=TEXTS[:2])
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        text = (await http.get("/metrics")).text
    assert 'trio_mlx_engine_requests_total{lane="embed",outcome="finished"} 1.0' in text
    assert f"trio_mlx_embedding_tokens_total {float(response.usage.prompt_tokens)}" in text
    assert "trio_mlx_embedding_inputs_total 2.0" in text


async def test_a_cancelled_embedding_leaves_the_engine_serving(
    server: LiveServer, tiny_model: tuple[Any, Any]
) -> None:
    engine = server.engine
    many = [TEXTS[0] * 20] * 8
    with trio.move_on_after(0):  # cancelled at its first checkpoint, wherever that is
        await engine.embed(many)
    for _ in range(3):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.embed, many)
                await trio.lowlevel.checkpoint()
                scope.cancel()
    result = await engine.embed([TEXTS[0]])
    want = reference(tiny_model, tokens_of(tiny_model, TEXTS[0]), "last")
    np.testing.assert_allclose(np.array(result.vectors[0]), want, atol=ATOL)
    assert result.token_counts == (len(tokens_of(tiny_model, TEXTS[0])),)
    stats = engine.statistics()
    assert stats.running_rows == stats.queued_rows == 0


async def test_embeddings_parked_for_a_job_resume_and_stay_exact(
    tiny_model_path: Path, tiny_model: tuple[Any, Any]
) -> None:
    inputs = [f"{TEXTS[i % 4]} {i}" for i in range(24)]
    want = [reference(tiny_model, tokens_of(tiny_model, text), "last") for text in inputs]
    decisions: list[Any] = []
    params = trio_mlx.SamplingParams(max_tokens=64, logit_bias=NO_EOS)
    async with trio_mlx.open_engine(
        tiny_model_path,
        embedding_pooling="last",
        embedding_batch_tokens=32,  # a few inputs a pass: the request spans many steps
        drain_timeout=0.0,  # a job parks the running rows at once
        min_batch_steps=1,
        decision_hook=lambda decision, _: decisions.append(decision),
    ) as engine:
        alone = (await engine.complete(PROMPT, params)).token_ids
        results: dict[str, Any] = {}

        async def chat() -> None:
            results["chat"] = (await engine.complete(PROMPT, params)).token_ids

        async def embed() -> None:
            results["embed"] = await engine.embed(inputs)

        async def job() -> None:
            while engine.statistics().running_rows < 2:  # noqa: ASYNC110
                await trio.sleep(0.001)
            results["job"] = await engine.run_exclusive(lambda model, tokenizer: "ran")

        with trio.fail_after(300):  # a hang guard
            async with trio.open_nursery() as nursery:
                nursery.start_soon(chat)
                nursery.start_soon(embed)
                nursery.start_soon(job)
        stats = engine.statistics()
    assert results["job"] == "ran"
    assert results["chat"] == alone
    for got, expected in zip(results["embed"].vectors, want, strict=True):
        np.testing.assert_allclose(np.array(got), expected, atol=ATOL)
    # The job parked the chat row and the embedding request together, and both resumed.
    parks = [d.ids for d in decisions if type(d).__name__ == "Park"]
    assert any(len(ids) == 2 for ids in parks), parks
    assert any(type(d).__name__ == "Resume" for d in decisions)
    assert stats.requests["embed:finished"] == 1


def test_the_embedding_flags_reach_the_engine() -> None:
    from trio_mlx_http._cli import build_parser
    from trio_mlx_http._server.run import _engine_settings

    flags = ["--embedding-pooling", "mean", "--embedding-matryoshka"]
    flags += ["--embedding-share", "0.25", "--max-embedding-inputs", "7"]
    settings = _engine_settings(build_parser().parse_args(["serve", *flags]))
    assert settings.embedding_pooling == "mean"
    assert settings.embedding_matryoshka is True
    assert settings.embedding_share == 0.25
    assert settings.max_embedding_inputs == 7
    default = _engine_settings(build_parser().parse_args(["serve"]))
    assert (default.embedding_pooling, default.embedding_matryoshka) == (None, False)
    assert default.embedding_share == 0.1


async def test_cancelling_a_queued_or_running_embedding_frees_it(
    tiny_model_path: Path, tiny_model: tuple[Any, Any]
) -> None:
    inputs = [f"{TEXTS[0]} {i}" for i in range(16)]
    async with trio_mlx.open_engine(
        tiny_model_path,
        embedding_pooling="last",
        embedding_share=0.001,  # beside a decoding row, a pass per ~1,000 passes' time
        embedding_batch_tokens=16,  # one input a pass
    ) as engine:
        with trio.fail_after(120):  # a hang guard
            # Queued: a job holds the MLX thread while the request waits.
            release = threading.Event()
            queued = trio.CancelScope()

            async def embed_queued() -> None:
                with queued:
                    await engine.embed(inputs)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.run_exclusive, lambda m, t: release.wait(60))
                await wait_until(lambda: engine.statistics().running_jobs == 1)
                nursery.start_soon(embed_queued)
                await wait_until(lambda: engine.statistics().queued_rows == 1)
                queued.cancel()
                await wait_until(lambda: engine.statistics().queued_rows == 0)
                release.set()
            # Running: admitted beside a long chat row, its passes rationed.
            params = trio_mlx.SamplingParams(max_tokens=1500, logit_bias=NO_EOS)
            async with engine.generate(PROMPT, params) as stream, trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def embed() -> None:
                    with scope:
                        await engine.embed(inputs)

                nursery.start_soon(embed)
                await wait_until(lambda: engine.statistics().running_rows == 2)
                scope.cancel()
                await wait_until(lambda: engine.statistics().running_rows == 1)
                async for _ in stream:
                    break  # the chat row still decodes
            result = await engine.embed([TEXTS[0]])
        stats = engine.statistics()
    assert stats.requests["embed:cancelled"] == 2
    assert stats.requests["embed:finished"] == 1
    want = reference(tiny_model, tokens_of(tiny_model, TEXTS[0]), "last")
    np.testing.assert_allclose(np.array(result.vectors[0]), want, atol=ATOL)
