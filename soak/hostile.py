"""Hostile input: hand-picked nasty bodies, Hypothesis-generated bodies, and schemathesis.

Every answer must be below 500 (and a 4xx must be OpenAI's error shape); the
server must answer ``/health`` afterwards. Generation stays short: the server
under test runs with ``--max-tokens 4``, and a request that asks for more is
cut off by the client after a few seconds (a ``slow`` outcome, not a failure:
the disconnect cancels it on the server).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import attrs
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

POST_PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/adapters"]
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "stop", "seed", "n", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options",
    "adapter", "tools", "tool_choice", "tokens", "name", "path", "user",
]  # fmt: skip
_HUGE_INT = "1" + "0" * 5000  # past Python's int-parsing digit limit
_DEEP = 100_000


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


#: (name, path, raw body): one each of the classic ways to hurt a JSON API.
CASES: list[tuple[str, str, bytes]] = [
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}'),
    ("invalid utf-8 key", "/v1/chat/completions", b'{"\xc3\x28": 1}'),
    ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("lone surrogate chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
    ("NaN temperature", "/v1/completions", b'{"prompt": "a", "temperature": NaN}'),
    ("Infinity top_p", "/v1/completions", b'{"prompt": "a", "top_p": Infinity}'),
    ("-Infinity penalty", "/v1/completions", b'{"prompt": "a", "repetition_penalty": -Infinity}'),
    ("1e400 max_tokens", "/v1/completions", b'{"prompt": "a", "max_tokens": 1e400}'),
    ("huge int max_tokens", "/v1/completions", f'{{"prompt": "a", "max_tokens": {_HUGE_INT}}}'.encode()),
    ("huge int seed", "/v1/completions", f'{{"prompt": "a", "seed": {_HUGE_INT}}}'.encode()),
    ("2**64 seed", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "seed": 18446744073709551616}'),
    ("negative seed", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "seed": -1}'),
    ("deep nesting", "/v1/completions", _nested(_DEEP)),
    ("deep nesting chat", "/v1/chat/completions", b'{"messages": ' + b"[" * _DEEP + b"]" * _DEEP + b"}"),
    ("deep objects", "/tokenize", b'{"prompt": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}"),
    ("enormous prompt", "/v1/completions", json.dumps({"prompt": "a " * 1_500_000, "max_tokens": 1}).encode()),
    ("enormous stop", "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 2, "stop": "x" * 1_000_000}).encode()),
    ("5000 stop strings", "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 2, "stop": [f"s{i}" for i in range(5000)]}).encode()),
    ("5000 stop strings chat", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stop": ["x"] * 5000}).encode()),
    ("logit_bias word key", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"abc": 1}}'),
    ("logit_bias negative key", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"-1": 1}}'),
    ("logit_bias key past vocab", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"99999999": 1}}'),
    ("logit_bias huge key", "/v1/completions", f'{{"prompt": "a", "max_tokens": 2, "logit_bias": {{"{_HUGE_INT}": 1}}}}'.encode()),
    ("logit_bias float key", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"1e3": 1}}'),
    ("logit_bias NaN value", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"5": NaN}}'),
    ("logit_bias 1e308 value", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"5": 1e308}}'),
    ("logit_bias 100k keys", "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(100_000)}}).encode()),
    ("max_tokens 1e9", "/v1/completions", b'{"prompt": "a", "max_tokens": 1000000000, "stream": true}'),
    ("max_tokens past context", "/v1/completions", json.dumps({"prompt": [5] * 2040, "max_tokens": 10**9, "stream": True}).encode()),
    ("prompt past context", "/v1/completions", json.dumps({"prompt": [5] * 5000, "max_tokens": 2}).encode()),
    ("token id past vocab", "/v1/completions", b'{"prompt": [999999999], "max_tokens": 2}'),
    ("negative token id", "/v1/completions", b'{"prompt": [-5], "max_tokens": 2}'),
    ("detokenize huge id", "/detokenize", f'{{"tokens": [{_HUGE_INT}]}}'.encode()),
    ("detokenize 2**63", "/detokenize", b'{"tokens": [9223372036854775808]}'),
    ("n 1e6", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "n": 1000000}'),
    ("top_logprobs 1e6", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 1000000}'),
    ("logprobs 1e6", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "logprobs": 1000000}'),
    ("top_k 2**63", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "top_k": 9223372036854775808}'),
    ("10k prompts", "/v1/completions", json.dumps({"prompt": ["a"] * 10_000, "max_tokens": 1}).encode()),
    ("10k messages", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}] * 10_000, "max_tokens": 1}).encode()),
    ("unknown role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "a"}], "max_tokens": 2}'),
    ("adapter path traversal", "/v1/adapters", b'{"name": "x", "path": "../../../../etc"}'),
    ("adapter absolute path", "/v1/adapters", b'{"name": "x", "path": "/etc"}'),
    ("adapter name traversal", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "model": "../../etc/passwd"}'),
    ("empty body", "/v1/completions", b""),
    ("not json", "/v1/completions", b"hello"),
    ("json null", "/v1/completions", b"null"),
    ("json array", "/v1/chat/completions", b"[1, 2, 3]"),
    ("json string", "/tokenize", b'"prompt"'),
    ("duplicate keys", "/v1/completions", b'{"prompt": "a", "max_tokens": 2, "max_tokens": "x"}'),
    ("NUL in prompt", "/v1/completions", b'{"prompt": "a\\u0000b", "max_tokens": 2}'),
    ("special tokens as text", "/v1/completions", b'{"prompt": "<|im_end|><|endoftext|>", "max_tokens": 2}'),
    ("40k tool calls", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(40_000)]}], "max_tokens": 1}).encode()),
    ("schema 501 optional properties", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(501)}}}}}).encode()),
    ("schema required self-reference", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}}}}).encode()),
    ("schema with a stop string", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 8, "stop": ["}"], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}}}}).encode()),
]  # fmt: skip


#: Cases that only a 4xx answers correctly: accepting them is a bug even without a crash.
MUST_REJECT = frozenset(
    {
        "logit_bias key past vocab", "logit_bias negative key", "logit_bias word key",
        "prompt past context", "token id past vocab", "negative token id", "NaN temperature",
        "adapter path traversal", "adapter absolute path", "not json", "invalid utf-8",
        "40k tool calls", "schema 501 optional properties", "schema required self-reference",
        "schema with a stop string",
    }
)  # fmt: skip


@attrs.define
class Tally:
    """Counts of every answer, and the first problems seen."""

    statuses: Counter[str] = attrs.field(factory=Counter)
    problems: list[str] = attrs.field(factory=list)
    cases: int = 0

    def record(self, name: str, status: int | str, body: bytes = b"") -> None:
        self.cases += 1
        self.statuses[str(status)] += 1
        problem = ""
        if name in MUST_REJECT and isinstance(status, int) and status < 400:
            problem = f"{status}: accepted, must be rejected"
        elif isinstance(status, int) and status >= 500:
            problem = f"{status}: {body[:300]!r}"
        elif isinstance(status, int) and 400 <= status < 500 and status != 413:
            # Anthropic's Messages route answers in Anthropic's error shape.
            anthropic = name.endswith(("/v1/messages", "/v1/messages/count_tokens"))
            shape = {"message", "type"} if anthropic else {"message", "type", "param", "code"}
            try:
                error = json.loads(body)["error"]
                if set(error) != shape:
                    problem = f"{status}: error shape {sorted(error)}"
            except (ValueError, KeyError, TypeError):
                problem = f"{status}: not an error of its API: {body[:200]!r}"
        if problem and len(self.problems) < 20:
            self.problems.append(f"{name}: {problem}")

    @property
    def server_errors(self) -> int:
        return sum(
            n for status, n in self.statuses.items() if status.isdigit() and int(status) >= 500
        )


def post(http: httpx.Client, tally: Tally, name: str, path: str, raw: bytes) -> None:
    """POST ``raw``; read at most a few seconds of the answer (a stream is closed early)."""
    try:
        with http.stream(
            "POST", path, content=raw, headers={"Content-Type": "application/json"}
        ) as response:
            body = b""
            if response.status_code != 200 or "event-stream" not in response.headers.get(
                "content-type", ""
            ):
                body = response.read()
            tally.record(name, response.status_code, body)
    except httpx.TimeoutException:
        tally.record(name, "slow")
    except httpx.HTTPError as error:
        tally.record(name, "transport_error")
        if len(tally.problems) < 20:
            tally.problems.append(f"{name}: {error!r}")


_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["\ud800", "<|im_end|>", "\x00", "💥" * 50, "a" * 100_000]),
)  # fmt: skip
_json = st.recursive(
    _json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_valid = {
    "messages": st.just([{"role": "user", "content": "hi"}]),
    "prompt": st.sampled_from(["Hello", [1, 2, 3], ["a", "b"]]),
    "max_tokens": st.integers(0, 4),
    "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(), max_size=3),
    "stop": st.lists(st.text(max_size=3), max_size=50),
    "tokens": st.lists(st.integers(-3, 4000), max_size=5),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A POST path and a body: mostly plausible fields with hostile values, sometimes mangled bytes."""
    path = draw(st.sampled_from(POST_PATHS))
    names = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=6, unique=True))
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        # A body the server would accept, so one hostile field at a time reaches the engine.
        body = {"messages" if path == "/v1/chat/completions" else "prompt": "Hello"}
        body["max_tokens"] = draw(st.integers(1, 4))
        names = names[:1]
    for name in names:
        if name in _valid and draw(st.booleans()):
            body[name] = draw(_valid[name])
        else:
            body[name] = draw(_json)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)  # hostile, not slow
    raw = json.dumps(body, allow_nan=True).encode()
    mangle = draw(st.sampled_from(["none", "none", "none", "byte", "truncate"]))
    if mangle == "byte" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([draw(st.sampled_from([0xFF, 0xC3, 0x80, 0x00]))]) + raw[at + 1 :]
    elif mangle == "truncate":
        raw = raw[: draw(st.integers(0, len(raw)))]
    return path, raw


