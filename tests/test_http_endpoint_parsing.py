"""The Responses and Messages parsers: any JSON body is a request or an InvalidRequest, never a crash."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from trio_mlx import InvalidRequest
from trio_mlx_http._anthropic import messages as _anthropic
from trio_mlx_http._responses import request as _response_request
from trio_mlx_http._responses.store import ResponseStore, StoredResponse
from trio_mlx_http._settings import Settings

_SCALARS = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-3, 3) | st.text(max_size=8)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
_TYPES = st.sampled_from(
    ["message", "function_call", "function_call_output", "text", "input_text", "tool_use",
     "tool_result", "image", "reasoning", "function", "custom", "auto", "none", "json_schema"]
)  # fmt: skip


def _shaped(keys: list[str]) -> st.SearchStrategy[Any]:
    """Objects that look like API items: known keys with plausible or random values."""
    item = st.fixed_dictionaries(
        {},
        optional={
            "type": _TYPES,
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", 3]),
            "content": _JSON | st.text(max_size=5),
            "text": _JSON,
            **dict.fromkeys(keys, _JSON),
        },
    )
    return st.lists(item, max_size=3) | _JSON


_RESPONSES_BODY = st.fixed_dictionaries(
    {},
    optional={
        "input": st.text(max_size=5)
        | _shaped(["call_id", "name", "arguments", "output", "id", "status"]),
        "instructions": _JSON,
        "max_output_tokens": _JSON,
        "temperature": _JSON,
        "top_p": _JSON,
        "tools": _shaped(["name", "parameters", "description"]),
        "tool_choice": _JSON | _TYPES,
        "text": _JSON | st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": _TYPES})}),
        "stream": _JSON,
        "store": _JSON,
        "previous_response_id": st.sampled_from(["resp_1", "resp_2"]) | _JSON,
        "metadata": _JSON,
        **dict.fromkeys(_response_request.REFUSED, _JSON),
    },
)

_MESSAGES_BODY = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": _JSON,
        "system": _JSON | _shaped([]),
        "messages": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.sampled_from(["user", "assistant", "system"]) | _JSON,
                    "content": st.text(max_size=5)
                    | _shaped(["id", "name", "input", "tool_use_id", "is_error"]),
                },
            ),
            max_size=3,
        )
        | _JSON,
        "stop_sequences": _JSON,
        "temperature": _JSON,
        "top_p": _JSON,
        "top_k": _JSON,
        "tools": _shaped(["name", "description", "input_schema"]),
        "tool_choice": _JSON | st.fixed_dictionaries({"type": _TYPES}),
        "stream": _JSON,
        **dict.fromkeys(_anthropic.REFUSED, _JSON),
    },
)


def _refusal(parse: Callable[[], object]) -> InvalidRequest | None:
    """Run ``parse``; the InvalidRequest it raised, if any (anything else fails the test)."""
    try:
        parse()
    except InvalidRequest as error:
        return error
    return None


@settings(max_examples=100)
@given(_RESPONSES_BODY)
def test_any_responses_body_parses_or_is_a_400_naming_a_field(body: dict[str, Any]) -> None:
    store = ResponseStore(capacity=4)
    store.put("resp_1", StoredResponse(body={}, conversation=({"role": "user", "content": "x"},)))
    refused = _refusal(lambda: _response_request.parse_responses(body, Settings(), store))
    if refused is not None:
        assert refused.param
        assert refused.param.split(".")[0].split("[")[0] in {*body, "input"}


@settings(max_examples=100)
@given(_MESSAGES_BODY)
def test_any_messages_body_parses_or_is_a_400_naming_a_field(body: dict[str, Any]) -> None:
    refused = _refusal(lambda: _anthropic.parse_messages(body, Settings()))
    if refused is None:
        parsed = _anthropic.parse_messages(body, Settings())
        assert parsed.generation.params.max_tokens == body["max_tokens"]
    else:
        assert refused.param
        assert refused.param.split(".")[0].split("[")[0] in {*body, "max_tokens", "messages"}
