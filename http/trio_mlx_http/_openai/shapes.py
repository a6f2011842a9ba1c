"""OpenAI's response and chunk shapes for chat and text completions.

Pure functions from engine values (:class:`trio_mlx.TokenLogprob`,
:class:`trio_mlx.GenerationResult`) to JSON-ready dicts; no I/O.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from trio_mlx import GenerationResult, TokenLogprob
from trio_mlx_http._common.cache_usage import cache_usage

__all__ = [
    "Envelope",
    "TokenTexts",
    "chat_logprobs",
    "completion_logprobs",
    "prompt_completion_logprobs",
    "usage",
]

#: What OpenAI reports for a log-probability of minus infinity (JSON has no -inf).
_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


@attrs.define
class TokenTexts:
    """The text of single tokens, decoded once each (for logprobs)."""

    tokenizer: Any
    _cache: dict[int, str] = attrs.field(factory=dict, init=False)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id]))
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = text
        return text


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}


def chat_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """Chat's ``choices[].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for item in logprobs:
        entry = _entry(texts, item.token_id, item.logprob)
        entry["top_logprobs"] = [_entry(texts, tid, lp) for tid, lp in item.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0
) -> dict[str, Any]:
    """Legacy completions' ``choices[].logprobs``: parallel lists, top as {token: logprob}."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for item in logprobs:
        text = texts(item.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(item.logprob))
        top.append({texts(tid): _lp(lp) for tid, lp in item.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_completion_logprobs(
    first: int, scored: Sequence[TokenLogprob], texts: TokenTexts
) -> dict[str, Any]:
    """Legacy completions' logprobs of an echoed prompt: the first token has none (null)."""
    rest = completion_logprobs(scored, texts, len(texts(first)))
    return {
        "tokens": [texts(first), *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def usage(results: Sequence[GenerationResult], n: int = 1) -> dict[str, Any]:
    """The ``usage`` object of one request: ``results`` prompt-major, ``n`` choices per prompt.

    Choices of one prompt share it, so its tokens count once (as OpenAI counts them).
    """
    firsts = results[::n]
    prompt_tokens = sum(r.prompt_tokens for r in firsts)
    completion_tokens = sum(r.completion_tokens for r in results)
    cached = sum(cache_usage(r).read for r in firsts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@attrs.frozen
class Envelope:
    """The fields every response and chunk of one request shares."""

    id: str
    object: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))

    @classmethod
    def chat(cls, model: str, *, chunk: bool = False) -> Envelope:
        """For ``/v1/chat/completions``."""
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        return cls(id=f"chatcmpl-{uuid.uuid4().hex}", object=kind, model=model)

    @classmethod
    def text(cls, model: str) -> Envelope:
        """For ``/v1/completions`` (chunks share the object name)."""
        return cls(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", model=model)

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A response or chunk with these choices."""
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
