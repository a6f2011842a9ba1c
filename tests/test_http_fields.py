"""Every request field of OpenAI's chat and completions APIs: honoured (with its effect shown)
or refused with 400 ``unsupported_parameter``; never silently ignored if it could change the output.

The field lists come from the installed ``openai`` package's request types
(``CompletionCreateParamsBase`` of both endpoints), so a field OpenAI adds
fails the walk until it is classified here. ``response_format`` and ``tool_choice``
have their own tests too (tests/test_http_structured.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from http_helpers import NO_EOS, LiveServer, live_server, sse_events
from trio_mlx import EngineSettings, SamplingParams
from trio_mlx_http._openai import schema as _schema
from trio_mlx_http._settings import Settings

pytestmark = pytest.mark.model

USER = [{"role": "user", "content": "Say something."}]
#: Fields that cannot change the output: accepted, and the output is the same.
HARMLESS = {
    "metadata": {"k": "v"},
    "store": True,
    "user": "user-1",
    "service_tier": "auto",
    "safety_identifier": "s-1",
    "prompt_cache_key": "k-1",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "auto"},
    "prediction": {"type": "content", "content": "Something."},
}
#: Refused with 400 naming the field.
REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "moderation": {"model": "omni-moderation-latest"},
    "web_search_options": {},
}

Check = Callable[["Walk"], Awaitable[None]]


class Walk:
    """One live server, a baseline answer per endpoint, and helpers for the checks."""

    def __init__(self, server: LiveServer, http: httpx.AsyncClient) -> None:
        self.server = server
        self.http = http
        self.model = server.engine.model_id

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.http.post(path, json=body)

    async def chat(self, **fields: Any) -> dict[str, Any]:
        body = {"messages": USER, "max_tokens": 12, "logit_bias": NO_EOS, **fields}
        response = await self.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        payload: dict[str, Any] = response.json()
        return payload

    async def text(self, **fields: Any) -> dict[str, Any]:
        body = {"prompt": "The quick brown fox", "max_tokens": 12, "logit_bias": NO_EOS, **fields}
        response = await self.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        payload: dict[str, Any] = response.json()
        return payload

    async def refused(self, path: str, name: str, value: Any, base: dict[str, Any]) -> None:
        response = await self.post(path, {**base, name: value})
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["param"] == name, error
        assert error["code"] in ("unsupported_parameter", "invalid_request_error", None), error


def _content(payload: dict[str, Any], index: int = 0) -> str:
    text: str = payload["choices"][index]["message"]["content"]
    return text


def _lps(payload: dict[str, Any]) -> list[float]:
    return [e["logprob"] for e in payload["choices"][0]["logprobs"]["content"]]


#: A token the penalty checks push the tiny model to repeat.
_REPEAT = {**NO_EOS, "100": 8.0}


async def _chat_penalty(walk: Walk, name: str) -> None:
    plain = await walk.chat(logit_bias=_REPEAT, logprobs=True, max_tokens=16)
    penalised = await walk.chat(logit_bias=_REPEAT, logprobs=True, max_tokens=16, **{name: 2.0})
    # Log-probabilities are taken after the penalties: a repeated token's drops.
    assert _lps(penalised) != _lps(plain)


async def _chat_stream(walk: Walk, **extra: Any) -> list[Any]:
    body = {"messages": USER, "max_tokens": 12, "logit_bias": NO_EOS, "stream": True, **extra}
    response = await walk.post("/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    return sse_events(response.content)


async def chat_messages(walk: Walk) -> None:
    one = await walk.chat()
    two = await walk.chat(messages=[*USER, {"role": "user", "content": "And more, please."}])
    assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]


async def chat_model(walk: Walk) -> None:
    assert (await walk.chat(model=walk.model))["model"] == walk.model
    response = await walk.post("/v1/chat/completions", {"messages": USER, "model": "nope"})
    assert response.status_code == 404


async def chat_logit_bias(walk: Walk) -> None:
    forced = await walk.chat(logit_bias={**NO_EOS, "100": 100}, max_tokens=4)
    assert _content(forced) == walk.server.engine.tokenizer.decode([100] * 4)


async def chat_logprobs(walk: Walk) -> None:
    payload = await walk.chat(logprobs=True)
    assert len(payload["choices"][0]["logprobs"]["content"]) == 12


async def chat_top_logprobs(walk: Walk) -> None:
    payload = await walk.chat(logprobs=True, top_logprobs=3)
    assert all(len(e["top_logprobs"]) == 3 for e in payload["choices"][0]["logprobs"]["content"])


async def chat_max_tokens(walk: Walk) -> None:
    assert (await walk.chat(max_tokens=5))["usage"]["completion_tokens"] == 5


async def chat_max_completion_tokens(walk: Walk) -> None:
    payload = await walk.chat(max_tokens=9, max_completion_tokens=5)
    assert payload["usage"]["completion_tokens"] == 5


async def chat_n(walk: Walk) -> None:
    assert len((await walk.chat(n=2))["choices"]) == 2


async def chat_seed(walk: Walk) -> None:
    first = await walk.chat(temperature=1.0, seed=11)
    second = await walk.chat(temperature=1.0, seed=11)
    assert _content(first) == _content(second)


async def chat_stop(walk: Walk) -> None:
    whole = _content(await walk.chat())
    stop = whole[4:7]
    cut = await walk.chat(stop=[stop])
    assert _content(cut) == whole[: whole.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


async def chat_stream(walk: Walk) -> None:
    events = await _chat_stream(walk)
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )
    assert text == _content(await walk.chat())


async def chat_stream_options(walk: Walk) -> None:
    events = await _chat_stream(walk, stream_options={"include_usage": True})
    assert events[-2]["usage"]["completion_tokens"] == 12
    assert "usage" not in (await _chat_stream(walk))[-2]


async def chat_temperature(walk: Walk) -> None:
    greedy = _content(await walk.chat())
    assert _content(await walk.chat(temperature=2.0, seed=3)) != greedy
    await walk.refused("/v1/chat/completions", "temperature", 2.5, {"messages": USER})


async def chat_top_p(walk: Walk) -> None:
    # A nucleus of one token makes temperature 2 greedy again.
    greedy = _content(await walk.chat())
    assert _content(await walk.chat(temperature=2.0, seed=3, top_p=1e-9)) == greedy


async def chat_frequency_penalty(walk: Walk) -> None:
    await _chat_penalty(walk, "frequency_penalty")


async def chat_presence_penalty(walk: Walk) -> None:
    await _chat_penalty(walk, "presence_penalty")


async def chat_tools(walk: Walk) -> None:
    # Honoured on models with tool calling (test_http_tool_formats); this one has none.
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    response = await walk.post("/v1/chat/completions", {"messages": USER, "tools": [tool]})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "tools_unsupported"


async def chat_parallel_tool_calls(walk: Walk) -> None:
    # Its effect (one call instead of two) is shown per format in test_http_tool_formats.
    from test_http_tool_formats import test_a_model_with_each_format_returns_tool_calls

    assert test_a_model_with_each_format_returns_tool_calls is not None
    await walk.chat(parallel_tool_calls=True)
    await walk.refused("/v1/chat/completions", "parallel_tool_calls", "no", {"messages": USER})


async def chat_modalities(walk: Walk) -> None:
    assert _content(await walk.chat(modalities=["text"])) == _content(await walk.chat())
    await walk.refused("/v1/chat/completions", "modalities", ["text", "audio"], {"messages": USER})


async def chat_reasoning_effort(walk: Walk) -> None:
    # Honoured where the chat template reads it or enable_thinking
    # (test_chat_template_kwargs_reach_the_template, test_http_endpoint_reasoning); this
    # model has no reasoning to set: accepted, and the answer is the same.
    assert _content(await walk.chat(reasoning_effort="low")) == _content(await walk.chat())
    await walk.refused("/v1/chat/completions", "reasoning_effort", "lots", {"messages": USER})


async def chat_verbosity(walk: Walk) -> None:
    # A hint no chat template reads (agents send it): accepted, the answer the same.
    assert _content(await walk.chat(verbosity="low")) == _content(await walk.chat())
    await walk.refused("/v1/chat/completions", "verbosity", "loud", {"messages": USER})


def _harmless(path: str, name: str) -> Check:
    async def check(walk: Walk) -> None:
        call = walk.chat if path.endswith("chat/completions") else walk.text
        plain, marked = await call(), await call(**{name: HARMLESS[name]})
        assert plain["choices"][0] == marked["choices"][0]

    return check


def _refused(path: str, name: str, base: dict[str, Any]) -> Check:
    async def check(walk: Walk) -> None:
        await walk.refused(path, name, REFUSED[name], base)

    return check


async def chat_response_format(walk: Walk) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    answer = await walk.chat(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        max_tokens=20,
    )
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert set(json.loads(_content(answer))) == {"n"}


async def chat_tool_choice(walk: Walk) -> None:
    response = await walk.post(
        "/v1/chat/completions", {"messages": USER, "tool_choice": "required"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"
    assert (await walk.chat(tool_choice="none"))["choices"][0]["message"].get("tool_calls") is None


CHAT: dict[str, Check] = {
    "messages": chat_messages,
    "response_format": chat_response_format,
    "tool_choice": chat_tool_choice,
    "model": chat_model,
    "frequency_penalty": chat_frequency_penalty,
    "presence_penalty": chat_presence_penalty,
    "logit_bias": chat_logit_bias,
    "logprobs": chat_logprobs,
    "top_logprobs": chat_top_logprobs,
    "max_tokens": chat_max_tokens,
    "max_completion_tokens": chat_max_completion_tokens,
    "n": chat_n,
    "seed": chat_seed,
    "stop": chat_stop,
    "stream": chat_stream,
    "stream_options": chat_stream_options,
    "temperature": chat_temperature,
    "top_p": chat_top_p,
    "tools": chat_tools,
    "parallel_tool_calls": chat_parallel_tool_calls,
    "modalities": chat_modalities,
    "reasoning_effort": chat_reasoning_effort,
    "verbosity": chat_verbosity,
    **{n: _harmless("/v1/chat/completions", n) for n in HARMLESS},
    **{n: _refused("/v1/chat/completions", n, {"messages": USER}) for n in REFUSED},
}


def _text(payload: dict[str, Any], index: int = 0) -> str:
    text: str = payload["choices"][index]["text"]
    return text


async def text_prompt(walk: Walk) -> None:
    one = await walk.text(prompt="Hi")
    two = await walk.text(prompt=["Hi", "The quick brown fox jumps"])
    assert len(two["choices"]) == 2
    assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]


async def text_model(walk: Walk) -> None:
    assert (await walk.text(model=walk.model))["model"] == walk.model


async def text_best_of(walk: Walk) -> None:
    assert len((await walk.text(best_of=2, n=2))["choices"]) == 2
    # Four sampled candidates are generated (usage counts them all), one is returned; which
    # one (the highest cumulative logprob) is test_best_of_returns_the_most_likely_candidates.
    sampled = {"temperature": 1.5, "max_tokens": 6}
    best = await walk.text(best_of=4, logprobs=0, **sampled)
    assert len(best["choices"]) == 1
    assert best["usage"]["completion_tokens"] == 4 * 6
    assert len(best["choices"][0]["logprobs"]["tokens"]) == 6
    plain = await walk.text(best_of=4, **sampled)
    assert plain["choices"][0]["logprobs"] is None  # ranked on logprobs, not sent unasked
    base = {"prompt": "Hi"}
    await walk.refused("/v1/completions", "best_of", 1, {**base, "n": 2})
    await walk.refused("/v1/completions", "best_of", 3, {**base, "stream": True})


async def text_echo(walk: Walk) -> None:
    plain = _text(await walk.text())
    assert _text(await walk.text(echo=True)) == "The quick brown fox" + plain
    ids = walk.server.engine.encode("The quick brown fox")
    assert _text(await walk.text(echo=True, prompt=ids)) == "The quick brown fox" + plain
    body = {"prompt": "Hi", "echo": True, "stream": True, "max_tokens": 3}
    events = sse_events((await walk.post("/v1/completions", body)).content)
    assert events[0]["choices"][0]["text"] == "Hi"
    # With logprobs the prompt's own tokens are scored (the first has none).
    scored = (await walk.text(echo=True, logprobs=2))["choices"][0]["logprobs"]
    generated = (await walk.text(logprobs=2))["choices"][0]["logprobs"]
    assert len(scored["tokens"]) == len(ids) + 12
    assert scored["token_logprobs"][0] is None
    assert scored["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in scored["token_logprobs"][1:])
    assert scored["tokens"][len(ids) :] == generated["tokens"]
    # max_tokens 0 scores the prompt alone.
    alone = await walk.text(echo=True, logprobs=0, max_tokens=0)
    assert _text(alone) == "The quick brown fox"
    assert alone["usage"]["completion_tokens"] == 0
    assert alone["choices"][0]["logprobs"]["tokens"] == scored["tokens"][: len(ids)]


async def text_logprobs(walk: Walk) -> None:
    logprobs = (await walk.text(logprobs=2))["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 12
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])


async def text_frequency_penalty(walk: Walk) -> None:
    plain = await walk.text(logit_bias=_REPEAT, logprobs=0, max_tokens=16)
    penalised = await walk.text(
        logit_bias=_REPEAT, logprobs=0, max_tokens=16, frequency_penalty=2.0
    )
    assert (
        penalised["choices"][0]["logprobs"]["token_logprobs"]
        != plain["choices"][0]["logprobs"]["token_logprobs"]
    )


async def text_presence_penalty(walk: Walk) -> None:
    plain = await walk.text(logit_bias=_REPEAT, logprobs=0, max_tokens=16)
    penalised = await walk.text(logit_bias=_REPEAT, logprobs=0, max_tokens=16, presence_penalty=2)
    assert (
        penalised["choices"][0]["logprobs"]["token_logprobs"]
        != plain["choices"][0]["logprobs"]["token_logprobs"]
    )


async def text_logit_bias(walk: Walk) -> None:
    forced = await walk.text(logit_bias={"100": 100}, max_tokens=3)
    assert _text(forced) == walk.server.engine.tokenizer.decode([100] * 3)


async def text_max_tokens(walk: Walk) -> None:
    assert (await walk.text(max_tokens=4))["usage"]["completion_tokens"] == 4


async def text_n(walk: Walk) -> None:
    assert len((await walk.text(n=3))["choices"]) == 3


async def text_seed(walk: Walk) -> None:
    first, second = (
        await walk.text(temperature=1.0, seed=5),
        await walk.text(temperature=1.0, seed=5),
    )
    assert _text(first) == _text(second)


async def text_stop(walk: Walk) -> None:
    whole = _text(await walk.text())
    stop = whole[3:6]
    assert _text(await walk.text(stop=stop)) == whole[: whole.index(stop)]


async def text_stream(walk: Walk) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "logit_bias": NO_EOS}
    events = sse_events((await walk.post("/v1/completions", {**body, "stream": True})).content)
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == _text(await walk.text())


async def text_stream_options(walk: Walk) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
    with_usage = {**body, "stream_options": {"include_usage": True}}
    events = sse_events((await walk.post("/v1/completions", with_usage)).content)
    assert events[-2]["usage"]["completion_tokens"] >= 1
    await walk.refused("/v1/completions", "stream_options", {"continuous_usage": True}, body)


async def text_suffix(walk: Walk) -> None:
    # Honoured on models with FIM tokens (test_http_reasoning); this one has none.
    await walk.refused("/v1/completions", "suffix", "tail", {"prompt": "Hi"})


async def text_temperature(walk: Walk) -> None:
    assert _text(await walk.text(temperature=2.0, seed=3)) != _text(await walk.text())
    await walk.refused("/v1/completions", "temperature", 3, {"prompt": "Hi"})


async def text_top_p(walk: Walk) -> None:
    assert _text(await walk.text(temperature=2.0, seed=3, top_p=1e-9)) == _text(await walk.text())


COMPLETIONS: dict[str, Check] = {
    "prompt": text_prompt,
    "model": text_model,
    "best_of": text_best_of,
    "echo": text_echo,
    "frequency_penalty": text_frequency_penalty,
    "presence_penalty": text_presence_penalty,
    "logit_bias": text_logit_bias,
    "logprobs": text_logprobs,
    "max_tokens": text_max_tokens,
    "n": text_n,
    "seed": text_seed,
    "stop": text_stop,
    "stream": text_stream,
    "stream_options": text_stream_options,
    "suffix": text_suffix,
    "temperature": text_temperature,
    "top_p": text_top_p,
    "user": _harmless("/v1/completions", "user"),
}


def _openai_fields(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.fixture
async def walk(tiny_model_path: Path) -> AsyncIterator[Walk]:
    async with (
        live_server(tiny_model_path, Settings()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        yield Walk(server, http)


@pytest.mark.parametrize(
    ("fields", "checks", "ours"),
    [
        (_openai_fields(chat_create_params), CHAT, _schema.CHAT_FIELDS),
        (_openai_fields(completion_create_params), COMPLETIONS, _schema.COMPLETION_FIELDS),
    ],
    ids=["chat", "completions"],
)
async def test_every_openai_field_is_honoured_or_refused(
    walk: Walk, fields: set[str], checks: dict[str, Check], ours: frozenset[str]
) -> None:
    unclassified = fields - set(checks)
    assert not unclassified, f"OpenAI fields with no honoured/refused check: {unclassified}"
    for name in sorted(fields):
        await checks[name](walk)
        # The server's own tables agree with what the walk saw.
        if name in REFUSED:
            assert name in _schema.UNSUPPORTED_FIELDS
        elif name in HARMLESS:
            assert name in _schema.IGNORED_FIELDS
        else:
            assert name in ours, name


async def _serial_requests(walk: Walk) -> float:
    """Engine requests the serial lane has finished, from ``/metrics``."""
    total = 0.0
    for line in (await walk.http.get("/metrics")).text.splitlines():
        if line.startswith("trio_mlx_engine_requests_total{") and 'lane="serial"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_extension_fields_have_their_effect(walk: Walk) -> None:
    # vLLM-style fields beyond OpenAI's: each changes the answer as documented.
    greedy = _content(await walk.chat())
    assert _content(await walk.chat(temperature=2.0, seed=3, top_k=1)) == greedy
    forced_eos = {"2": 100}
    ended = await walk.chat(logit_bias=forced_eos)
    assert ended["usage"]["completion_tokens"] == 1
    held = await walk.chat(logit_bias=forced_eos, min_tokens=3, max_tokens=8)
    assert held["usage"]["completion_tokens"] == 4
    ignored = await walk.chat(logit_bias=forced_eos, ignore_eos=True, max_tokens=3)
    assert (ignored["usage"]["completion_tokens"], ignored["choices"][0]["finish_reason"]) == (
        3,
        "length",
    )
    stop = greedy[4:7]
    kept = await walk.chat(stop=[stop], include_stop_str_in_output=True)
    assert _content(kept) == greedy[: greedy.index(stop) + len(stop)]
    # kv_bits runs the request in the serial lane (a quantized cache does not batch).
    before = await _serial_requests(walk)
    await walk.chat(kv_bits=4, kv_group_size=32)
    assert await _serial_requests(walk) == before + 1
    unknown = await walk.post("/v1/chat/completions", {"messages": USER, "frobnicate": 1})
    assert unknown.status_code == 400
    assert unknown.json()["error"] == {
        "message": unknown.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": "frobnicate",
        "code": "unsupported_parameter",
    }


def _template_body(walk: Walk, **fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 1, **fields}


async def test_chat_template_kwargs_reach_the_template(tiny_model_path: Path) -> None:
    template = (
        "{{ greeting | default('') }}{{ reasoning_effort | default('') }}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    settings = Settings(chat_template_args={"greeting": "Good morning to you all. "})
    async with (
        live_server(tiny_model_path, settings, chat_template=template) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        walk = Walk(server, http)
        default = await walk.chat(max_tokens=1)
        mine = await walk.chat(max_tokens=1, chat_template_kwargs={"greeting": "Hi. "})
        none = await walk.chat(max_tokens=1, chat_template_kwargs={"greeting": ""})
        encode = server.engine.encode
        assert default["usage"]["prompt_tokens"] == len(
            encode("Good morning to you all. " + "Say something.")
        )
        assert mine["usage"]["prompt_tokens"] == len(encode("Hi. Say something."))
        assert none["usage"]["prompt_tokens"] == len(encode("Say something."))
        counted = await http.post(
            "/tokenize", json={"messages": USER, "chat_template_kwargs": {"greeting": "Hi. "}}
        )
        assert counted.json()["count"] == mine["usage"]["prompt_tokens"]
        # A template that reads reasoning_effort gets it.
        effort = await walk.chat(max_tokens=1, reasoning_effort="high", chat_template_kwargs={})
        expected = encode("Good morning to you all. high" + "Say something.")
        assert effort["usage"]["prompt_tokens"] == len(expected)
        for bad in ({"tools": []}, "enable_thinking"):
            await walk.refused(
                "/v1/chat/completions", "chat_template_kwargs", bad, {"messages": USER}
            )


async def test_the_model_answers_to_every_name_and_lists_the_served_ones(
    tiny_model_path: Path,
) -> None:
    from trio_mlx_http._cli import build_parser
    from trio_mlx_http._server.run import model_names, settings_from

    assert model_names("mlx-community/Some-Model", None) == (
        "mlx-community/Some-Model",
        ("Some-Model",),
    )
    path = str(tiny_model_path)
    args = build_parser().parse_args(
        ["serve", "--model", path, "--served-model-name", "first", "--served-model-name", "second"]
    )
    settings = settings_from(args)
    async with (
        live_server(tiny_model_path, settings) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        walk = Walk(server, http)
        listed = (await http.get("/v1/models")).json()["data"]
        assert [card["id"] for card in listed] == ["first", "second"]
        for name in ("first", "second", path, tiny_model_path.name):
            assert (await walk.chat(model=name, max_tokens=1))["model"] == "first"
            if not name.startswith("/"):  # an absolute path is no URL segment
                # A listed name is its own card; another alias is the model's.
                card = (await http.get(f"/v1/models/{name}")).json()
                assert card["id"] == ("second" if name == "second" else "first")
        assert (
            await walk.post("/v1/chat/completions", _template_body(walk, model="x"))
        ).status_code == 404
    plain = settings_from(build_parser().parse_args(["serve", "--model", path]))
    assert (plain.model_name, plain.model_aliases) == (tiny_model_path.name, (path,))


def test_kv_and_cache_flags_reach_the_settings_and_the_engine() -> None:
    from trio_mlx_http._cli import build_parser
    from trio_mlx_http._server.run import _engine_settings, settings_from

    args = build_parser().parse_args(
        [
            "serve",
            "--kv-bits",
            "4",
            "--kv-group-size",
            "32",
            "--prompt-cache-bytes",
            "512M",
            "--grammar-cache-bytes",
            "64M",
            "--chat-template-args",
            '{"enable_thinking": false}',
            "--reasoning-markers",
            "<think>,</think>",
        ]
    )
    settings = settings_from(args)
    assert (settings.kv_bits, settings.kv_group_size) == (4, 32)
    assert settings.chat_template_args == {"enable_thinking": False}
    assert settings.reasoning_markers == ("<think>", "</think>")
    assert _engine_settings(args).prompt_cache_bytes == 512 * 1024 * 1024
    assert _engine_settings(args).grammar_cache_bytes == 64 * 1024 * 1024
    # Requests that leave kv_bits out take the server's.
    request = _schema.parse_chat({"messages": USER}, settings)
    assert (request.params.kv_bits, request.params.kv_group_size) == (4, 32)
    defaults = build_parser().parse_args(["serve"])
    assert _engine_settings(defaults).prompt_cache_bytes == EngineSettings().prompt_cache_bytes
    assert _engine_settings(defaults).grammar_cache_bytes == 256 * 1024 * 1024
    assert settings_from(defaults).reasoning_markers is None
    off = build_parser().parse_args(["serve", "--reasoning-markers", "off"])
    assert settings_from(off).reasoning_markers is False
    for bad in (
        ["--kv-bits", "5"],
        ["--prompt-cache-bytes", "lots"],
        ["--grammar-cache-bytes", "lots"],
        ["--chat-template-args", "[1]"],
        ["--reasoning-markers", "<think>"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


async def test_echoed_prompt_logprobs_match_the_models_own(walk: Walk) -> None:
    # Score a prompt plus its greedy continuation: the continuation's scores are the
    # logprobs generation reported, token for token.
    engine = walk.server.engine
    prompt = engine.encode("The quick brown fox")
    # No logit_bias: generation's logprobs are taken after the processors.
    params = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=3)
    made = await engine.complete(prompt, params)
    assert made.logprobs is not None
    assert made.token_ids
    body = {"prompt": prompt + list(made.token_ids), "echo": True, "logprobs": 3, "max_tokens": 0}
    response = await walk.post("/v1/completions", body)
    scored = response.json()["choices"][0]["logprobs"]
    assert len(scored["token_logprobs"]) == len(prompt) + len(made.token_ids)
    for got, want in zip(scored["token_logprobs"][len(prompt) :], made.logprobs, strict=True):
        assert abs(got - want.logprob) < 1e-3
    tops = scored["top_logprobs"][len(prompt) :]
    for got, want in zip(tops, made.logprobs, strict=True):
        assert sorted(got.values(), reverse=True) == pytest.approx(
            [lp for _, lp in want.top], abs=1e-3
        )
