"""Prompts to tokens: the chat template rendered, the size checked before, the stable prefix.

:class:`PromptEncoder` is what :class:`~trio_mlx.Engine`'s ``encode``, ``tokenize``
and ``refuse_oversized`` do, and what every submission goes through: a prompt is raw
text, token ids or a chat; a chat is rendered with the model's chat template once,
after its size was bounded by its bytes (:mod:`trio_mlx._core.prompt_size`), and its
stable prefix found for the prompt cache (:mod:`trio_mlx._core.stable_prefix`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, cast

import attrs
import trio

from trio_mlx._core.prompt_size import rendered_bytes, utf8_size
from trio_mlx._core.stable_prefix import StablePrefix
from trio_mlx._errors import InvalidRequest

__all__ = ["PreparedPrompt", "Prompt", "PromptEncoder", "too_long"]

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


def _token_ids(_instance: Any, _attribute: Any, tokens: tuple[int, ...]) -> None:
    if not all(type(token) is int for token in tokens):
        raise InvalidRequest("a prepared prompt's tokens must be token ids (ints)", param="prompt")


def _check_unicode(text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be encoded)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            "the prompt is not valid Unicode (a lone surrogate?)", param="prompt"
        ) from None


@attrs.frozen
class PreparedPrompt:
    """A prompt rendered and tokenized once, by :meth:`~trio_mlx.Engine.prepare`.

    Pass it to :meth:`~trio_mlx.Engine.generate` (or ``complete``) as the prompt:
    generation takes its tokens as they are, so a chat template is not rendered
    again, and as many requests as share it (``n`` choices) share its rendering.
    """

    #: The prompt's token ids, as the model reads them.
    tokens: tuple[int, ...] = attrs.field(converter=tuple, validator=_token_ids)
    #: Whether the rendered prompt ends inside a reasoning block (a chat template
    #: that opens ``<think>`` itself): the generated text starts as reasoning.
    opens_reasoning: bool = False
    #: A chat's stable prefix (its system prompt and tools) in tokens, where the
    #: prompt cache keeps a checkpoint; None: no such prefix.
    stable_prefix: int | None = None
    #: A chat with images: their model inputs and hashes (the engine's
    #: ``VisionPrompt``); None: text only.
    images: Any = attrs.field(default=None, eq=False, repr=False)


def opens_reasoning(text: str, markers: tuple[str, str] | None) -> bool:
    """Whether ``text`` (a rendered chat) ends inside a block that ``markers`` open and close."""
    if markers is None:
        return False
    start, end = markers
    return text.rfind(start) > text.rfind(end) if start and start in text else False


#: Prompts (characters, or token ids) up to this size are tokenized on the event loop.
_INLINE_PROMPT = 1024

#: Prompts tokenized at once in threads (fast tokenizers release the GIL).
_TOKENIZE_THREADS = max(1, min(4, os.cpu_count() or 1))
#: Chat template arguments the engine sets itself; ``chat_template_kwargs`` may not.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "return_dict"}
)


def too_long(what: str, limit: int) -> InvalidRequest:
    return InvalidRequest(
        f"{what}, more than the model's context of {limit}",
        param="prompt",
        code="context_length_exceeded",
    )


def _small(prompt: Any, tools: Sequence[Any] | None) -> bool:
    """Whether tokenizing ``prompt`` costs less than a thread hop."""
    if not isinstance(prompt, str | list | tuple) or len(prompt) > _INLINE_PROMPT:
        return False
    if not prompt or not isinstance(prompt[0], Mapping):
        return True
    if tools or len(prompt) > 32:
        return False
    # Only flat messages (strings for values: no tool calls, no content parts)
    # of a few characters in all; anything else renders in a thread.
    chars = 0
    for message in prompt:
        if not isinstance(message, Mapping):
            return False
        for value in message.values():
            if not isinstance(value, str | None):
                return False
            chars += len(value or "")
    return chars <= _INLINE_PROMPT


@attrs.define(eq=False)
class PromptEncoder:
    """Renders and tokenizes one model's prompts (any thread; ``tokenize`` on Trio's)."""

    #: mlx-lm's ``TokenizerWrapper``.
    tokenizer: Any
    #: The model's context length (None: unknown, no bound).
    context_length: int | None
    #: The model's vocabulary size, for token-id prompts (None: unknown).
    vocab_size: int | None
    #: Whether a chat's stable prefix is looked for (the lanes keep prompt-cache checkpoints).
    stable_prefixes: bool
    _encode_limiter: trio.CapacityLimiter = attrs.field(
        init=False, factory=lambda: trio.CapacityLimiter(_TOKENIZE_THREADS)
    )
    #: The longest vocabulary entry, in UTF-8 bytes: no token covers more input.
    _max_token_bytes: int = attrs.field(init=False, default=0)
    _stable: StablePrefix | None = attrs.field(init=False, default=None)

    def encode(
        self,
        prompt: Prompt,
        tools: Sequence[Any] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
        markers: tuple[str, str] | None = None,
        continue_final: bool = False,
    ) -> PreparedPrompt:
        """The prompt's tokens (see ``Engine.encode``); for a chat, whether it opens a
        reasoning block that ``markers`` delimit, and its stable prefix's length (the
        prompt cache's checkpoint: :mod:`trio_mlx._core.stable_prefix`)."""
        tokenizer = self.tokenizer
        checkpoint = None
        opened = False
        if isinstance(prompt, str | Sequence) and not isinstance(prompt, bytes | bytearray):
            self.refuse_oversized(prompt, tools=tools)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty", param="prompt")
            _check_unicode(prompt)
            bos = tokenizer.bos_token
            tokens = list(
                tokenizer.encode(
                    prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
                )
            )
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            if not prompt:
                raise InvalidRequest("the prompt is empty", param="prompt")
            if all(isinstance(m, Mapping) for m in prompt):
                text = self._render(prompt, tools, chat_template_kwargs, continue_final)
                _check_unicode(text)  # a message's lone surrogate: the tokenizer would raise
                opened = opens_reasoning(text, markers)
                tokens = list(tokenizer.encode(text, add_special_tokens=False))
                if self.stable_prefixes:
                    checkpoint = self._stable_prefix.find(
                        cast(Sequence[Mapping[str, Any]], prompt),
                        tools,
                        dict(chat_template_kwargs or {}),
                        tokens,
                    )
            else:
                tokens = self._token_ids(prompt)
        else:
            raise InvalidRequest(
                "the prompt must be a string, token ids or chat messages", param="prompt"
            )
        self.check_length(tokens)
        return PreparedPrompt(tuple(tokens), opened, checkpoint)

    def check_length(self, tokens: Sequence[int]) -> None:
        """Refuse a prompt of no tokens, or of more than the context holds."""
        if not tokens:
            raise InvalidRequest("the prompt tokenizes to nothing", param="prompt")
        limit = self.context_length
        if limit is not None and len(tokens) > limit:
            raise too_long(f"the prompt has {len(tokens)} tokens", limit)

    @property
    def _stable_prefix(self) -> StablePrefix:
        if self._stable is None:
            self._stable = StablePrefix(self.tokenizer)
        return self._stable

    async def tokenize(
        self,
        prompt: Prompt,
        tools: Sequence[Any] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
        markers: tuple[str, str] | None = None,
        continue_final: bool = False,
    ) -> PreparedPrompt:
        encode = partial(self.encode, prompt, tools, chat_template_kwargs, markers, continue_final)
        if _small(prompt, tools):
            return encode()
        return await trio.to_thread.run_sync(encode, limiter=self._encode_limiter)

    def refuse_oversized(self, prompt: Prompt, *, tools: Sequence[Any] | None = None) -> None:
        """Refuse, before rendering or tokenizing, a prompt that cannot fit the context.

        Raises :class:`~trio_mlx.InvalidRequest` (``context_length_exceeded``);
        ``encode`` calls it first, and so should anything else that renders
        a chat template (it walks the whole chat: call it off the event loop).

        No token covers more UTF-8 bytes than its vocabulary entry has, so a
        text of more bytes than the longest entry times the context has too
        many tokens; and chat templates mark every message with at least one
        token, so a chat has at least as many tokens as messages. For a chat
        the text counted is every string value the template renders: message
        contents and content parts, tool calls, tool results, and the tool
        definitions (:func:`~trio_mlx._core.prompt_size.rendered_bytes`). What is
        really rendered and tokenized is thus at most about ``context x
        longest entry`` bytes, whatever the body size.
        """
        limit = self.context_length
        if limit is None:
            return
        if not self._max_token_bytes:
            vocab = self.tokenizer.get_vocab()
            longest = max(
                (len(entry.encode("utf-8", "surrogatepass")) for entry in vocab), default=1
            )
            self._max_token_bytes = max(1, longest)
        cap = limit * self._max_token_bytes
        if isinstance(prompt, str):
            size = utf8_size(prompt)
        elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping):
            if len(prompt) > limit:
                raise too_long(f"the chat has {len(prompt)} messages", limit)
            size = rendered_bytes(tools or (), cap, keys=True)
            size += rendered_bytes(prompt, cap - size)
        else:
            if len(prompt) > limit:
                raise too_long(f"the prompt has {len(prompt)} tokens", limit)
            return
        if size > cap:
            raise too_long(f"the prompt's {size} bytes are more tokens", limit)

    def _render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None,
        template_kwargs: Mapping[str, Any] | None,
        continue_final: bool,
    ) -> str:
        """The chat rendered as text, once (tokenizing it is what ``tokenize=True`` does).

        ``continue_final``: the last (assistant) message is left open for the model
        to continue, instead of a new turn's header (Anthropic's prefill).
        """
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs may not set {', '.join(reserved)}",
                param="chat_template_kwargs",
            )
        if continue_final:
            kwargs.update(add_generation_prompt=False, continue_final_message=True)
        else:
            kwargs.update(add_generation_prompt=True)
        if tools:
            kwargs["tools"] = list(tools)
        try:
            text = str(
                self.tokenizer.apply_chat_template(
                    [dict(m) for m in messages], tokenize=False, **kwargs
                )
            )
        except Exception as exc:
            raise InvalidRequest(
                f"cannot apply the chat template: {exc}", param="messages"
            ) from None
        if continue_final and not text.rstrip().endswith(
            str(messages[-1].get("content", "")).rstrip()
        ):
            raise InvalidRequest(
                "this model's chat template cannot continue a final assistant message; "
                "end the messages with a user message",
                param="messages",
                code="unsupported_parameter",
            )
        return text

    def _token_ids(self, ids: Sequence[Any]) -> list[int]:
        vocab = self.vocab_size
        tokens = []
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest(f"{token!r} is not a token id", param="prompt")
            if isinstance(vocab, int) and token >= vocab:
                raise InvalidRequest(
                    f"token id {token} is outside the vocabulary ({vocab})", param="prompt"
                )
            tokens.append(token)
        return tokens