def run_case(url: str, tally: Tally, case: tuple[str, str, bytes], timeout: float = 10.0) -> None:
    """One hand-picked case, on its own connection."""
    with httpx.Client(base_url=url, timeout=timeout) as http:
        post(http, tally, *case)


def run_hypothesis(url: str, examples: int, timeout: float = 10.0) -> Tally:
    """``examples`` Hypothesis-generated bodies (no shrinking: every case is counted)."""
    tally = Tally()
    with httpx.Client(base_url=url, timeout=timeout) as http:

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=["generate"])  # fmt: skip
        @given(bodies())
        def one(case: tuple[str, bytes]) -> None:
            post(http, tally, "hypothesis", *case)

        one()
    return tally


def run_schemathesis(url: str, examples: int, timeout: float = 10.0) -> Tally:
    """schemathesis against ``/openapi.json``: ``examples`` cases per operation."""
    import schemathesis

    tally = Tally()
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    schema.config.generation.update(
        modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    )
    for result in schema.get_all_operations():
        _fuzz_operation(result.ok(), url, examples, timeout, tally)
    return tally


def _fuzz_operation(operation: Any, url: str, examples: int, timeout: float, tally: Tally) -> None:
    name = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=["generate"])  # fmt: skip
    @given(operation.as_strategy())
    def one(case: Any) -> None:
        for field in ("max_tokens", "max_output_tokens"):
            if isinstance(case.body, dict) and isinstance(case.body.get(field), int):
                case.body[field] = min(case.body[field], 4)
        try:
            response = case.call(base_url=url, timeout=timeout)
        except Exception as error:  # requests' timeouts and resets
            slow = "timed out" in str(error).lower()
            tally.record(name, "slow" if slow else "transport_error")
            return
        tally.record(name, response.status_code, response.content)

    one()


def summary(tally: Tally) -> dict[str, Any]:
    """A JSON-ready view of a tally."""
    return {
        "cases": tally.cases,
        "statuses": dict(sorted(tally.statuses.items())),
        "5xx": tally.server_errors,
        "problems": tally.problems,
    }
