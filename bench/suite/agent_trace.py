"""An agent session as a client replays it: seeded, deterministic chat turns.

A coding agent sends one long system prompt (its instructions and its tool
definitions), the user's task, and then, turn after turn, the whole
conversation so far plus one new tool result. Its own replies come back
shortened: a client that strips the reasoning block (or keeps only a summary)
sends turn n's reply as a few words, not as the tokens the server generated.
So turn n + 1 shares turn n's prompt but not turn n's full reply: the prompt
cache must serve the prompt, never the reply, for the next turn's prefill to
be only the new tool result.

Every text comes from CPython's documentation (:func:`trio_mlx.testing.corpus_text`),
cut to a token count with the model's own tokenizer, at seeded offsets: the
same size and seed give the same session on every server.
"""

from __future__ import annotations

import json
import random
from typing import Any

import attrs

__all__ = ["AgentSize", "Session", "build_session", "context_needed"]

#: Tool names of the session, as a coding agent defines them.
TOOLS = (
    "read_file", "write_file", "edit_file", "list_directory", "glob", "grep", "run_shell",
    "run_tests", "git_status", "git_diff", "git_log", "web_fetch", "web_search", "todo_write",
    "ask_user", "python_eval", "find_symbol", "open_url", "lint", "format_code", "type_check",
    "create_branch", "apply_patch", "notebook_edit",
)  # fmt: skip

PREAMBLE = (
    "You are a coding agent working in the user's repository. Use the tools below to read, "
    "search and change files; call one tool at a time and wait for its result. Keep replies "
    "short: say what you found and what you do next.\n\n# Tools\n"
)

TASK = "Find why the tests in tests/test_parser.py fail on Python 3.12 and fix it."


@attrs.frozen
class AgentSize:
    """How big a replayed session is: the system prompt, the turns and their tool results."""

    #: Tokens of the system prompt (instructions and tool definitions), about.
    system_tokens: int = attrs.field(validator=attrs.validators.ge(64))
    #: Turns; each adds one tool result (turn 1 is the cold prefill).
    turns: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    #: Tokens of a tool result: drawn uniformly from this range, per turn.
    tool_tokens: tuple[int, int] = attrs.field(default=(500, 3000))
    #: Tokens each reply may generate (the client keeps only a short summary of it).
    max_tokens: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    seed: int = 0

    @tool_tokens.validator
    def _check_range(self, _: Any, value: tuple[int, int]) -> None:
        if not 1 <= value[0] <= value[1]:
            raise ValueError(f"tool_tokens must be (lo, hi) with 1 <= lo <= hi, not {value}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentSize:
        """The size from a profile's ``agent`` entry (JSON: the range as a list)."""
        fields = {k: v for k, v in data.items() if k in attrs.fields_dict(cls)}
        if "tool_tokens" in fields:
            fields["tool_tokens"] = tuple(fields["tool_tokens"])
        return cls(**fields)


def context_needed(size: AgentSize) -> int:
    """Context (tokens) that holds the session's last turn and its reply, with room to spare."""
    per_turn = size.tool_tokens[1] + 96  # the tool result, the short reply, the template's marks
    need = size.system_tokens + 256 + size.turns * per_turn + size.max_tokens
    return -(-need // 4096) * 4096


@attrs.frozen
class Session:
    """The session's texts; :meth:`messages` builds each turn's request."""

    system: str
    task: str
    #: Per turn: the assistant's tool call before its result (name, arguments).
    calls: tuple[tuple[str, str], ...]
    #: Per turn: the shortened reply the client sends back for the turn before.
    summaries: tuple[str, ...]
    tool_results: tuple[str, ...]

    @property
    def turns(self) -> int:
        """How many turns the session has."""
        return len(self.tool_results)

    def messages(self, turn: int) -> list[dict[str, Any]]:
        """Turn ``turn``'s (1-based) messages: everything so far and the newest tool result."""
        if not 1 <= turn <= self.turns:
            raise ValueError(f"turn must be in 1..{self.turns}, not {turn}")
        out: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.task},
        ]
        for k in range(turn):
            name, arguments = self.calls[k]
            call_id = f"call_{k:03d}"
            out.append(
                {
                    "role": "assistant",
                    "content": self.summaries[k],
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": arguments},
                        }
                    ],
                }
            )
            out.append({"role": "tool", "tool_call_id": call_id, "content": self.tool_results[k]})
        return out


class _Cutter:
    """Texts of a given token count, cut from the corpus at seeded offsets."""

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        from trio_mlx.testing import corpus_text

        self.corpus = corpus_text()
        self.tokenizer = tokenizer
        self.rng = rng

    def text(self, tokens: int) -> str:
        start = self.rng.randrange(len(self.corpus))
        chars = tokens * 8 + 64  # more than enough: BPE tokens of English are ~3-5 chars
        piece = (self.corpus[start:] + "\n\n" + self.corpus)[:chars]
        ids = self.tokenizer.encode(piece, add_special_tokens=False)[:tokens]
        return str(self.tokenizer.decode(ids))


def _tool(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "a path in the repository"},
                    "query": {"type": "string"},
                },
                "required": ["path"],
            },
        },
    }


def _system_prompt(cutter: _Cutter, tokens: int) -> str:
    """The preamble and JSON tool definitions, their descriptions sized to reach ``tokens``.

    A small prompt holds fewer tools, each with a description at least as long as
    its definition's skeleton.
    """

    def count(text: str) -> int:
        return len(cutter.tokenizer.encode(text, add_special_tokens=False))

    skeleton = count(json.dumps([_tool(TOOLS[0], "")]))
    room = max(0, tokens - count(PREAMBLE))
    n = max(1, min(len(TOOLS), room // (2 * skeleton)))
    per_tool = max(1, room // n - skeleton)
    tools = [_tool(name, cutter.text(per_tool)) for name in TOOLS[:n]]
    return PREAMBLE + json.dumps(tools)


def build_session(tokenizer: Any, size: AgentSize) -> Session:
    """The session ``size`` describes, its texts cut with ``tokenizer`` (seeded by ``size.seed``)."""
    rng = random.Random(size.seed)
    cutter = _Cutter(tokenizer, rng)
    system = _system_prompt(cutter, size.system_tokens)
    calls, summaries, results = [], [], []
    for k in range(size.turns):
        name = TOOLS[rng.randrange(len(TOOLS))]
        path = f"src/parser/module_{rng.randrange(100):02d}.py"
        calls.append((name, json.dumps({"path": path})))
        # What a client keeps of a reply: a fixed short line, never the generated text.
        first = "Let me look at the failing test first." if k == 0 else f"Step {k}: noted."
        summaries.append(f"{first} Calling {name} on {path}.")
        results.append(cutter.text(rng.randint(*size.tool_tokens)))
    return Session(system, TASK, tuple(calls), tuple(summaries), tuple(results))
