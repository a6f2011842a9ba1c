"""``/v1/chat/completions`` and ``/v1/completions``: engine requests in, OpenAI shapes out.

Streaming and disconnects ride on ordinary Trio cancellation: Quart-Trio
cancels the handler (or the response body) when the client goes away, and
leaving ``engine.generate`` cancels the engine request. A stream's engine
requests are entered before the status line is sent (the body generator is
primed in the handler), so a 400/404/429/503 at submission is a real HTTP
status; a failure after that is an error event that ends the stream.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
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
    NotFound,
    TrioMLXError,
)
from trio_mlx_http._common import keepalive as _keepalive
from trio_mlx_http._common import sse as _sse
from trio_mlx_http._common.images import resolve_prompts
from trio_mlx_http._common.keepalive import next_delta
from trio_mlx_http._common.reasoning import ReasoningSplitter, prompt_opens_reasoning
from trio_mlx_http._common.structured import after_reasoning, grammar_param, tool_call_grammar
from trio_mlx_http._common.tools import ToolCallExtractor
from trio_mlx_http._errors import error_body, status_of
from trio_mlx_http._openai import shapes as _openai
from trio_mlx_http._openai.prompt_logprobs import prompt_logprobs
from trio_mlx_http._openai.schema import GenerationRequest, Prompt
from trio_mlx_http._server.state import Access, ServerState

__all__ = ["respond"]

logger = logging.getLogger("trio_mlx_http")


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


def _resolve_model(state: ServerState, request: GenerationRequest) -> tuple[str, GenerationRequest]:
    """The model id to answer with; a mounted adapter's name selects that adapter."""
    name = request.model
    if name is None or name in state.model_names:
        return state.model_id, request
    if name not in state.engine.adapters and state.serves(name):  # a pattern's name
        return state.model_id, request
    if name in state.engine.adapters:
        if request.params.adapter not in (None, name):
            raise InvalidRequest(
                f"model {name!r} is an adapter, but adapter {request.params.adapter!r} was asked for",
                param="adapter",
            )
        params = attrs.evolve(request.params, adapter=name)
        return name, attrs.evolve(request, params=params)
    raise NotFound(
        f"the model {name!r} does not exist; GET /v1/models lists the served models",
        param="model",
        code="model_not_found",
    )


def _clamp_max_tokens(state: ServerState, request: GenerationRequest) -> GenerationRequest:
    """No completion outgrows the context: a larger max_tokens is cut to the context length."""
    limit = state.engine.context_length
    if limit is None or request.params.max_tokens <= limit:
        return request
    return attrs.evolve(request, params=attrs.evolve(request.params, max_tokens=limit))


#: Efforts that mean "do not think", for templates that switch thinking on and off.
_NO_THINKING_EFFORTS = frozenset({"none", "minimal"})


def _reasoning_effort(state: ServerState, request: GenerationRequest) -> GenerationRequest:
    """``reasoning_effort`` on the model's own reasoning switch.

    A chat template that reads ``reasoning_effort`` (gpt-oss's) gets it as it
    is; one that reads ``enable_thinking`` (Qwen3's and its kind) gets thinking
    off for ``none``/``minimal`` and on for the others (unless the request's
    ``chat_template_kwargs`` set it). A template with neither has no reasoning
    to set: the effort is accepted and changes nothing (agents send it always).
    """
    effort = request.reasoning_effort
    if effort is None:
        return request
    template = getattr(state.engine.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    own = request.chat_template_kwargs or {}
    if "reasoning_effort" in template:
        return attrs.evolve(request, chat_template_kwargs={"reasoning_effort": effort, **own})
    if "enable_thinking" in template:
        thinking = effort not in _NO_THINKING_EFFORTS
        return attrs.evolve(request, chat_template_kwargs={"enable_thinking": thinking, **own})
    return request


def _check_tools(state: ServerState, tools: list[dict[str, Any]] | None) -> None:
    if tools and not state.engine.tokenizer.has_tool_calling:
        raise InvalidRequest(
            f"the model {state.model_id!r} does not support tool calling "
            "(its tokenizer has no tool-call markers); send the request without tools",
            param="tools",
            code="tools_unsupported",
        )


def _extractor(state: ServerState, request: GenerationRequest) -> ToolCallExtractor | None:
    if not request.tools:
        return None
    tokenizer = state.engine.tokenizer
    return ToolCallExtractor(
        start=tokenizer.tool_call_start,
        end=tokenizer.tool_call_end or "",
        parser=tokenizer.tool_parser,
        tools=request.tools,
        limit=None if request.parallel_tool_calls else 1,
    )


def _enforce_tool_choice(
    state: ServerState, request: GenerationRequest, reasoning_end: str | None
) -> GenerationRequest:
    """A required or named ``tool_choice`` becomes a grammar of the model's tool-call format.

    ``reasoning_end``: the prompt opens a reasoning block that this marker closes;
    any constraint then starts after it.
    """
    choice = request.tool_choice
    tokenizer = state.engine.tokenizer
    if not choice.enforced:
        if reasoning_end is not None and request.params.constrained:
            params = after_reasoning(request.params, tokenizer, reasoning_end)
            return attrs.evolve(request, params=params)
        return request
    if not request.tools:
        raise InvalidRequest(
            f"tool_choice {choice.mode!r} needs tools to call", param="tool_choice"
        )
    if request.params.constrained:
        raise InvalidRequest(
            "response_format cannot be combined with tool_choice 'required' or a named function",
            param="response_format",
        )
    grammar = tool_call_grammar(
        request.tools, choice, tokenizer, parallel=choice.parallel, reasoning_end=reasoning_end
    )
    return attrs.evolve(request, params=attrs.evolve(request.params, grammar=grammar))


def reasoning_markers(state: ServerState) -> tuple[str, str] | None:
    """The model's reasoning markers (``--reasoning-markers`` or the tokenizer's), if any."""
    markers = state.settings.reasoning_markers
    if markers is False:
        return None
    if isinstance(markers, tuple):
        return markers
    tokenizer = state.engine.tokenizer
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    return (start, end) if isinstance(start, str) and isinstance(end, str) else None


async def _opens_reasoning(
    state: ServerState, request: GenerationRequest, markers: tuple[str, str]
) -> bool:
    """Whether the rendered chat prompt ends inside a reasoning block (mlx_lm.server's test)."""
    messages = request.prompts[0]
    kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
    if request.tools:
        kwargs["tools"] = request.tools

    def render() -> str:
        state.engine.refuse_oversized(messages, tools=request.tools)
        text = state.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        return str(text)

    try:
        prompt = await trio.to_thread.run_sync(render)
    except InvalidRequest:
        raise
    except Exception:  # the engine reports a template that does not render
        return False
    return prompt_opens_reasoning(prompt, *markers)


#: Fill-in-the-middle markers (prefix, suffix, middle) of the model families that have them.
_FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    (
        "<\uff5cfim\u2581begin\uff5c>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<\uff5cfim\u2581end\uff5c>",
    ),  # DeepSeek-Coder
)


