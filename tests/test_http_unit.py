"""The HTTP layer's pure parts, without an engine: request parsing, SSE framing,
response shapes, tool-call extraction, the adapter folder check, error bodies."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools
from werkzeug.exceptions import NotFound as RouteNotFound

from trio_mlx import (
    EngineOverloaded,
    EngineSettings,
    GenerationResult,
    InvalidRequest,
    TokenLogprob,
)
from trio_mlx_http._common import sse as _sse
from trio_mlx_http._common.tools import ToolCallExtractor
from trio_mlx_http._errors import Forbidden, error_body, error_response
from trio_mlx_http._openai import schema as _schema
from trio_mlx_http._openai import shapes as _openai
from trio_mlx_http._server.app import _adapter_path
from trio_mlx_http._settings import Settings

SETTINGS = Settings()
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields: object) -> _schema.GenerationRequest:
    return _schema.parse_chat({"messages": USER, **fields}, SETTINGS)


def _expect_rejection(param: str, body: dict[str, object], *, chat: bool = True) -> InvalidRequest:
    parse = _schema.parse_chat if chat else _schema.parse_completion
    with pytest.raises(InvalidRequest) as caught:
        parse(body, SETTINGS)
    assert caught.value.param == param, caught.value.message
    return caught.value


def test_harmless_fields_are_ignored_and_defaults_apply() -> None:
    request = _chat(metadata={"k": "v"}, store=False, user="u1", service_tier="auto")
    assert request.params.max_tokens == SETTINGS.max_tokens
    assert request.params.temperature == 0.0
    assert (request.n, request.stream, request.include_usage) == (1, False, False)


@pytest.mark.parametrize("chat", [True, False])
def test_unknown_and_unsupported_fields_are_refused_by_name(chat: bool) -> None:
    body: dict[str, object] = {"messages": USER} if chat else {"prompt": "hi"}
    for name, value in [("frobnicate", True), ("use_beam_search", True)]:
        error = _expect_rejection(name, {**body, name: value}, chat=chat)
        assert error.code == "unsupported_parameter"
    # null means absent, for every field.
    parse = _schema.parse_chat if chat else _schema.parse_completion
    parse({**body, "frobnicate": None}, SETTINGS)


def test_null_fields_mean_absent() -> None:
    request = _chat(temperature=None, max_tokens=None, stop=None, n=None)
    assert request.params.max_tokens == SETTINGS.max_tokens


@pytest.mark.parametrize(
    ("param", "fields"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_completion_tokens", {"max_completion_tokens": -1}),
        ("temperature", {"temperature": "hot"}),
        ("temperature", {"temperature": -1}),
        ("top_p", {"top_p": 0}),
        ("n", {"n": 0}),
        ("n", {"n": True}),
        ("stream", {"stream": "yes"}),
        ("stop", {"stop": 3}),
        ("logit_bias", {"logit_bias": {"x": 1}}),
        ("seed", {"seed": 1.5}),
        ("top_logprobs", {"top_logprobs": 3}),
        ("tools", {"tools": "f"}),
        ("tools[0]", {"tools": [{"type": "function"}]}),
        ("tool_choice", {"tool_choice": 3}),
        ("model", {"model": 7}),
        ("stream_options", {"stream_options": {"include_usage": "y"}}),
    ],
)
def test_bad_chat_field_is_named(param: str, fields: dict[str, object]) -> None:
    _expect_rejection(param, {"messages": USER, **fields})


@pytest.mark.parametrize(
    ("param", "messages"),
    [
        ("messages", None),
        ("messages", []),
        ("messages", "hi"),
        ("messages[0]", ["hi"]),
        ("messages[0].role", [{"role": "wizard", "content": "x"}]),
        ("messages[0].content", [{"role": "user", "content": 5}]),
        ("messages[0].content", [{"role": "user", "content": [{"type": "image_url"}]}]),
    ],
)
def test_bad_messages_are_named(param: str, messages: object) -> None:
    _expect_rejection(param, {"messages": messages})


def test_content_parts_join_into_text() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    request = _schema.parse_chat({"messages": [{"role": "user", "content": parts}]}, SETTINGS)
    assert request.prompts == ([{"role": "user", "content": "Hello, world"}],)


def test_assistant_tool_call_arguments_become_a_mapping_for_the_template() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    request = _schema.parse_chat({"messages": messages}, SETTINGS)
    assistant: Any = request.prompts[0][1]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert _chat(max_tokens=5, max_completion_tokens=7).params.max_tokens == 7


def test_tool_choice_none_drops_the_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert _chat(tools=tools, tool_choice="none").tools is None
    assert _chat(tools=tools).tools == tools


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ("hi",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ([1, 2, 3],)),
        ([[1], [2, 3]], ([1], [2, 3])),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: tuple[object, ...]) -> None:
    assert _schema.parse_completion({"prompt": prompt}, SETTINGS).prompts == expected


@pytest.mark.parametrize("prompt", [None, "", [], [""], [-1], [1.5], [[1], []], {"a": 1}, [True]])
def test_bad_completion_prompt_is_named(prompt: object) -> None:
    _expect_rejection("prompt", {"prompt": prompt}, chat=False)


def test_completion_logprobs_is_the_number_of_alternatives() -> None:
    params = _schema.parse_completion({"prompt": "x", "logprobs": 3}, SETTINGS).params
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    error = _expect_rejection("logprobs", {"prompt": "x", "logprobs": 99}, chat=False)
    assert "logprobs" in error.message


def test_prompts_times_n_is_bounded() -> None:
    _expect_rejection("n", {"prompt": ["a", "b"], "n": 9}, chat=False)


@pytest.mark.parametrize(
    "data", [b"", b"{", b"[1]", b'"x"', b"\xff\xfe", b"[" * 100_000, b"{'a': 1}"]
)
def test_malformed_json_is_an_invalid_request(data: bytes) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _schema.parse_json(data)
    assert caught.value.code == "invalid_json"


def test_detokenize_checks_the_vocabulary() -> None:
    assert _schema.parse_detokenize({"tokens": [0, 9]}, 10) == [0, 9]
    for bad in ([10], [-1], ["a"], "x", None):
        with pytest.raises(InvalidRequest):
            _schema.parse_detokenize({"tokens": bad}, 10)


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "a b", 3, "x" * 200])
def test_adapter_names_are_plain(name: object) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _schema.parse_adapter_mount({"name": name, "path": "p"})
    assert caught.value.param == "name"


def test_sse_event_is_one_data_line() -> None:
    assert (
        _sse.event({"a": "line\nbreak", "b": "é"})
        == 'data: {"a":"line\\nbreak","b":"é"}\n\n'.encode()
    )
    assert _sse.DONE == b"data: [DONE]\n\n"


def test_error_body_has_openai_shape() -> None:
    body = error_body(InvalidRequest("bad top_p", param="top_p"))
    assert body == {
        "error": {
            "message": "bad top_p",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        }
    }
    assert error_body(RuntimeError("secret detail"))["error"]["message"] == "internal server error"
    assert error_body(RouteNotFound())["error"]["type"] == "not_found_error"


def test_overloaded_answers_429_with_retry_after() -> None:
    response = error_response(EngineOverloaded("full", retry_after=2.4))
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "2"


class _Tokens:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_chat_and_completion_logprob_shapes() -> None:
    texts = _openai.TokenTexts(_Tokens())
    lps = (TokenLogprob(0, -0.25, ((0, -0.25), (1, float("-inf")))), TokenLogprob(2, -1.0))
    chat = _openai.chat_logprobs(lps, texts)
    assert chat["content"][0] == {
        "token": "a",
        "logprob": -0.25,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.25, "bytes": [97]},
            {"token": "b", "logprob": -9999.0, "bytes": [98]},
        ],
    }
    text = _openai.completion_logprobs(lps, texts, offset=5)
    assert text == {
        "tokens": ["a", "c"],
        "token_logprobs": [-0.25, -1.0],
        "top_logprobs": [{"a": -0.25, "b": -9999.0}, {}],
        "text_offset": [5, 6],
    }
    json.dumps(chat, allow_nan=False)


def test_usage_counts_a_shared_prompt_once() -> None:
    result = GenerationResult("stop", 10, 3, 4, "batch", 0.1, 0.2)
    assert _openai.usage([result, result], n=2) == {
        "prompt_tokens": 10,
        "completion_tokens": 6,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def _extractor() -> ToolCallExtractor:
    return ToolCallExtractor(
        start=json_tools.tool_call_start,
        end=json_tools.tool_call_end,
        parser=json_tools.parse_tool_call,
        tools=None,
    )


def test_tool_calls_are_cut_out_of_streamed_text_even_when_split() -> None:
    extractor = _extractor()
    text = 'Sure. <tool_call>{"name": "get", "arguments": {"city": "Oslo"}}</tool_call> done'
    shown, calls = [], []
    for i in range(0, len(text), 3):
        piece, found = extractor.feed(text[i : i + 3])
        shown.append(piece)
        calls.extend(found)
        assert "<" not in piece
    rest, more = extractor.finish()
    assert "".join(shown) + rest == "Sure.  done"
    assert more == []
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", {"city": "Oslo"})]
    assert extractor.called


def test_a_held_back_prefix_that_is_not_a_marker_is_released() -> None:
    extractor = _extractor()
    assert extractor.feed("a <tool") == ("a ", [])
    assert extractor.feed("kit>") == ("<toolkit>", [])


def test_an_unparseable_tool_call_is_dropped() -> None:
    extractor = _extractor()
    assert extractor.feed("<tool_call>{not json") == ("", [])
    assert extractor.finish() == ("", [])
    assert not extractor.called


def test_adapter_paths_must_stay_inside_the_folder(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    (root / "good").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    settings = Settings(adapter_dir=root)
    assert _adapter_path(settings, "good") == (root / "good").resolve()
    with pytest.raises(InvalidRequest):
        _adapter_path(settings, "../outside")
    for path in (str(tmp_path / "outside"), "escape", "/etc"):
        with pytest.raises(Forbidden):
            _adapter_path(settings, path)
    with pytest.raises(Forbidden):
        _adapter_path(Settings(), "good")


def test_streamed_tool_calls_become_indexed_deltas_and_finish_with_tool_calls() -> None:
    from trio_mlx import Delta
    from trio_mlx_http._openai.chat import _ChatFormat

    fmt = _ChatFormat(
        _openai.Envelope.chat("m", chunk=True),
        _openai.TokenTexts(_Tokens()),
        [_extractor()],
        [None],
    )
    pieces = ["Let me check. <tool_", 'call>{"name": "now", "arguments": {}}</tool_call>']
    events = [e for p in pieces for e in fmt.delta(0, Delta(p, (1,)))]
    events += fmt.end(0, GenerationResult("stop", 5, 9, 0, "batch", 0.1, 0.2))
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"content": "Let me check. "}
    call = deltas[1]["tool_calls"][0]
    assert (call["index"], call["type"], call["function"]) == (
        0,
        "function",
        {"name": "now", "arguments": "{}"},
    )
    assert call["id"].startswith("call_")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "seed",
        "n",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "adapter",
        "user",
        "tools",
        "tool_choice",
    ]
)


@pytest.mark.props
@given(body=st.dictionaries(_FIELDS, _JSON, max_size=6), chat=st.booleans())
def test_any_json_body_parses_or_raises_invalid_request(
    body: dict[str, object], chat: bool
) -> None:
    parse = _schema.parse_chat if chat else _schema.parse_completion
    with contextlib.suppress(InvalidRequest):
        parse(body, SETTINGS)


def test_sse_event_stays_one_line_for_unicode_line_separators() -> None:
    import json as _json

    from trio_mlx_http._common.sse import event

    text = "a\u2028b\u2029c\x85d\ne"
    raw = event({"content": text})
    line = raw.decode()
    assert line.endswith("\n\n")
    assert len(line[:-2].splitlines()) == 1
    assert _json.loads(line[len("data: ") : -2]) == {"content": text}


def test_prompt_concurrency_flag_sets_the_engines_prefill_batch_size() -> None:
    from trio_mlx_http._cli import build_parser
    from trio_mlx_http._server.run import _engine_settings

    args = build_parser().parse_args(["serve", "--prompt-concurrency", "3", "--max-batch", "16"])
    settings = _engine_settings(args)
    assert (settings.prefill_batch_size, settings.max_batch) == (3, 16)
    default = EngineSettings().prefill_batch_size
    assert _engine_settings(build_parser().parse_args(["serve"])).prefill_batch_size == default


def test_chat_template_flag_takes_text_or_a_file(tmp_path: Path) -> None:
    from trio_mlx_http._cli import build_parser
    from trio_mlx_http._server.run import _engine_settings

    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    file = tmp_path / "template.jinja"
    file.write_text(template)
    for value in (template, str(file)):
        for command in (["serve"], ["generate", "Hello"]):
            args = build_parser().parse_args([*command, "--chat-template", value])
            assert _engine_settings(args).chat_template == template
    assert _engine_settings(build_parser().parse_args(["serve"])).chat_template is None


def test_engine_errors_carry_a_machine_readable_code() -> None:
    from trio_mlx import EngineClosed, GenerationFailed, NotFound

    assert error_body(EngineClosed("closed"))["error"]["code"] == "engine_closed"
    assert error_body(GenerationFailed("boom"))["error"]["code"] == "generation_failed"
    assert error_body(NotFound("no adapter", param="adapter"))["error"]["code"] == "not_found"
    assert error_body(NotFound("gone", code="model_not_found"))["error"]["code"] == (
        "model_not_found"
    )


def test_reasoning_is_split_even_when_markers_arrive_in_pieces() -> None:
    from trio_mlx_http._common.reasoning import ReasoningSplitter

    text = "<think>\nPlan it.</think>\n\nThe answer. <thi"
    splitter = ReasoningSplitter("<think>", "</think>")
    reasoning, content = "", ""
    for char in text:
        r, c = splitter.feed(char)
        assert "<" not in r
        reasoning, content = reasoning + r, content + c
    r, c = splitter.feed("", final=True)
    # Leading whitespace of each part is dropped; a marker's prefix at the end is text.
    assert (reasoning + r, content + c) == ("Plan it.", "The answer. <thi")
    opened = ReasoningSplitter.opened("<think>", "</think>")
    assert opened.feed("more thought</think>done", final=True) == ("more thought", "done")
    plain = ReasoningSplitter("<think>", "</think>")
    assert plain.feed("no reasoning at all", final=True) == ("", "no reasoning at all")


def test_best_of_returns_the_most_likely_candidates() -> None:
    from trio_mlx import Completion
    from trio_mlx_http._openai.chat import _best

    def candidate(*logprobs: float) -> Completion:
        result = GenerationResult("length", 3, len(logprobs), 0, "batch", 0.0, 0.0)
        lps = tuple(TokenLogprob(7, lp) for lp in logprobs)
        return Completion("x" * len(logprobs), (7,) * len(logprobs), lps, result)

    # Two prompts, three candidates each, two returned per prompt, best first.
    first = [candidate(-3.0, -1.0), candidate(-0.5), candidate(-1.0, -1.0)]
    second = [candidate(-9.0), candidate(-0.1, -0.1), candidate(-4.0)]
    request = _schema.parse_completion({"prompt": ["a", "b"], "n": 2, "best_of": 3}, SETTINGS)
    expected = [first[1], first[2], second[1], second[2]]
    # Not asked for, the logprobs used for ranking are not sent.
    chosen = _best(first + second, 3, request)
    assert chosen == [attrs.evolve(c, logprobs=None) for c in expected]
    asked = _schema.parse_completion(
        {"prompt": ["a", "b"], "n": 2, "best_of": 3, "logprobs": 0}, SETTINGS
    )
    assert _best(first + second, 3, asked) == expected


@given(
    text=st.text(),
    model=st.text(max_size=12),
    index=st.integers(min_value=0, max_value=15),
)
def test_a_text_event_is_the_whole_event_encoded_at_once(text: str, model: str, index: int) -> None:
    envelope = _openai.Envelope.chat(model, chunk=True)

    def chunk(content: str) -> dict[str, Any]:
        choice = {"index": index, "delta": {"content": content}, "logprobs": None}
        return envelope.body([{**choice, "finish_reason": None}])

    template = _sse.TextEvent(chunk("before"), ("choices", 0, "delta", "content"))
    assert template.fill(text) == _sse.event(chunk(text))


def test_the_sse_parser_skips_keep_alive_comments_and_rejects_other_blocks() -> None:
    from trio_mlx_http.testing import sse_events

    body = b': keep-alive\n\ndata: {"a": 1}\n\n: keep-alive\n\ndata: [DONE]\n\n'
    assert sse_events(body) == [{"a": 1}, "[DONE]"]
    for bad, why in (
        (b": one\n: two\n\n", "not one data line"),
        (b'event: x\ndata: {"a": 1}\n\n', "not one data line"),
        (b'data: {"a": 1}\n', "truncated stream"),
    ):
        with pytest.raises(ValueError, match=why):
            sse_events(bad)
