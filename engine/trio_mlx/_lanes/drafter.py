"""Draft tokens for speculative decoding: prompt lookup (pure, no model), or a draft model.

:class:`PromptLookup` keeps, for one row, where each n-gram of its tokens (its
prompt and its output) last ended. A draft is what followed the latest earlier
occurrence of the row's last ``n`` tokens, longest ``n`` first: a model that
rewrites code or tool output it was shown repeats long runs of its prompt, and
those runs are drafted for free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ModelDraft", "PromptLookup"]


class PromptLookup:
    """One row's n-gram index over its tokens (fed incrementally)."""

    __slots__ = ("_ends", "longest", "shortest", "tokens")
    #: Drafts are lists of token ids, looked up from the pending token's value.
    lazy = False

    def __init__(self, longest: int = 3, shortest: int = 2) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError("n-gram sizes need 1 <= shortest <= longest")
        self.longest = longest
        self.shortest = shortest
        self.tokens: list[int] = []
        #: For each size n (index n - shortest): n-gram -> the index of its last token,
        #: latest occurrence.
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(shortest, longest + 1)]

    def feed(self, history: Sequence[int]) -> None:
        """Catch up with ``history``, the row's tokens so far (it only grows)."""
        tokens = self.tokens
        start = len(tokens)
        if len(history) < start:  # a row started over: index it again
            self.__init__(self.longest, self.shortest)  # type: ignore[misc]
            tokens, start = self.tokens, 0
        tokens.extend(history[start:])
        for end in range(start, len(tokens)):
            for i, n in enumerate(range(self.shortest, self.longest + 1)):
                if end + 1 >= n:
                    self._ends[i][tuple(tokens[end + 1 - n : end + 1])] = end

    def draft(self, last: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow the row's tokens and then ``last`` (the
        token it is about to take, not fed yet)."""
        if limit <= 0:
            return []
        tokens = self.tokens
        for i in range(self.longest - self.shortest, -1, -1):
            n = i + self.shortest
            if len(tokens) + 1 < n:
                continue
            key = (*tokens[len(tokens) + 1 - n :], last) if n > 1 else (last,)
            end = self._ends[i].get(key)
            if end is None:
                continue
            # What followed, copied as LZ77 copies: a run that overlaps the row's end
            # (a loop) goes on from the draft itself.
            found = tokens[end + 1 : end + 1 + limit]
            whole = len(tokens) + 1
            while len(found) < limit:
                at = end + 1 + len(found)
                found.append(last if at == len(tokens) else found[at - whole])
            return found
        return []

    def settle(self, accepted: int) -> None:
        """Nothing to undo: the index follows the row's tokens."""


class ModelDraft:
    """One row's drafts from a small draft model sharing the target's tokenizer: its own
    KV cache over the row's tokens, greedy drafts (so a draft is deterministic and the
    target's rejection rule for a one-hot draft applies), cut back to what the target
    accepted (:meth:`settle`). Its drafts are lazy arrays (:attr:`lazy`): a step drafts
    from the pending token before it is read."""

    __slots__ = ("_base", "_cache", "_fed", "model", "tokens")
    #: Drafts are lazy arrays of ``limit`` tokens, drafted from a lazy pending token.
    lazy = True

    def __init__(self, model: Any) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self._cache = make_prompt_cache(model)
        #: Tokens the cache holds; the row's length before the last draft.
        self._fed = 0
        self._base = 0
        self.tokens: Sequence[int] = ()

    def feed(self, history: Sequence[int]) -> None:
        if len(history) < self._fed:  # a row started over
            self.__init__(self.model)  # type: ignore[misc]
        self.tokens = history

    def draft(self, last: Any, limit: int) -> Any:
        """``limit`` greedy drafts to follow the row's tokens and ``last`` (its pending
        token, a lazy one-element array) as one lazy ``(limit,)`` array: nothing is
        evaluated here, so the drafts, the target's verification and the pending token
        are read back in the step's one evaluation."""
        import mlx.core as mx

        history = self.tokens
        last = mx.reshape(last, (1,))
        if limit <= 0:
            return last[:0]
        fresh = history[self._fed :]
        new = mx.concatenate([mx.array(list(fresh), dtype=last.dtype), last]) if fresh else last
        logits = self.model(new[None], cache=self._cache)[:, -1, :]
        out: list[Any] = []
        while True:
            out.append(mx.argmax(logits, axis=-1).astype(last.dtype))
            if len(out) == limit:
                break
            logits = self.model(out[-1][None], cache=self._cache)[:, -1, :]
        self._base = len(history) + 1
        self._fed = self._base + limit - 1  # the last draft was never fed
        return mx.concatenate(out)

    def settle(self, accepted: int) -> None:
        """The target took ``accepted`` of the last draft: forget the rest."""
        keep = self._base + accepted
        if keep < self._fed:
            for layer in self._cache:
                layer.trim(self._fed - keep)
            self._fed = keep