def _fill_in_the_middle(state: ServerState, request: GenerationRequest) -> GenerationRequest:
    """``suffix``: each prompt becomes prefix-suffix-middle in the model's FIM markers."""
    if request.suffix is None:
        return request
    vocab = state.engine.tokenizer.get_vocab()
    markers = next((m for m in _FIM_MARKERS if all(t in vocab for t in m)), None)
    if markers is None:
        raise InvalidRequest(
            f"suffix needs a fill-in-the-middle model; {state.model_id!r} has no FIM tokens",
            param="suffix",
            code="unsupported_parameter",
        )
    if not all(isinstance(p, str) for p in request.prompts):
        raise InvalidRequest("suffix needs the prompt as text, not token ids", param="suffix")
    pre, suf, mid = markers
    prompts = tuple(f"{pre}{p}{suf}{request.suffix}{mid}" for p in request.prompts)
    return attrs.evolve(request, prompts=prompts)


async def _prompt_logprobs(
    state: ServerState, request: GenerationRequest, prompts: Sequence[Prompt]
) -> list[dict[str, Any] | None]:
    """``echo`` with ``logprobs``: each prompt's own logprobs (each distinct prompt scored once)."""
    if not (request.echo and request.params.logprobs):
        return [None] * len(prompts)
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
    for index, prompt in enumerate(prompts):
        if index % request.n == 0:
            ids = await trio.to_thread.run_sync(engine.encode, prompt)
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
    model, request = _resolve_model(state, _clamp_max_tokens(state, request))
    _check_tools(state, request.tools)
    if chat:
        prompts = await resolve_prompts(state.engine, state.settings, request.prompts)
        request = attrs.evolve(request, prompts=prompts)
    request = _reasoning_effort(state, request)
    echo_of = list(request.prompts)
    request = _fill_in_the_middle(state, request)
    choices = len(request.prompts) * request.n
    fmt: _Format
    if chat:
        markers = reasoning_markers(state)
        splitters: list[ReasoningSplitter | None] = [None] * choices
        opened = False
        if markers is not None:
            opened = await _opens_reasoning(state, request, markers)
            new = ReasoningSplitter.opened if opened else ReasoningSplitter
            splitters = [new(*markers) for _ in range(choices)]
        # A prompt that opens a reasoning block: the constraint starts after its end.
        reasoning_end = markers[1] if markers is not None and opened else None
        request = _enforce_tool_choice(state, request, reasoning_end)
        extractors = [_extractor(state, request) for _ in range(choices)]
        fmt = _ChatFormat(
            _openai.Envelope.chat(model, chunk=request.stream), state.texts, extractors, splitters
        )
    else:
        per_choice = [p for p in echo_of for _ in range(request.n)]
        echoes = _echoes(state, request, per_choice)
        scores = await _prompt_logprobs(state, request, per_choice)
        text_fmt = _TextFormat(_openai.Envelope.text(model), state.texts, echoes, scores)
        if request.prompt_only:
            counts = [len(await trio.to_thread.run_sync(state.engine.encode, p)) for p in echo_of]
            access.tokens = 0
            return _echo_only(text_fmt, request, counts)
        fmt = text_fmt
    jobs = [prompt for prompt in request.prompts for _ in range(request.n)]
    if request.stream:
        ran_with: list[int] = []
        body = _stream(state, request, jobs, fmt, access, ran_with)
        await anext(body)  # enters every engine request: admission errors become statuses
        access.by_body = True
        headers = {**_sse.SSE_HEADERS, **_clamped(request, ran_with)}
        return Response(body, status=200, headers=headers, content_type=_sse.CONTENT_TYPE)
    per_prompt = request.n
    if request.best_of is not None and request.best_of > request.n:
        per_prompt = request.best_of
        jobs = [prompt for prompt in request.prompts for _ in range(per_prompt)]
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
    state: ServerState, request: GenerationRequest, jobs: Sequence[Prompt], client: str | None
) -> list[Completion]:
    """One engine request per choice, run together; the first error wins and cancels the rest."""
    engine = state.engine
    options: dict[str, Any] = {
        "tools": request.tools,
        "chat_template_kwargs": request.chat_template_kwargs,
        "client": client,
    }
    if len(jobs) == 1:
        return [await engine.complete(jobs[0], request.params, **options)]
    out: list[Completion | None] = [None] * len(jobs)
    failure: list[TrioMLXError] = []

    async def one(index: int, nursery: trio.Nursery) -> None:
        try:
            out[index] = await engine.complete(jobs[index], request.params, **options)
        except TrioMLXError as error:
            failure.append(error)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for index in range(len(jobs)):
            nursery.start_soon(one, index, nursery)
    if failure:
        raise failure[0]
    return [c for c in out if c is not None]


