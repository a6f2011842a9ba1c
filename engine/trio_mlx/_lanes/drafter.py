"""Draft tokens for speculative decoding by prompt lookup (pure, no model).

:class:`PromptLookup` keeps, for one row, where each n-gram of its tokens (its
prompt and its output) last ended. A draft is what followed the latest earlier
occurrence of the row's last ``n`` tokens, longest ``n`` first: a model that
rewrites code or tool output it was shown repeats long runs of its prompt, and
those runs are drafted for free. A step drafts before it reads the token it is about
to take (:meth:`PromptLookup.following`), so looking costs no read back.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PromptLookup"]


class PromptLookup:
    """One row's n-gram index over its tokens (fed incrementally)."""

    __slots__ = ("_ends", "longest", "shortest", "tokens")

    def __init__(self, longest: int = 3, shortest: int = 2) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError("n-gram sizes need 1 <= shortest <= longest")
        self.longest = longest
        self.shortest = shortest
        self.tokens: list[int] = []
        #: For each size n (index n - shortest): n-gram -> the index of its last token,
        #: latest occurrence.
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(shortest, longest + 1)]

    def feed(self, history: Sequence[int], end: int | None = None) -> None:
        """Catch up with ``history[:end]``, the row's tokens so far (they only grow)."""
        tokens = self.tokens
        start = len(tokens)
        stop = len(history) if end is None else end
        if stop < start:  # a row started over: index it again
            self.__init__(self.longest, self.shortest)  # type: ignore[misc]
            tokens, start = self.tokens, 0
        tokens.extend(history[start:stop])
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

    def following(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow ``history`` and then the token the row is
        about to take, which is not read: what followed the latest earlier occurrence of
        ``history``'s last tokens, less its first token (the guess of that one). A guess
        that was wrong only costs the drafts' acceptance: the target verifies them."""
        if not history:
            return []
        self.feed(history, len(history) - 1)
        return self.draft(history[-1], limit + 1)[1:]

    def settle(self, accepted: int) -> None:
        """Nothing to undo: the index follows the row's tokens."""
