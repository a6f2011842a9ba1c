"""Turn one row's generated tokens into deltas: text, stop strings, logprobs.

Runs on the MLX thread, next to the lane that produced the tokens, so the
Trio loop only routes finished :class:`RowEvent` values. Stop strings are
matched on decoded text (robust to how a tokenizer splits them); any tail
that could still grow into a stop string is held back, so text past a stop
is never emitted.
"""

from __future__ import annotations

from typing import Any

import attrs

from trio_mlx._params import SamplingParams, TokenLogprob

__all__ = ["RowEvent", "RowOutput", "StopScanner", "merge_events"]


@attrs.frozen
class RowEvent:
    """What one step produced for one request (batch row or serial job)."""

    id: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: "stop" or "length" when the request finished at this step.
    finish_reason: str | None = None
    #: Set when the request failed; it then ends with this error.
    error: BaseException | None = None
    #: Tokens generated in all, including an EOS that is not in ``token_ids``.
    generated: int = 0


def merge_events(events: list[RowEvent]) -> RowEvent:
    """One event for consecutive events of one row (a burst of decode steps).

    Only the last event may finish or fail the row: a burst ends at the first.
    """
    if len(events) == 1:
        return events[0]
    last = events[-1]
    ids: list[int] = []
    lps: list[TokenLogprob] | None = None
    for event in events:
        ids.extend(event.token_ids)
        if event.logprobs is not None:
            if lps is None:
                lps = []
            lps.extend(event.logprobs)
    return RowEvent(
        last.id,
        "".join([event.text for event in events]),
        tuple(ids),
        None if lps is None else tuple(lps),
        last.finish_reason,
        last.error,
        last.generated,
    )


@attrs.define
class StopScanner:
    """Finds the first stop string in streamed text, holding back possible starts."""

    stops: tuple[str, ...]
    #: Keep the matched stop string at the end of the text (``include_stop_str_in_output``).
    include: bool = False
    _held: str = ""

    def feed(self, text: str, *, final: bool = False, active: bool = True) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was found).

        While not ``active`` (before ``min_tokens``) no stop string ends the
        text; held-back text is released.
        """
        buf = self._held + text
        self._held = ""
        if not active:
            return buf, False
        best, length = -1, 0
        for stop in self.stops:
            index = buf.find(stop)
            if index >= 0 and (best < 0 or index < best):
                best, length = index, len(stop)
        if best >= 0:
            return buf[: best + length if self.include else best], True
        if final or not self.stops:
            return buf, False
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        if keep:
            self._held = buf[-keep:]
            return buf[:-keep], False
        return buf, False


@attrs.define(eq=False)
class RowOutput:
    """Per-request output state: a streaming detokenizer and a stop scanner.

    ``push`` turns one token into one event. A lane that runs several decode
    steps in one call uses ``add`` per token and ``take`` once: the same
    event as ``merge_events`` of the pushes, without one per token.
    """

    id: int
    params: SamplingParams
    eos_ids: frozenset[int]
    detokenizer: Any
    scanner: StopScanner = attrs.field(init=False)
    generated: int = 0
    #: What ``add`` gathered since the last ``take``.
    _text: list[str] = attrs.field(init=False, factory=list)
    _ids: list[int] = attrs.field(init=False, factory=list)
    _lps: list[TokenLogprob] | None = attrs.field(init=False, default=None)
    _finish: str | None = attrs.field(init=False, default=None)
    #: The EOS ids that end the row (none with ``ignore_eos``).
    _ends: frozenset[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.scanner = StopScanner(self.params.stop, self.params.include_stop_str_in_output)
        self._ends = frozenset() if self.params.ignore_eos else self.eos_ids

    def push(self, token: int, logprobs: Any, finish: str | None) -> RowEvent:
        """Take one generated token (and its log-probability vector) from a lane."""
        self.add(token, logprobs, finish)
        return self.take()

    def add(self, token: int, logprobs: Any, finish: str | None = None) -> str | None:
        """Take one token into the next ``take``; returns the finish reason it set, if any."""
        self.generated += 1
        if finish is None and self.generated >= self.params.max_tokens:
            finish = "length"
        active = self.generated >= self.params.min_tokens
        detokenizer = self.detokenizer
        if token in self._ends:
            detokenizer.finalize()
            text, _ = self.scanner.feed(detokenizer.last_segment, final=True, active=active)
            self._text.append(text)
            if self.params.logprobs and self._lps is None:
                self._lps = []
            self._finish = "stop"
            return "stop"
        detokenizer.add_token(token)
        segment = detokenizer.last_segment
        if finish is not None:
            detokenizer.finalize()
            segment += detokenizer.last_segment
        if self.params.stop:
            text, stopped = self.scanner.feed(segment, final=finish is not None, active=active)
            if stopped:
                finish = "stop"
        else:
            text = segment  # what the scanner returns when there is no stop string
        self._text.append(text)
        self._ids.append(token)
        lps = self._logprobs(token, logprobs)
        if lps is not None:
            if self._lps is None:
                self._lps = []
            self._lps.extend(lps)
        self._finish = finish
        return finish

    def take(self) -> RowEvent:
        """One event for every token added since the last ``take``."""
        text = self._text[0] if len(self._text) == 1 else "".join(self._text)
        lps = None if self._lps is None else tuple(self._lps)
        event = RowEvent(self.id, text, tuple(self._ids), lps, self._finish, None, self.generated)
        self._text.clear()
        self._ids.clear()
        self._lps = self._finish = None
        return event

    def _logprobs(self, token: int, vector: Any) -> tuple[TokenLogprob, ...] | None:
        if not self.params.logprobs or vector is None:
            return None
        import mlx.core as mx

        top: tuple[tuple[int, float], ...] = ()
        chosen = vector[token]
        k = self.params.top_logprobs
        if k > 0:
            indices = mx.argpartition(-vector, kth=k - 1)[:k]
            values = vector[indices]
            mx.eval(chosen, indices, values)  # one evaluation, not three
            ids: list[int] = indices.tolist()  # type: ignore[assignment]
            top = tuple(sorted(zip(ids, values.tolist(), strict=True), key=lambda p: -p[1]))
        return (TokenLogprob(token, float(chosen.item()), top),)
