"""``/v1/chat/completions`` and ``/v1/completions``: engine requests in, OpenAI shapes out.

Streaming and disconnects ride on ordinary Trio cancellation: Quart-Trio
cancels the handler (or the response body) when the client goes away, and
leaving ``engine.generate`` cancels the engine request. A stream's engine
requests are entered before the status line is sent (the body generator is
primed in the handler), so a 400/404/429/503 at submission is a real HTTP
status; a failure after that is an error event that ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import trio
from quart import Response

from trio_mlx import (
    Completion,
    Delta,
    GenerationResult,
    GenerationStream,
    InvalidGrammar,
    InvalidRequest,
    PreparedPrompt,
    TrioMLXError,
)
from trio_mlx_http._common import sse as _sse
from trio_mlx_http._common.drive import COMMENT, drive, sse_response
from trio_mlx_http._common.prepare import prepare
from trio_mlx_http._common.reasoning import ReasoningSplitter
from trio_mlx_http._common.structured import grammar_param
from trio_mlx_http._common.tools import ToolCallExtractor
from trio_mlx_http._errors import error_body
from trio_mlx_http._openai import shapes as _openai
from trio_mlx_http._openai.prompt_logprobs import prompt_logprobs
from trio_mlx_http._openai.schema import GenerationRequest, Prompt
from trio_mlx_http._server.state import Access, ServerState

__all__ = ["respond"]


class _Format(Protocol):
    """How one endpoint renders choices: whole, or as stream chunks (SSE events)."""

    envelope: _openai.Envelope

    def start(self, index: int) -> list[bytes]: ...
    def delta(self, index: int, delta: Delta) -> list[bytes]: ...
    def end(self, index: int, result: GenerationResult) -> list[bytes]: ...
    def whole(self, index: int, completion: Completion) -> dict[str, Any]: ...


def _finish_reason(result: GenerationResult, extractor: ToolCallExtractor | None) -> str:
    if extractor is not None and extractor.called and result.finish_reason == "stop":
        return "tool_calls"
    return result.finish_reason


def _reasoning_fields(reasoning: str) -> dict[str, str]:
    # vLLM's name, and mlx_lm.server's (clients read one or the other).
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}


@attrs.define(eq=False)
class _ChatFormat:
    envelope: _openai.Envelope
    texts: _openai.TokenTexts
    extractors: list[ToolCallExtractor | None]
    splitters: list[ReasoningSplitter | None]
    #: Per choice: its chunk of content alone, encoded once (most chunks are one).
    _content_events: dict[int, _sse.TextEvent] = attrs.field(init=False, factory=dict)

    def _think(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of a piece of text."""
        splitter = self.splitters[index]
        if splitter is None:
            return "", text
        return splitter.feed(text, final=final)

    def _chunk(
        self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.envelope.body([choice])

    def _split(
        self, index: int, text: str, final: bool, *, streamed: bool = True
    ) -> tuple[str, list[dict[str, Any]]]:
        """Visible text and the tool calls completed by ``text`` (indexed when streamed)."""
        extractor = self.extractors[index]
        if extractor is None:
            return text, []
        shown, calls = extractor.feed(text)
        if final:
            rest, more = extractor.finish()
            shown, calls = shown + rest, calls + more
        first = extractor.calls - len(calls)
        return shown, [c.as_openai(first + k if streamed else None) for k, c in enumerate(calls)]

    def _content(self, index: int, text: str) -> bytes:
        """``_sse.event(self._chunk(index, {"content": text}))``, encoding only ``text``."""
        template = self._content_events.get(index)
        if template is None:
            chunk = self._chunk(index, {"content": ""})
            template = _sse.TextEvent(chunk, ("choices", 0, "delta", "content"))
            self._content_events[index] = template
        return template.fill(text)

    def start(self, index: int) -> list[bytes]:
        return [_sse.event(self._chunk(index, {"role": "assistant", "content": ""}))]

    def delta(self, index: int, delta: Delta) -> list[bytes]:
        reasoning, content = self._think(index, delta.text, final=False)
        text, calls = self._split(index, content, final=False)
        if text and not (reasoning or calls or delta.logprobs):
            return [self._content(index, text)]
        logprobs = _openai.chat_logprobs(delta.logprobs, self.texts) if delta.logprobs else None
        body: dict[str, Any] = _reasoning_fields(reasoning)
        if text:
            body["content"] = text
        if calls:
            body["tool_calls"] = calls
        if not body and logprobs is None:
            return []
        return [_sse.event(self._chunk(index, body, logprobs))]

    def end(self, index: int, result: GenerationResult) -> list[bytes]:
        reasoning, content = self._think(index, "", final=True)
        text, calls = self._split(index, content, final=True)
        chunks = []
        if text or calls or reasoning:
            body: dict[str, Any] = _reasoning_fields(reasoning)
            if text:
                body["content"] = text
            if calls:
                body["tool_calls"] = calls
            chunks.append(self._chunk(index, body))
        reason = _finish_reason(result, self.extractors[index])
        chunks.append(self._chunk(index, {}, finish=reason))
        return [_sse.event(chunk) for chunk in chunks]

    def whole(self, index: int, completion: Completion) -> dict[str, Any]:
        reasoning, content = self._think(index, completion.text, final=True)
        text, calls = self._split(index, content, final=True, streamed=False)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        message.update(_reasoning_fields(reasoning))
        if calls:
            message["tool_calls"] = calls
        logprobs = (
            _openai.chat_logprobs(completion.logprobs, self.texts)
            if completion.logprobs is not None
            else None
        )
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(completion.result, self.extractors[index]),
        }