def _next_readers(streams: Sequence[GenerationStream], active: list[int]) -> list[int]:
    """The choices to read this round: those with output ready, else one that is running.

    Waiting on a choice still queued for a batch row while the others generate
    would leave their output unread, and the engine cancels a request whose
    unread output passes its bound.
    """
    if len(active) == 1:  # one choice (most streams): whichever way, it is read
        return active[:1]
    ready = [index for index in active if streams[index].ready]
    if ready:
        return ready
    running = [index for index in active if streams[index].running]
    return running[:1] or active[:1]


async def _stream(
    state: ServerState,
    request: GenerationRequest,
    jobs: Sequence[Prompt],
    fmt: _Format,
    access: Access,
    ran_with: list[int],
) -> AsyncIterator[bytes]:
    """The SSE body: every choice's chunks, round-robin, then usage and ``[DONE]``."""
    status = 499  # nginx's "client closed request", logged if the client leaves
    admitted = False
    engine = state.engine
    try:
        async with contextlib.AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(
                    engine.generate(
                        prompt,
                        request.params,
                        tools=request.tools,
                        chat_template_kwargs=request.chat_template_kwargs,
                        client=access.client,
                    )
                )
                for prompt in jobs
            ]
            admitted = True
            ran_with.extend(stream.max_tokens for stream in streams)
            yield b""  # primed: all admitted
            results: list[GenerationResult | None] = [None] * len(streams)
            sent = [0] * len(streams)  # tokens per choice, for the access log
            # Events ready together leave as one write (one ASGI send, one chunk
            # frame): a round's choices, the last chunks with usage and [DONE].
            # None waits for another: what is pending leaves before any wait.
            pending: list[bytes] = []
            interval = state.settings.sse_keepalive
            try:
                for index in range(len(streams)):
                    pending += fmt.start(index)
                active = list(range(len(streams)))
                while active:
                    for index in _next_readers(streams, active):
                        if pending and not streams[index].ready:
                            yield b"".join(pending)
                            pending.clear()
                        try:
                            while (delta := await next_delta(streams[index], interval)) is None:
                                yield _keepalive.COMMENT
                        except StopAsyncIteration:
                            active.remove(index)
                            result = results[index] = streams[index].result
                            sent[index] = result.completion_tokens
                            state.metrics.finished(access.endpoint, result)
                            pending += fmt.end(index, result)
                        else:
                            sent[index] += len(delta.token_ids)
                            pending += fmt.delta(index, delta)
                        access.tokens = sum(sent)
                    if pending and active:
                        yield b"".join(pending)
                        pending.clear()
            except TrioMLXError as error:
                logger.warning("stream failed: %s", error.message)
                state.metrics.failed(access.endpoint, "error")
                status = status_of(error)
                access.cut_by(error)
                yield b"".join([*pending, _sse.event(error_body(error)), _sse.DONE])
                return
        if request.include_usage:
            done = [r for r in results if r is not None]
            pending.append(_sse.event(fmt.envelope.body([], usage=_openai.usage(done, request.n))))
        pending.append(_sse.DONE)
        yield b"".join(pending)
        status = 200
    finally:
        access.stream_ended(status, admitted=admitted)
