"""Requests the harness sends, and the checks that every answer is whole and single.

An answer is *ok* when it is exactly one complete, well-formed OpenAI response:
one choice, a finish reason, ``usage.completion_tokens`` equal to ``max_tokens``
when the reason is ``length`` (at most that when it is ``stop``), and as many
per-token logprobs as ``completion_tokens`` -- in a stream that last rule is
what catches a duplicated or a missing chunk.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

import attrs

from trio_mlx_http.testing import NO_EOS, sse_events

#: The bundled LoRA adapter, mounted under this name.
ADAPTER = "shout"


@attrs.frozen
class Spec:
    """One generation request."""

    chat: bool
    stream: bool
    max_tokens: int
    seed: int | None = None
    model: str | None = None
    stop: str | None = None
    no_eos: bool = False
    prompt: str = "Hello"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict[str, Any]:
        """The JSON body: always with per-token logprobs, and usage when streaming."""
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "stream": self.stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
            body["logprobs"] = True
        else:
            body["prompt"] = self.prompt
            body["logprobs"] = 0
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name in ("seed", "model", "stop"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.no_eos:
            body["logit_bias"] = NO_EOS
        return body


def random_spec(rng: random.Random, *, adapter_share: float = 0.0) -> Spec:
    """A request of the load mix: chat or text, streamed or not, batched or seeded serial."""
    return Spec(
        chat=rng.random() < 0.5,
        stream=rng.random() < 0.5,
        max_tokens=rng.randint(1, 24),
        seed=rng.randrange(1000) if rng.random() < 0.2 else None,
        model=ADAPTER if rng.random() < adapter_share else None,
        stop=rng.choice([None, None, None, "\n\n", "."]),
        no_eos=rng.random() < 0.5,
        prompt=rng.choice(["Hello", "The quick brown fox", "def main():", "Python is"]),
    )


@attrs.frozen
class Answer:
    """How one request ended: ``kind`` is ok, rejected (429), not_mounted, error or bad."""

    kind: str
    status: int
    id: str | None = None
    tokens: int = 0
    detail: str = ""
    #: Stream-level duplicates (a second finish, usage or [DONE]).
    duplicates: int = 0
    #: Ended at an EOS token that usage counts but no logprob (nor text) carries.
    eos_counted: bool = False


def _error_kind(spec: Spec, status: int, payload: Any) -> Answer:
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return Answer("bad", status, detail=f"not an OpenAI error: {payload!r:.200}")
    if status == 429 and error["type"] == "rate_limit_error":
        return Answer("rejected", status)
    if status == 404 and spec.model == ADAPTER and error["type"] == "not_found_error":
        # The churn task unmounted the adapter before the request reached it:
        # a correct answer (model_not_found at parsing, or the engine's NotFound).
        return Answer("not_mounted", status)
    return Answer("error", status, detail=f"{error['type']}/{error['code']}: {error['message']}")


def _finish_ok(spec: Spec, reason: Any, tokens: int) -> str:
    if reason == "length" and tokens == spec.max_tokens:
        return ""
    if reason == "stop" and 0 <= tokens <= spec.max_tokens:
        return ""
    return f"finish_reason={reason!r} with {tokens} tokens for max_tokens={spec.max_tokens}"


def _eos_counted(reason: Any, seen: int, tokens: int) -> bool:
    """usage counts the EOS token that ended a ``stop`` choice; no logprob carries it."""
    return reason == "stop" and seen == tokens - 1


def _logprob_tokens(spec: Spec, logprobs: Any) -> int:
    if not logprobs:
        return 0
    return len(logprobs["content"] if spec.chat else logprobs["tokens"])


def check_whole(spec: Spec, status: int, raw: bytes) -> Answer:
    """Check a non-streaming answer."""
    try:
        payload = json.loads(raw)
    except ValueError:
        return Answer("bad", status, detail=f"not JSON: {raw[:200]!r}")
    if status != 200:
        return _error_kind(spec, status, payload)
    kind = "chat.completion" if spec.chat else "text_completion"
    choices = payload.get("choices")
    if payload.get("object") != kind or not isinstance(choices, list) or len(choices) != 1:
        return Answer("bad", status, detail=f"bad envelope: {payload!r:.300}")
    choice = choices[0]
    tokens = payload["usage"]["completion_tokens"]
    problem = _finish_ok(spec, choice["finish_reason"], tokens)
    seen = _logprob_tokens(spec, choice["logprobs"])
    eos = _eos_counted(choice["finish_reason"], seen, tokens)
    if not problem and seen != tokens and not eos:
        problem = f"{seen} logprobs for {tokens} tokens"
    if not problem and spec.model is not None and payload["model"] != spec.model:
        problem = f"answered as {payload['model']!r}, asked {spec.model!r}"
    if problem:
        return Answer("bad", status, payload.get("id"), tokens, problem)
    return Answer("ok", status, payload["id"], tokens, eos_counted=eos)


def _stream_problem(spec: Spec, events: list[Any]) -> tuple[str, int, int, str | None, bool]:
    """(problem, tokens, duplicates, id, eos_counted) of a parsed stream."""
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return "the stream does not end with exactly one [DONE]", 0, 0, None, False
    chunks: list[Mapping[str, Any]] = events[:-1]
    ids = {c.get("id") for c in chunks}
    if len(ids) != 1:
        return f"chunks of {len(ids)} ids", 0, 0, None, False
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usages = [c for c in chunks if c.get("usage")]
    duplicates = max(0, len(finishes) - 1) + max(0, len(usages) - 1)
    if len(finishes) != 1 or len(usages) != 1:
        return (
            f"{len(finishes)} finish chunks, {len(usages)} usage chunks",
            0,
            duplicates,
            None,
            False,
        )
    after = chunks[chunks.index(finishes[0]) + 1 :]
    if any(c["choices"] for c in after):
        return "content after the finish chunk", 0, 1, None, False
    tokens = usages[0]["usage"]["completion_tokens"]
    seen = sum(_logprob_tokens(spec, c["choices"][0]["logprobs"]) for c in chunks if c["choices"])
    reason = finishes[0]["choices"][0]["finish_reason"]
    eos = _eos_counted(reason, seen, tokens)
    if seen != tokens and not eos:
        return f"{seen} streamed tokens for {tokens} in usage", tokens, 0, None, False
    if spec.chat and chunks[0]["choices"][0]["delta"].get("role") != "assistant":
        return "the first chat chunk carries no role", tokens, 0, None, False
    return _finish_ok(spec, reason, tokens), tokens, 0, ids.pop(), eos


def check_stream(spec: Spec, status: int, raw: bytes) -> Answer:
    """Check a streamed answer (or the JSON error sent instead of a stream)."""
    if status != 200:
        try:
            return _error_kind(spec, status, json.loads(raw))
        except ValueError:
            return Answer("bad", status, detail=f"not JSON: {raw[:200]!r}")
    try:
        events = sse_events(raw)
    except ValueError as error:
        return Answer("bad", status, detail=str(error))
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        error = errors[0]["error"]
        if spec.model == ADAPTER and error.get("type") == "not_found_error":
            # Unmounted between submission and admission: the stream ends with that error.
            return Answer("not_mounted", status, detail="stream error not_found_error")
        return Answer(
            "error", status, detail=f"stream error {error.get('type')}/{error.get('code')}"
        )
    problem, tokens, duplicates, ident, eos = _stream_problem(spec, events)
    if problem:
        return Answer("bad", status, ident, tokens, problem, duplicates)
    return Answer("ok", status, ident, tokens, eos_counted=eos)


def check(spec: Spec, status: int, raw: bytes) -> Answer:
    """Check any answer to ``spec``; an answer the checks cannot even read is ``bad``."""
    try:
        return (check_stream if spec.stream else check_whole)(spec, status, raw)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as error:
        return Answer("bad", status, detail=f"malformed: {error!r}: {raw[:200]!r}")