@attrs.define(eq=False)
class _TextFormat:
    envelope: _openai.Envelope
    texts: _openai.TokenTexts
    #: Per choice: the prompt text that precedes it (``echo``), or "".
    echoes: list[str]
    #: Per choice: the echoed prompt's logprobs (``echo`` with ``logprobs``), or None.
    prompt_logprobs: list[dict[str, Any] | None]
    _offsets: list[int] = attrs.field(init=False)
    #: Per choice: its chunk of text alone, encoded once (most chunks are one).
    _text_events: dict[int, _sse.TextEvent] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._offsets = [len(echo) for echo in self.echoes]

    def _chunk(
        self, index: int, text: str, logprobs: Any = None, finish: str | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self.envelope.body([choice])

    def _text(self, index: int, text: str) -> bytes:
        """``_sse.event(self._chunk(index, text))``, encoding only ``text``."""
        template = self._text_events.get(index)
        if template is None:
            template = _sse.TextEvent(self._chunk(index, ""), ("choices", 0, "text"))
            self._text_events[index] = template
        return template.fill(text)

    def start(self, index: int) -> list[bytes]:
        if not self.echoes[index]:
            return []
        return [_sse.event(self._chunk(index, self.echoes[index], self.prompt_logprobs[index]))]

    def delta(self, index: int, delta: Delta) -> list[bytes]:
        logprobs = None
        if delta.logprobs:
            logprobs = _openai.completion_logprobs(delta.logprobs, self.texts, self._offsets[index])
        self._offsets[index] += len(delta.text)
        if logprobs is None:
            return [self._text(index, delta.text)] if delta.text else []
        return [_sse.event(self._chunk(index, delta.text, logprobs))]

    def end(self, index: int, result: GenerationResult) -> list[bytes]:
        return [_sse.event(self._chunk(index, "", finish=result.finish_reason))]

    def whole(self, index: int, completion: Completion) -> dict[str, Any]:
        echo = self.echoes[index]
        logprobs = (
            _openai.completion_logprobs(completion.logprobs, self.texts, len(echo))
            if completion.logprobs is not None
            else None
        )
        prompt = self.prompt_logprobs[index]
        if prompt is not None:
            logprobs = {k: prompt[k] + (logprobs or {}).get(k, []) for k in prompt}
        return {
            "index": index,
            "text": echo + completion.text,
            "logprobs": logprobs,
            "finish_reason": completion.result.finish_reason,
        }


async def _prompt_logprobs(
    state: ServerState, request: GenerationRequest, prompts: Sequence[PreparedPrompt]
) -> list[dict[str, Any] | None]:
    """``echo`` with ``logprobs``: each prompt's own logprobs (each distinct prompt scored once).

    ``prompts``: the prepared prompts, one per prompt (not per choice); with no
    ``suffix`` they are the echoed prompts' own tokens.
    """
    choices = len(prompts) * request.n
    if not (request.echo and request.params.logprobs):
        return [None] * choices
    if request.suffix is not None:
        raise InvalidRequest(
            "echo with logprobs and suffix is not supported: the echoed prompt is not "
            "the fill-in-the-middle prompt the model reads",
            param="suffix",
            code="unsupported_parameter",
        )
    if request.params.adapter is not None:
        raise InvalidRequest(
            "echo with logprobs scores with the base model; it cannot use an adapter",
            param="adapter",
            code="unsupported_parameter",
        )
    engine = state.engine
    scored: dict[int, dict[str, Any]] = {}
    out: list[dict[str, Any] | None] = []
    for index in range(choices):
        if index % request.n == 0:
            ids = list(prompts[index // request.n].tokens)
            first, rest = await prompt_logprobs(engine, ids, request.params.top_logprobs)
            scored[index // request.n] = _openai.prompt_completion_logprobs(
                first, rest, state.texts
            )
        out.append(scored[index // request.n])
    return out


def _echo_only(
    fmt: _TextFormat, request: GenerationRequest, prompt_tokens: list[int]
) -> dict[str, Any]:
    """``echo`` with ``max_tokens: 0``: the prompts themselves, nothing generated."""
    choices = [
        {
            "index": i,
            "text": fmt.echoes[i],
            "logprobs": fmt.prompt_logprobs[i],
            "finish_reason": "length",
        }
        for i in range(len(fmt.echoes))
    ]
    used = sum(prompt_tokens)
    counts = {"prompt_tokens": used, "completion_tokens": 0, "total_tokens": used}
    return fmt.envelope.body(
        choices, usage={**counts, "prompt_tokens_details": {"cached_tokens": 0}}
    )


def _echoes(state: ServerState, request: GenerationRequest, prompts: Sequence[Prompt]) -> list[str]:
    """``echo``: the text of each choice's prompt (token ids decoded)."""
    if not request.echo:
        return [""] * len(prompts)
    return [
        p if isinstance(p, str) else str(state.engine.tokenizer.decode(list(p))) for p in prompts
    ]


async def respond(
    state: ServerState, request: GenerationRequest, *, chat: bool, access: Access
) -> Response | dict[str, Any]:
    """Run ``request``; a streaming response or the whole JSON body."""
    # The engine names its own parameter; the client wrote response_format or tool_choice
    # (never both), and a schema may have become a grammar (see after_reasoning).
    source = "response_format" if request.params.constrained else "tool_choice"
    try:
        return await _respond(state, request, chat=chat, access=access)
    except InvalidGrammar as error:
        raise grammar_param(error, source) from None


async def _respond(
    state: ServerState, request: GenerationRequest, *, chat: bool, access: Access
) -> Response | dict[str, Any]:
    echo_of = list(request.prompts)
    prepared = await prepare(state, request, chat=chat)
    model, request = prepared.model, prepared.request
    choices = len(request.prompts) * request.n
    fmt: _Format
    if chat:
        fmt = _ChatFormat(
            _openai.Envelope.chat(model, chunk=request.stream),
            state.texts,
            [prepared.extractor() for _ in range(choices)],
            [prepared.reasoning() for _ in range(choices)],
        )
    else:
        per_choice = [p for p in echo_of for _ in range(request.n)]
        echoes = _echoes(state, request, per_choice)
        scores = await _prompt_logprobs(state, request, prepared.prompts)
        text_fmt = _TextFormat(_openai.Envelope.text(model), state.texts, echoes, scores)
        if request.prompt_only:
            counts = [len(p.tokens) for p in prepared.prompts]
            if request.suffix is not None:  # the echoed prompts, not the FIM ones
                counts = [len(await state.engine.tokenize(p)) for p in echo_of]
            access.tokens = 0
            return _echo_only(text_fmt, request, counts)
        fmt = text_fmt
    jobs = prepared.jobs()
    if request.stream:
        streams = [state.engine.generate(job, request.params, client=access.client) for job in jobs]
        body = drive(state, access, streams, _Feed(fmt, request))
        return await sse_response(
            body, access, lambda: _clamped(request, [s.max_tokens for s in streams])
        )
    per_prompt = request.n
    if request.best_of is not None and request.best_of > request.n:
        per_prompt = request.best_of
        jobs = prepared.jobs(per_prompt)
        # Ranking needs every candidate's logprobs; they are dropped again if not asked for.
        ranked = attrs.evolve(request, params=attrs.evolve(request.params, logprobs=True))
        completions = await _complete_all(state, ranked, jobs, access.client)
    else:
        completions = await _complete_all(state, request, jobs, access.client)
    access.tokens = sum(c.result.completion_tokens for c in completions)
    for completion in completions:
        state.metrics.finished(access.endpoint, completion.result)
    results = [c.result for c in completions]
    chosen = _best(completions, per_prompt, request)
    payload = fmt.envelope.body(
        [fmt.whole(i, c) for i, c in enumerate(chosen)],
        usage=_openai.usage(results, per_prompt),
    )
    headers = _clamped(request, [r.max_tokens for r in results if r.max_tokens is not None])
    if not headers:
        return payload
    return Response(
        json.dumps(payload, ensure_ascii=False),
        mimetype="application/json",
        headers=headers,
    )


#: Set when the prompt left less room in the context than max_tokens asked for.
CLAMPED_HEADER = "X-Max-Tokens-Clamped"


def _clamped(request: GenerationRequest, ran_with: list[int]) -> dict[str, str]:
    """The header saying max_tokens was cut to fit the context (the smallest, over choices)."""
    if ran_with and min(ran_with) < request.params.max_tokens:
        return {CLAMPED_HEADER: str(min(ran_with))}
    return {}


def _best(
    completions: list[Completion], per_prompt: int, request: GenerationRequest
) -> list[Completion]:
    """``best_of``: each prompt's ``n`` candidates of highest cumulative logprob, best first."""
    if per_prompt == request.n:
        return completions
    chosen: list[Completion] = []
    for start in range(0, len(completions), per_prompt):
        group = completions[start : start + per_prompt]
        group.sort(key=lambda c: -sum(lp.logprob for lp in c.logprobs or ()))
        for completion in group[: request.n]:
            if not request.params.logprobs:
                completion = attrs.evolve(completion, logprobs=None)
            chosen.append(completion)
    return chosen


async def _complete_all(
    state: ServerState,
    request: GenerationRequest,
    jobs: Sequence[PreparedPrompt],
    client: str | None,
) -> list[Completion]:
    """One engine request per choice, run together; the first error wins and cancels the rest."""
    engine = state.engine
    if len(jobs) == 1:
        return [await engine.complete(jobs[0], request.params, client=client)]
    out: list[Completion | None] = [None] * len(jobs)
    failure: list[TrioMLXError] = []

    async def one(index: int, nursery: trio.Nursery) -> None:
        try:
            out[index] = await engine.complete(jobs[index], request.params, client=client)
        except TrioMLXError as error:
            failure.append(error)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for index in range(len(jobs)):
            nursery.start_soon(one, index, nursery)
    if failure:
        raise failure[0]
    return [c for c in out if c is not None]


@attrs.define(eq=False)
class _Feed:
    """The driver's feed of chat and text completions: a format's chunks, usage, ``[DONE]``."""

    fmt: _Format
    request: GenerationRequest

    def opening(self, streams: Sequence[GenerationStream]) -> list[bytes]:
        return [chunk for index in range(len(streams)) for chunk in self.fmt.start(index)]

    def delta(self, index: int, delta: Delta) -> list[bytes]:
        return self.fmt.delta(index, delta)

    def end(self, index: int, result: GenerationResult) -> list[bytes]:
        return self.fmt.end(index, result)

    def closing(self, results: Sequence[GenerationResult]) -> list[bytes]:
        if not self.request.include_usage:
            return [_sse.DONE]
        usage = _openai.usage(list(results), self.request.n)
        return [_sse.event(self.fmt.envelope.body([], usage=usage)), _sse.DONE]

    def failed(self, error: TrioMLXError) -> list[bytes]:
        return [_sse.event(error_body(error)), _sse.DONE]

    def keepalive(self) -> bytes:
        return COMMENT
