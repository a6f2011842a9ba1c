"""A thinking model's reasoning, split out of the reply's content.

Models such as Qwen3 or DeepSeek-R1 write ``<think>…</think>`` before the
answer. mlx-lm's tokenizer knows a model's markers (``think_start`` /
``think_end``); ``--reasoning-markers`` overrides them. The splitter takes
streamed text and returns (reasoning, content) pieces, holding back a tail
that could be the start of a marker so no partial marker reaches the client.
Only the first reasoning block is split out; text after it is content (tool
calls included). A prompt that ends inside a reasoning block (templates that
open ``<think>`` themselves; ``PreparedPrompt.opens_reasoning`` says so) starts
the splitter inside it.
"""

from __future__ import annotations

import attrs

from trio_mlx_http._common.tools import held_back

__all__ = ["ReasoningSplitter"]


@attrs.define
class ReasoningSplitter:
    """Feed text pieces; get back (reasoning text, content text)."""

    start: str
    end: str
    #: "before" (no marker yet), "inside" (reasoning), "after" (all content).
    _state: str = attrs.field(default="before", init=False)
    _pending: str = attrs.field(default="", init=False)
    #: Leading whitespace of the reasoning and of the content after it is dropped.
    _trim: bool = attrs.field(default=False, init=False)

    @classmethod
    def opened(cls, start: str, end: str) -> ReasoningSplitter:
        """A splitter that starts inside the reasoning (the prompt opened it)."""
        splitter = cls(start, end)
        splitter._state = "inside"
        splitter._trim = True
        return splitter

    def feed(self, text: str, *, final: bool = False) -> tuple[str, str]:
        """Take the next piece of generated text; ``final`` flushes what is held."""
        buf = self._pending + text
        self._pending = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._state == "after":
                content.append(self._trimmed(buf))
                buf = ""
            elif self._state == "before":
                at = buf.find(self.start)
                if at >= 0:
                    content.append(buf[:at])
                    buf = buf[at + len(self.start) :]
                    self._state, self._trim = "inside", True
                    continue
                keep = 0 if final else held_back(buf, self.start)
                content.append(buf[: len(buf) - keep])
                self._pending = buf[len(buf) - keep :]
                buf = ""
            else:
                at = buf.find(self.end)
                if at >= 0:
                    reasoning.append(self._trimmed(buf[:at]))
                    buf = buf[at + len(self.end) :]
                    self._state, self._trim = "after", True
                    continue
                keep = 0 if final else held_back(buf, self.end)
                reasoning.append(self._trimmed(buf[: len(buf) - keep]))
                self._pending = buf[len(buf) - keep :]
                buf = ""
        return "".join(reasoning), "".join(content)

    def _trimmed(self, text: str) -> str:
        if not self._trim:
            return text
        text = text.lstrip()
        self._trim = not text
        return text
