"""Tool calls out of generated text, with the model's own mlx-lm tool parser.

mlx-lm's tokenizer knows a model's tool-call markers (``tool_call_start`` /
``tool_call_end``) and a parser for the text between them. The extractor
below splits streamed text into visible content and completed calls,
holding back a tail that could be the start of a marker so that no partial
``<tool_call>`` ever reaches the client.

Some formats have no end marker (mistral's ``[TOOL_CALLS]name[ARGS]{...}``:
``tool_call_end`` is ``""``): a call then runs to the next start marker or
to the end of generation, so its text is parsed when either arrives.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["ToolCall", "ToolCallExtractor", "held_back"]

logger = logging.getLogger("trio_mlx_http")


@attrs.frozen
class ToolCall:
    """One parsed call, in OpenAI's terms."""

    id: str
    name: str
    #: The arguments as a JSON string, as OpenAI sends them.
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """The ``tool_calls`` entry (with ``index`` when streaming)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker`` (held back from the
    client until the next piece says whether the marker follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@attrs.define
class ToolCallExtractor:
    """Feed text pieces; get back (visible text, completed tool calls)."""

    start: str
    end: str
    parser: Callable[[str, Any], Any]
    tools: list[dict[str, Any]] | None
    #: At most this many calls are returned (``parallel_tool_calls: false`` is 1).
    limit: int | None = None
    _pending: str = attrs.field(default="", init=False)
    _inside: bool = attrs.field(default=False, init=False)
    #: Calls parsed so far (a streamed call's ``index`` counts on from here).
    calls: int = attrs.field(default=0, init=False)

    @property
    def called(self) -> bool:
        """Whether any call was found (the finish reason is then "tool_calls")."""
        return self.calls > 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Take the next piece of generated text."""
        self._pending += text
        visible: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside and not self.end:
                # No end marker: the next start marker ends this call and opens another.
                at = self._pending.find(self.start)
                if at < 0:
                    break
                calls.extend(self._parse(self._pending[:at]))
                self._pending = self._pending[at + len(self.start) :]
            elif self._inside:
                at = self._pending.find(self.end)
                if at < 0:
                    break
                calls.extend(self._parse(self._pending[:at]))
                self._pending = self._pending[at + len(self.end) :]
                self._inside = False
            else:
                at = self._pending.find(self.start)
                if at < 0:
                    keep = held_back(self._pending, self.start)
                    cut = len(self._pending) - keep
                    visible.append(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    break
                visible.append(self._pending[:at])
                self._pending = self._pending[at + len(self.start) :]
                self._inside = True
        return "".join(visible), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of generation: flush held text, parse an unterminated call."""
        rest, self._pending = self._pending, ""
        if self._inside:
            self._inside = False
            return "", self._parse(rest)
        return rest, []

    def _parse(self, text: str) -> list[ToolCall]:
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            # A call cut short by max_tokens does not parse; mlx_lm.server drops it too.
            logger.warning("dropped a tool call that does not parse: %s", error)
            return []
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                continue
            arguments = item.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call_id = item.get("id") or f"call_{uuid.uuid4().hex[:24]}"
            calls.append(ToolCall(id=str(call_id), name=item["name"], arguments=arguments))
        if self.limit is not None:
            calls = calls[: max(0, self.limit - self.calls)]
        self.calls += len(calls)
        return calls
