"""A parsed request into the engine call: one ``prepare()`` for every generating endpoint.

Chat and text completions, Responses and Messages parse their bodies into a
:class:`~trio_mlx_http._openai.schema.GenerationRequest`; this module turns it into
what the engine runs, in one pass and in this order:

1. the model: a served name, or a mounted adapter's name selecting that adapter;
2. the tools: refused when the tokenizer has no tool-call markers;
3. ``reasoning_effort`` onto the chat template's own reasoning switch;
4. the images of a chat fetched and bounded (:mod:`~trio_mlx_http._common.images`);
   ``suffix`` (completions) into the model's fill-in-the-middle markers;
5. each prompt rendered and tokenized once by the engine (``Engine.prepare``),
   which also says whether the rendered chat opens a reasoning block;
6. a forced ``tool_choice`` into a grammar, any constraint started after a
   reasoning block the prompt opens, and a reasoning budget onto the markers' ids.

The max_tokens cut to the context is the engine's alone (its result says what a
request ran with).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from trio_mlx import InvalidRequest, NotFound, PreparedPrompt, TrioMLXError
from trio_mlx_http._common.images import resolve_prompts
from trio_mlx_http._common.reasoning import ReasoningSplitter
from trio_mlx_http._common.structured import after_reasoning, tool_call_grammar
from trio_mlx_http._common.tools import ToolCallExtractor
from trio_mlx_http._openai.schema import GenerationRequest, Prompt
from trio_mlx_http._server.state import ServerState

__all__ = ["Prepared", "prepare", "reasoning_markers"]


@attrs.frozen
class Prepared:
    """A request ready for the engine: the model to answer as, the prompts rendered."""

    #: The model id the response names.
    model: str
    #: The request with its adapter, template arguments and constraints settled.
    request: GenerationRequest
    #: ``request.prompts`` rendered and tokenized, one each.
    prompts: tuple[PreparedPrompt, ...]
    #: The reasoning markers the output is split on (None: no split).
    markers: tuple[str, str] | None
    tokenizer: Any

    @property
    def opened(self) -> bool:
        """Whether the (chat) prompt ends inside a reasoning block."""
        return self.markers is not None and self.prompts[0].opens_reasoning

    def jobs(self, per_prompt: int | None = None) -> list[PreparedPrompt]:
        """One engine prompt per choice: each prompt ``per_prompt`` (default ``n``) times."""
        count = self.request.n if per_prompt is None else per_prompt
        return [prompt for prompt in self.prompts for _ in range(count)]

    def reasoning(self) -> ReasoningSplitter | None:
        """A fresh reasoning splitter for one choice (None: the output is not split)."""
        if self.markers is None:
            return None
        return (ReasoningSplitter.opened if self.opened else ReasoningSplitter)(*self.markers)

    def extractor(self) -> ToolCallExtractor | None:
        """A fresh tool-call extractor for one choice (None: no tools)."""
        request = self.request
        if not request.tools:
            return None
        tokenizer = self.tokenizer
        return ToolCallExtractor(
            start=tokenizer.tool_call_start,
            end=tokenizer.tool_call_end or "",
            parser=tokenizer.tool_parser,
            tools=request.tools,
            limit=None if request.parallel_tool_calls else 1,
        )


async def prepare(
    state: ServerState,
    request: GenerationRequest,
    *,
    chat: bool = True,
    continue_final: bool = False,
    counting: bool = False,
) -> Prepared:
    """``request`` ready for the engine (see the module for the steps).

    ``chat``: the output's reasoning is split (chat, Responses, Messages; not text
    completions). ``continue_final``: the last assistant message is continued
    (Anthropic's prefill). ``counting``: only the prompt is wanted (count_tokens):
    no constraint is built.
    """
    model, request = _resolve_model(state, request)
    _check_tools(state, request.tools)
    # Images fetched and bounded, before anything renders the chat.
    prompts = await resolve_prompts(state.engine, state.settings, request.prompts)
    request = _reasoning_effort(state, attrs.evolve(request, prompts=prompts))
    request = _fill_in_the_middle(state, request)
    markers = reasoning_markers(state) if chat else None
    render = partial(
        state.engine.prepare,
        tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
        reasoning_markers=markers,
        continue_final_message=continue_final,
    )
    prompts = await _render_all(render, request.prompts)
    prepared = Prepared(model, request, prompts, markers, state.engine.tokenizer)
    if counting:
        return prepared
    # A forced tool call becomes a grammar of the model's tool-call format, and any
    # constraint starts after a reasoning block the prompt opens.
    reasoning_end = markers[1] if markers is not None and prepared.opened else None
    request = _enforce_tool_choice(state, request, reasoning_end)
    if request.reasoning_budget is not None and markers is not None:
        request = _bound_reasoning(state, request, markers, prepared.opened)
    return attrs.evolve(prepared, request=request)


async def _render_all(
    render: Callable[[Prompt], Awaitable[PreparedPrompt]], prompts: Sequence[Prompt]
) -> tuple[PreparedPrompt, ...]:
    """Every prompt rendered, several at once (as many as the engine's threads take);
    a refusal is the first refused prompt's, whichever finished first."""
    if len(prompts) == 1:
        return (await render(prompts[0]),)
    out: list[PreparedPrompt | TrioMLXError | None] = [None] * len(prompts)

    async def one(index: int) -> None:
        try:
            out[index] = await render(prompts[index])
        except TrioMLXError as error:
            out[index] = error

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)
    for item in out:
        if isinstance(item, TrioMLXError):
            raise item
    return tuple(p for p in out if isinstance(p, PreparedPrompt))


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


def _check_tools(state: ServerState, tools: list[dict[str, Any]] | None) -> None:
    if tools and not state.engine.tokenizer.has_tool_calling:
        raise InvalidRequest(
            f"the model {state.model_id!r} does not support tool calling "
            "(its tokenizer has no tool-call markers); send the request without tools",
            param="tools",
            code="tools_unsupported",
        )


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


def _bound_reasoning(
    state: ServerState, request: GenerationRequest, markers: tuple[str, str], opened: bool
) -> GenerationRequest:
    """The request's reasoning budget as the engine's: the markers as token ids."""
    tokenizer = state.engine.tokenizer
    ids = tuple(tuple(tokenizer.encode(m, add_special_tokens=False)) for m in markers)
    if not all(ids):
        return request  # a marker the tokenizer cannot spell: max_tokens bounds it
    params = attrs.evolve(
        request.params,
        reasoning_budget=request.reasoning_budget,
        reasoning_markers=(ids[0], ids[1]),
        reasoning_opened=opened,
    )
    return attrs.evolve(request, params=params)
