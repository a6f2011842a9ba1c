"""The public Trio API: :class:`Engine`, a loaded model served by one actor."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from trio_mlx._adapters.registry import AdapterRegistry
from trio_mlx._core import embedding as _embedding
from trio_mlx._core.actor import Actor
from trio_mlx._core.compile_gate import CompileGate
from trio_mlx._core.gate import LaneName, choose_lane
from trio_mlx._core.images import has_images, refuse_images
from trio_mlx._core.images import prepare as prepare_images
from trio_mlx._core.prompts import PreparedPrompt, Prompt, PromptEncoder, too_long
from trio_mlx._core.request import EngineStatistics, Request
from trio_mlx._core.stream import GenerationStream
from trio_mlx._errors import (
    AdapterConflict,
    EngineClosed,
    InvalidRequest,
    NotFound,
)
from trio_mlx._lanes.records import RowSpec
from trio_mlx._lanes.structured import (
    COMPILE_TIMEOUT,
    DEFAULT_GRAMMAR_CACHE_BYTES,
    Constraint,
    GrammarCompiler,
)
from trio_mlx._params import Completion, SamplingParams, TokenLogprob
from trio_mlx._start.loading import Loaded
from trio_mlx._start.settings import DEFAULT_MAX_IMAGE_PIXELS, EngineSettings

__all__ = ["Engine"]

T = TypeVar("T")


#: Greedy decoding of up to 256 tokens.
DEFAULT_PARAMS = SamplingParams()
#: Temperatures below this are greedy decoding (1 / 1e-30 still fits float32).
_TEMPERATURE_FLOOR = 1e-30


def _mlx_memory() -> tuple[int, int, int]:
    """MLX's allocator counters (active, cache, peak bytes): plain reads, no MLX work,
    so safe off the MLX thread."""
    import mlx.core as mx

    return int(mx.get_active_memory()), int(mx.get_cache_memory()), int(mx.get_peak_memory())


@attrs.define(eq=False)
class Engine(_embedding.EmbeddingAPI):
    """A loaded model served by one actor; use it through :func:`open_engine`."""

    #: A name for the model (its directory name), e.g. for ``/v1/models``.
    model_id: str
    _loaded: Loaded
    _registry: AdapterRegistry
    _actor: Actor
    _settings: EngineSettings = attrs.field(factory=EngineSettings)
    #: Seconds a request's constraint may take to compile (see :func:`open_engine`).
    grammar_timeout: float = attrs.field(init=False, default=COMPILE_TIMEOUT)
    _grammar: GrammarCompiler | None = attrs.field(init=False, default=None)
    #: The byte bound of the compiled grammars kept (see :func:`open_engine`).
    grammar_cache_bytes: int = attrs.field(init=False, default=DEFAULT_GRAMMAR_CACHE_BYTES)
    #: Most pixels an input image may have (see :class:`~trio_mlx.EngineSettings`).
    max_image_pixels: int = attrs.field(init=False, default=DEFAULT_MAX_IMAGE_PIXELS)
    _compile_gate: CompileGate = attrs.field(init=False, factory=CompileGate)
    _prompts: PromptEncoder = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        vocab = self._loaded.config.get("vocab_size")
        self._prompts = PromptEncoder(
            self._loaded.tokenizer,
            self.context_length,
            vocab if isinstance(vocab, int) else None,
            # Only where the lanes keep checkpoints: a plain KVCache model's
            # end-of-generation entry is cut back instead, so its stable
            # prefix would be rendered for nothing.
            stable_prefixes=self._loaded.prompt_cache is not None
            and bool(self._loaded.lane.prompt_checkpoints),
        )

    @property
    def tokenizer(self) -> Any:
        """mlx-lm's ``TokenizerWrapper``; use it read-only (encode, decode, chat template)."""
        return self._loaded.tokenizer

    @property
    def context_length(self) -> int | None:
        """The model's context length (``max_position_embeddings``), when known."""
        value = self._loaded.config.get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None

    @property
    def takes_images(self) -> bool:
        """Whether the model is a vision-language model: chats may hold image parts
        (``{"type": "image", "image": trio_mlx.ImageInput(...)}``)."""
        return self._loaded.vision is not None

    @property
    def adapters(self) -> tuple[str, ...]:
        """Names of the mounted LoRA adapters."""
        return self._registry.names

    @property
    def closed(self) -> bool:
        """Whether the engine refuses new work (shutting down, or its worker died)."""
        return self._actor.closed

    def close(self) -> None:
        """Refuse new work and end every pending request now with :class:`EngineClosed`.

        For a server's shutdown deadline: what still runs gets a clean error
        instead of a dropped connection. Leaving :func:`open_engine` closes the
        engine as well, after its grace period.
        """
        self._actor.close_nowait()

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the engine: arbiter state, queues, counters, memory."""
        cache = self._loaded.prompt_cache
        speculator = self._loaded.lane.speculator
        active, cached, peak = _mlx_memory()
        return attrs.evolve(
            self._actor.statistics(),
            mlx_active_memory=active,
            mlx_cache_memory=cached,
            mlx_peak_memory=peak,
            prompt_cache_bytes=cache.nbytes if cache is not None else 0,
            prompt_cache=cache.statistics() if cache is not None else None,
            draft_tokens=dict(speculator.drafted) if speculator is not None else {},
            draft_accepted_tokens=dict(speculator.accepted) if speculator is not None else {},
        )

    def encode(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Tokenize a prompt exactly as :meth:`generate` does.

        A string is raw text (no chat template); a sequence of ints is taken as
        token ids; a sequence of mappings is a chat, rendered with the model's
        chat template (``add_generation_prompt=True``, ``tools`` and
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``, passed on).
        Raises :class:`~trio_mlx.InvalidRequest` for an empty prompt, one that
        tokenizes to nothing, or one longer than the model's context.
        """
        refuse_images(prompt, "tokenized by tokenize(), not encode()")
        return list(self._prompts.encode(prompt, tools, chat_template_kwargs).tokens)

    async def tokenize(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """:meth:`encode`, off the event loop unless the prompt is small.

        At most a few prompts are tokenized at once, each in a thread; a small
        prompt (a short string or id list, a short chat without tools) costs
        less than the thread hop and is tokenized inline, so it never queues
        behind large ones.
        """
        if has_images(prompt):  # image tokens expanded, as generate makes them
            return list((await self._images(prompt, tools, chat_template_kwargs)).tokens)
        return list((await self._prompts.tokenize(prompt, tools, chat_template_kwargs)).tokens)

    async def prepare(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        reasoning_markers: tuple[str, str] | None = None,
        continue_final_message: bool = False,
    ) -> PreparedPrompt:
        """Render and tokenize a prompt once, for :meth:`generate` to take as it is.

        The prompt is what :meth:`encode` takes, and is checked as it checks it
        (off the event loop as :meth:`tokenize`). A chat is rendered once; the
        result says whether the rendered prompt ends inside a reasoning block
        (``reasoning_markers``, start and end; default: the tokenizer's
        ``think_start``/``think_end``), so the generated text starts as
        reasoning. ``continue_final_message`` leaves a final assistant message
        open for the model to continue (a template that cannot is refused).
        Several requests may share one prepared prompt (``n`` choices).
        """
        if reasoning_markers is None:
            start = getattr(self.tokenizer, "think_start", None)
            end = getattr(self.tokenizer, "think_end", None)
            if isinstance(start, str) and isinstance(end, str):
                reasoning_markers = (start, end)
        if has_images(prompt):
            if continue_final_message:
                refuse_images(prompt, "not continued from its final message (a prefill)")
            return await self._images(prompt, tools, chat_template_kwargs, reasoning_markers)
        return await self._prompts.tokenize(
            prompt, tools, chat_template_kwargs, reasoning_markers, continue_final_message
        )

    def refuse_oversized(self, prompt: Prompt, *, tools: Sequence[Any] | None = None) -> None:
        """Refuse, before rendering or tokenizing, a prompt that cannot fit the context.

        Raises :class:`~trio_mlx.InvalidRequest` (``context_length_exceeded``);
        :meth:`encode` calls it first, and so should anything else that renders
        a chat template (it walks the whole chat: call it off the event loop).
        The bound is in bytes: no token covers more UTF-8 bytes than its
        vocabulary's longest entry, and every string value a chat template
        renders is counted (tool calls, tool results, tool definitions).
        """
        self._prompts.refuse_oversized(prompt, tools=tools)

    def generate(
        self,
        prompt: Prompt | PreparedPrompt,
        params: SamplingParams = DEFAULT_PARAMS,
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        client: Hashable | None = None,
    ) -> GenerationStream:
        """Stream one completion: ``async with engine.generate(...) as stream: async for delta in stream``.

        ``prompt`` is what :meth:`encode` takes, or a :class:`~trio_mlx.PreparedPrompt`
        (:meth:`prepare`), whose tokens are taken as they are (it carries its own
        tools and template arguments: passing them too is refused).
        Submission errors raise on entering the block (InvalidRequest,
        NotFound for an unknown adapter, EngineOverloaded, EngineClosed).
        Leaving the block early cancels the request. ``client`` (any hashable,
        e.g. a server's client address) shares grammar compiles fairly: one
        client's compiles hold at most one compile slot at a time.
        """
        return GenerationStream(
            partial(self._submit, prompt, params, tools, chat_template_kwargs, client),
            self._actor.cancel_nowait,
        )

    async def complete(
        self,
        prompt: Prompt | PreparedPrompt,
        params: SamplingParams = DEFAULT_PARAMS,
        *,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        client: Hashable | None = None,
    ) -> Completion:
        """Generate a whole completion and return it (``client``: see :meth:`generate`)."""
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        async with self.generate(
            prompt, params, tools=tools, chat_template_kwargs=chat_template_kwargs, client=client
        ) as stream:
            async for delta in stream:
                texts.append(delta.text)
                ids.extend(delta.token_ids)
                if delta.logprobs:
                    logprobs.extend(delta.logprobs)
        return Completion(
            "".join(texts),
            tuple(ids),
            tuple(logprobs) if params.logprobs else None,
            stream.result,
        )

    async def run_exclusive(self, fn: Callable[[Any, Any], T]) -> T:
        """Run ``fn(model, tokenizer)`` alone on the MLX thread and return its result."""
        self._refuse_distributed("run_exclusive")
        model, tokenizer, lane = self._loaded.model, self._loaded.tokenizer, self._loaded.lane

        def job() -> T:
            try:
                return fn(model, tokenizer)
            finally:
                lane.after_job()  # fn may have changed the model's weights

        value: T = await self._job(job)
        return value

    async def mount_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Mount the LoRA adapter at ``path`` as ``name``; requests name it in ``params.adapter``."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("an adapter name must be a non-empty string", param="name")
        self._refuse_distributed("LoRA adapters")
        folder = Path(path)
        if not await trio.Path(folder).exists():
            raise NotFound(f"no adapter at {folder}", param="path")
        folder = AdapterRegistry.check_path(folder)
        if name in self._registry:
            raise InvalidRequest(f"an adapter named {name!r} is already mounted", param="name")
        self._registry.check_room()
        model = self._loaded.model
        await self._job(lambda: self._registry.mount(model, name, folder))

    async def unmount_adapter(self, name: str) -> None:
        """Unmount the adapter ``name``.

        A serial request using it has finished by then (the unmount is an
        exclusive job). If rows of the batch (running or parked) run under it,
        the unmount is refused with :class:`AdapterConflict` (409): nothing is
        unmounted, try again once they end. Requests naming it that still wait
        for a place in the batch fail with NotFound.
        """
        if name not in self._registry:
            raise NotFound(f"no adapter named {name!r} is mounted", param="adapter")
        model, lane = self._loaded.model, self._loaded.lane

        def unmount() -> None:
            if lane.uses_adapter(name):
                raise AdapterConflict(
                    f"the adapter {name!r} is in use by rows of the batch; "
                    "unmount it once they end",
                    param="name",
                    code="adapter_in_use",
                )
            self._registry.unmount(model, name)

        await self._job(unmount)

    async def _job(self, work: Callable[[], T]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        request = Request(self._actor.new_id(), LaneName.JOB, work=work)
        await self._actor.submit(request)
        try:
            await request.done.wait()
        except BaseException:
            self._actor.cancel_nowait(request)
            raise
        if request.result is None:
            raise EngineClosed("the engine closed before the job ran")
        value: T = request.result.unwrap()
        return value

    async def _submit(
        self,
        prompt: Prompt | PreparedPrompt,
        params: SamplingParams,
        tools: Any,
        template_kwargs: Mapping[str, Any] | None = None,
        client: Hashable | None = None,
    ) -> Request:
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be a SamplingParams")
        if self._actor.closed:
            raise EngineClosed("the engine is closed")
        if isinstance(prompt, PreparedPrompt):
            prepared = self._check_prepared(prompt, tools, template_kwargs)
        elif has_images(prompt):
            prepared = await self._images(prompt, tools, template_kwargs)
        else:
            # Tokenizing (and rendering a chat template) is CPU work that grows with
            # the prompt: off the event loop, a few prompts at a time.
            prepared = await self._prompts.tokenize(prompt, tools, template_kwargs)
        tokens, checkpoint, images = prepared.tokens, prepared.stable_prefix, prepared.images
        params = self._fit_context(len(tokens), params)
        params = self._fit_memory(len(tokens), params)
        self._check_logit_bias(params)
        params = self._sampler_safe(params)
        constraint = await self._constraint(params, client) if params.constrained else None
        adapter_reason = None
        if params.adapter is not None:
            self._refuse_distributed("LoRA adapters", "adapter")
            adapter_reason = self._registry.serial_reason(params.adapter)
        if params.kv_bits is not None:
            self._check_kv_group(params.kv_group_size)
        lane = choose_lane(
            params,
            max_batch=self._loaded.lane.max_batch,
            caches_merge=self._loaded.caches_merge,
            adapter_reason=adapter_reason,
        )
        request_id = self._actor.new_id()
        request = Request(
            request_id,
            lane.name,
            spec=RowSpec(request_id, tokens, params, constraint, checkpoint, images),
        )
        await self._actor.submit(request)
        return request

    def _images(self, *request: Any) -> Awaitable[PreparedPrompt]:
        """A chat with images as a prompt (:func:`~trio_mlx._core.images.prepare`)."""
        vision, limit = self._loaded.vision, self.max_image_pixels
        return prepare_images(vision, self._prompts, self.model_id, limit, request)

    def _check_prepared(
        self, prompt: PreparedPrompt, tools: Any, template_kwargs: Mapping[str, Any] | None
    ) -> PreparedPrompt:
        """A prepared prompt's tokens checked as :meth:`encode` checks token ids (cheaply)."""
        if tools or template_kwargs:
            raise InvalidRequest(
                "a prepared prompt was rendered with its tools and chat_template_kwargs; "
                "pass them to prepare, not with it",
                param="tools" if tools else "chat_template_kwargs",
            )
        tokens = prompt.tokens
        self._prompts.check_length(tokens)
        vocab = self._loaded.config.get("vocab_size")
        # Ints (checked when it was made); min and max run in C, cheap on the event loop.
        if min(tokens) < 0 or (isinstance(vocab, int) and max(tokens) >= vocab):
            raise InvalidRequest(
                "a prepared prompt holds ids outside the vocabulary", param="prompt"
            )
        return prompt

    def _fit_context(self, prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """``params`` with max_tokens cut to the room the prompt leaves in the context.

        No row runs past the model's context: a request asking for more ends
        with finish_reason "length" there, and its result's ``max_tokens`` says
        what it ran with (as OpenAI clamps, and mlx-lm does not).
        """
        limit = self.context_length
        if limit is None or prompt_tokens + params.max_tokens <= limit:
            return params
        room = limit - prompt_tokens
        if room < 1:
            raise too_long(
                f"the prompt has {prompt_tokens} tokens, leaving no room to generate", limit
            )
        return attrs.evolve(params, max_tokens=room)

    def _fit_memory(self, prompt_tokens: int, params: SamplingParams) -> SamplingParams:
        """``params`` with max_tokens cut to the tokens one request's KV cache may hold.

        Like the context's cut (:meth:`_fit_context`): the row ends with
        finish_reason "length" there. A prompt with no room left at all is
        refused by the arbiter when it is submitted (``Rejection.TOO_LARGE``).
        """
        memory = self._actor.policy.memory
        capacity = None if memory is None else memory.row_capacity()
        if capacity is None or prompt_tokens + params.max_tokens <= capacity:
            return params
        room = capacity - prompt_tokens
        if room < max(1, params.min_tokens):
            return params
        return attrs.evolve(params, max_tokens=room)

    async def _constraint(
        self, params: SamplingParams, client: Hashable | None = None
    ) -> Constraint | None:
        """Compile the request's schema, regex or grammar in a worker thread, bounded in time."""
        param = next(
            n for n in ("json_schema", "regex", "grammar") if getattr(params, n) is not None
        )
        # Followers would need the same matcher next to each step: not mirrored yet.
        self._refuse_distributed("structured output (json_schema, regex, grammar)", param)
        if self._grammar is None:
            vocab = self._loaded.config.get("vocab_size")
            self._grammar = GrammarCompiler(
                self._loaded.tokenizer,
                vocab if isinstance(vocab, int) else None,
                cache_bytes=self.grammar_cache_bytes,
            )
        compiler = self._grammar
        if importlib.util.find_spec("llguidance") is None:
            raise InvalidRequest(
                "structured output needs the llguidance package, which is not installed",
                param=param,
                code="structured_output_unavailable",
            )
        return await self._compile_gate.run(
            partial(compiler.compile, params),
            seconds=self.grammar_timeout,
            param=param,
            client=client,
        )

    def _refuse_distributed(self, what: str, param: str | None = None) -> None:
        if self._loaded.channel is not None:
            raise InvalidRequest(
                f"distributed mode does not support {what}",
                param=param,
                code="unsupported_in_distributed_mode",
            )

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self._loaded.config.get("vocab_size")
        if params.logit_bias and isinstance(vocab, int):
            outside = [token for token in params.logit_bias if token >= vocab]
            if outside:
                raise InvalidRequest(
                    f"logit_bias names token {outside[0]}, outside the vocabulary ({vocab})",
                    param="logit_bias",
                )

    def _sampler_safe(self, params: SamplingParams) -> SamplingParams:
        """``params`` with two values mlx-lm's sampler cannot take replaced by their meaning.

        A ``top_k`` of the whole vocabulary or more keeps every token: the same as
        0 (off); mlx-lm's top-k raises for a k outside (0, vocabulary). A
        temperature whose inverse overflows float32 is greedy decoding in the
        limit; mlx-lm would scale the logits by inf, sample garbage and (measured
        with 5e-324) leave later sampled rows of the process drawing garbage too.
        """
        vocab = self._loaded.config.get("vocab_size")
        if isinstance(vocab, int) and params.top_k >= vocab:
            params = attrs.evolve(params, top_k=0)
        if 0 < params.temperature < _TEMPERATURE_FLOOR:
            params = attrs.evolve(params, temperature=0.0)
        return params

    def _check_kv_group(self, group: int) -> None:
        config = self._loaded.config
        head_dim = config.get("head_dim")
        if not isinstance(head_dim, int):
            hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
            if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
                return
            head_dim = hidden // heads
        if head_dim % group:
            raise InvalidRequest(
                f"kv_group_size {group} does not divide the model's head size {head_dim}",
                param="kv_group_size",
            )

    async def _shutdown(self, grace_period: float) -> None:
        self._actor.begin_close()
        with trio.move_on_after(grace_period):
            await self._actor.wait_idle()
        self._actor.close_nowait()
