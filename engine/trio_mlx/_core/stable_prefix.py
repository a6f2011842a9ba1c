"""Where a chat's stable prefix ends: its system prompt and tools, the part an
agent resends unchanged every turn (the prompt cache keeps a checkpoint there).

The chat template is rendered for the chat's leading system (or developer)
messages followed by an empty user message, with the same tools and template
arguments, and compared token by token with the whole prompt: the first token
where they differ is where the first other message's content (or its header)
starts. Whatever the template does (a system block of its own, the system text
folded into the first user turn, tools rendered before or after it), the
position is one where the two renderings agree, so every token before it is
the prompt's own. The rendered head is kept per (messages, tools, arguments)
for a few chats, so a long system prompt is not tokenized twice per turn.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = ["StablePrefix"]

_SYSTEM_ROLES = frozenset({"system", "developer"})


@attrs.define(eq=False)
class StablePrefix:
    """Finds a chat prompt's stable prefix (see the module)."""

    tokenizer: Any
    #: Rendered heads kept (least recently used dropped first).
    max_heads: int = 16
    _heads: OrderedDict[str, list[int]] = attrs.field(init=False, factory=OrderedDict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def find(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        template_kwargs: Mapping[str, Any],
        tokens: Sequence[int],
    ) -> int | None:
        """The stable prefix's length in ``tokens`` (the whole chat's), or None
        when the chat has neither system messages nor tools, or it is empty."""
        lead = 0
        while lead < len(messages) and messages[lead].get("role") in _SYSTEM_ROLES:
            lead += 1
        if lead == 0 and not tools:
            return None
        probe = [dict(m) for m in messages[:lead]] + [{"role": "user", "content": ""}]
        kwargs = {**template_kwargs, "add_generation_prompt": False, "tokenize": True}
        if tools:
            kwargs["tools"] = list(tools)
        head = self._head(probe, kwargs)
        if head is None:
            return None
        n = next(
            (i for i, (a, b) in enumerate(zip(head, tokens, strict=False)) if a != b),
            min(len(head), len(tokens)),
        )
        return n if 0 < n < len(tokens) else None

    def _head(self, probe: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int] | None:
        try:
            text = json.dumps([probe, kwargs], sort_keys=True, default=str)
        except (TypeError, ValueError):
            return None
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        with self._lock:
            head = self._heads.get(digest)
            if head is not None:
                self._heads.move_to_end(digest)
                return head
        try:
            head = list(self.tokenizer.apply_chat_template(probe, **kwargs))
        except Exception:
            return None  # a template that refuses an empty user turn: no checkpoint
        with self._lock:
            self._heads[digest] = head
            while len(self._heads) > self.max_heads:
                self._heads.popitem(last=False)
        return head
