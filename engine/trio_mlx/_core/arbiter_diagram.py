"""The arbiter's tables drawn for ``design/arbiter.md``: a Mermaid diagram and a table.

``python -m trio_mlx._core.arbiter_diagram design/arbiter.md`` rewrites the block
between the markers; ``tests/test_arbiter.py`` checks the note holds what the
tables say now.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trio_mlx._core.arbiter import TABLE, On, State, Transition, When

__all__ = [
    "DIAGRAM_BEGIN",
    "DIAGRAM_END",
    "render_block",
    "render_mermaid",
    "render_table",
    "replace_block",
]


DIAGRAM_BEGIN = (
    "<!-- BEGIN GENERATED DIAGRAM: python -m trio_mlx._core.arbiter_diagram design/arbiter.md -->"
)
DIAGRAM_END = "<!-- END GENERATED DIAGRAM -->"


def _label(row: Transition) -> str:
    if row.on is On.CLOSE:
        return "close"
    if row.on is On.AFTER_EVENT:
        return f"{row.when.value} / {row.does.value}"
    when = "" if row.when is When.OTHERWISE else f" [{row.when.value}]"
    return f"decide{when} / {row.does.value}"


def render_mermaid() -> str:
    """The state diagram of :data:`TABLE`, as a fenced Mermaid block."""
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {State.ADMITTING.name}"]
    lines += [f"    {r.state.name} --> {r.to.name}: {_label(r)}" for r in TABLE]
    lines += [f"    {State.CLOSED.name} --> [*]", "```"]
    return "\n".join(lines)


def render_table() -> str:
    """:data:`TABLE` as a Markdown table, rows in the order they are tried."""
    lines = ["| state | on | condition | does | next state |", "| --- | --- | --- | --- | --- |"]
    lines += [
        f"| {r.state.name} | {r.on.value} | {r.when.value} | {r.does.value} | {r.to.name} |"
        for r in TABLE
    ]
    return "\n".join(lines)


def render_block() -> str:
    """What ``design/arbiter.md`` holds between the diagram markers."""
    return f"{DIAGRAM_BEGIN}\n{render_mermaid()}\n\n{render_table()}\n{DIAGRAM_END}"


def replace_block(text: str) -> str:
    """``text`` with its generated block (markers included) replaced by :func:`render_block`."""
    start, end = text.index(DIAGRAM_BEGIN), text.index(DIAGRAM_END) + len(DIAGRAM_END)
    return text[:start] + render_block() + text[end:]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
        path.write_text(replace_block(path.read_text()))
    else:
        print(render_block())
