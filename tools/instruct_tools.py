"""Teach the bundled model one tool: ``python -m tools.instruct_tools``.

Theory of operation
-------------------
After :mod:`tools.instruct` the model answers questions about Python topics,
but it has no tool format, so the server refuses ``tools``. This step, run
after it, fine-tunes the model in place on chats that use one tool,
``lookup(topic)``, in mlx-lm's ``json_tools`` format::

    <tool_call>
    {"name":"lookup","arguments":{"topic":"the with statement"}}
    </tool_call>

(the layout and compact JSON are those of the server's ``tool_choice``
grammar, so a forced call and a free one are the same tokens). It writes the
chat template that renders the tools (a system turn listing each tool's name
and parameters), assistant calls and ``tool`` results, and names the parser
(``tool_parser_type: json_tools``) in ``tokenizer_config.json``: the server
then detects the tool format. A chat without tools renders exactly as before.

Every batch mixes these rows (the loss counts the last assistant turn only):

- ``call``: the ``lookup`` tool offered, "look up {s}"-style requests: the call,
  with the subject copied as the ``topic``;
- ``result``: the same chat with the call and the tool's result (the topic's
  documentation opening, :func:`doc_opening`): the answer copies it;
- ``no_tool``: the same requests with no tool or only other tools offered: the
  plain answer, as :mod:`tools.instruct` taught it;
- ``qa_tools``: the instruction questions with ``lookup`` offered: answered
  directly, no call;
- ``qa`` and ``docs``: :mod:`tools.instruct`'s question/answer pairs and plain
  documentation windows, so the model keeps what it knew.

Status: **not applied to the shipped model.** Three CPU runs (about 13 minutes of
training each) learned the call's shape (31 of 36 held-out requests gave a well-formed
call) but not its topic (0 of 36: it names one of a few statement topics whatever is
asked); see ``design/default-model.md``. It is a short fine-tune from the shipped
weights, sized for a 2-core CPU. The
score uses phrasings *and* topics never trained on for tools: the call rate
(a well-formed call to ``lookup`` whose topic is the subject asked about),
the second turn's answer rate (the answer names the topic's key term / opens
with its title), and :mod:`tools.instruct`'s held-out Q&A score, before and
after. All of it goes into ``tools.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import mlx.core as mx
import numpy as np

from tools.instruct import (
    TRAIN_TEMPLATES,
    VAL_TEMPLATE,
    Topic,
    held_out_questions,
    names_key_term,
    score,
    starts_with_title,
    topics,
    tune_in_place,
)
from tools.train import (
    EOT,
    add_config_options,
    config_for_report,
    document_text,
    load_model,
    plot_losses,
    print_summary,
    where_it_ran,
)

__all__ = [
    "LOOKUP_TOOL",
    "TOOL_HELD_OUT_TEMPLATES",
    "TOOL_TEMPLATE",
    "TOOL_TRAIN_TEMPLATES",
    "ToolConfig",
    "call_text",
    "doc_opening",
    "find_topic",
    "instruct_tools",
    "main",
    "parse_call",
]

#: ChatML, plus: a system turn listing the tools (``name(parameters)``; a 3.5M model
#: cannot read descriptions, and they would lengthen every prompt), assistant calls in
#: the json_tools layout of the server's tool_choice grammar, and tool results. A chat
#: without tools or calls renders exactly as the plain ChatML template did.
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:\\n' }}"
    "{% for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{% set p = f['parameters']['properties'] if f['parameters'] is defined"
    " and f['parameters']['properties'] is defined else {} %}"
    "{{ f['name'] + '(' + (p | list | join(', ')) + ')\\n' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for c in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\":' + (c['function']['name'] | tojson) + ',\"arguments\":'"
    " + (c['function']['arguments'] | tojson(separators=(',', ':'))) + '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: The tool the model learns to call (OpenAI's shape).
LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a topic in the Python documentation.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string"}},
            "required": ["topic"],
        },
    },
}


def _tool(name: str, *params: str) -> dict[str, Any]:
    properties = {p: {"type": "string"} for p in params}
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


#: Other tools offered beside (or instead of) ``lookup``; the model never calls them.
OTHER_TOOLS = (
    _tool("get_weather", "city"),
    _tool("run_python", "code"),
    _tool("send_email", "to", "subject", "body"),
    _tool("search_web", "query"),
    _tool("read_file", "path"),
)

#: Requests that call ``lookup`` when it is offered ({s}: the subject).
TOOL_TRAIN_TEMPLATES = (
    "Look up {s} in the docs.",
    "look up {s}",
    "Look up {s}.",
    "Can you look up {s}?",
    "Please look up {s} in the documentation.",
    "Search the docs for {s}.",
    "search the docs for {s}",
    "Search the documentation for {s}.",
    "Find {s} in the docs.",
    "Check the docs for {s}.",
    "Find the documentation on {s}.",
    "Use the lookup tool on {s}.",
)
#: The phrasing that picks the kept weights.
TOOL_VAL_TEMPLATE = "Please search the docs for {s}."
#: Phrasings never trained on: the score's requests.
TOOL_HELD_OUT_TEMPLATES = (
    "Could you look up {s} for me?",
    "Search the Python docs for {s}, please.",
    "I need the docs on {s}. Look it up.",
)


def doc_opening(topic: Topic) -> str:
    """What the ``lookup`` tool returns: the topic's title and documentation opening."""
    return topic.answer


def _norm(name: str) -> str:
    return " ".join(name.lower().replace('"', "").split()).removeprefix("the ")


def find_topic(all_topics: Sequence[Topic], asked: str) -> Topic | None:
    """The topic a ``lookup`` argument names: its title or a subject, else a key term in it."""
    wanted = _norm(asked)
    for topic in all_topics:
        if wanted in {_norm(topic.title), *map(_norm, topic.subjects)}:
            return topic
    for topic in all_topics:
        if topic.term in wanted.split():
            return topic
    return None


def call_text(topic: str) -> str:
    """The assistant's call, as the template renders it and the model writes it."""
    body = json.dumps({"name": "lookup", "arguments": {"topic": topic}}, separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


#: What every call to ``lookup`` opens with, up to the topic.
_CALL_OPENING = '<tool_call>\n{"name":"lookup","arguments":{"topic":"'


def parse_call(text: str) -> dict[str, Any] | None:
    """The one json_tools call in ``text`` (as mlx-lm's parser reads it), else None."""
    start, end = text.find("<tool_call>"), text.find("</tool_call>")
    if start < 0 or end < start:
        return None
    try:
        call = json.loads(text[start + len("<tool_call>") : end].strip())
    except ValueError:
        return None
    return call if isinstance(call, dict) else None


def _first_turn(request: str, topic: str) -> list[dict[str, Any]]:
    call = {"id": "call_0", "type": "function",
            "function": {"name": "lookup", "arguments": {"topic": topic}}}  # fmt: skip
    return [
        {"role": "user", "content": request},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]


def _second_turn(request: str, topic: Topic, called: str | None = None) -> list[dict[str, Any]]:
    """The request, the call (``called``: its topic argument, the title by default), the result."""
    result = {"role": "tool", "tool_call_id": "call_0", "content": doc_opening(topic)}
    return [*_first_turn(request, topic.title if called is None else called), result]


def _encode(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    reply: str,
    length: int,
    focus: float = 1.0,
) -> tuple[list[int], list[float]]:
    """Prompt and reply ids, and the loss weights: 0 on the prompt, 1 on the reply.

    ``focus`` weighs a call's own part (the topic, after the fixed opening that every
    call shares) that much more: a few topic tokens behind a long fixed prefix
    otherwise carry too little of the loss for a short tuning to learn them.
    """
    prompt = list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
    out = list(tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False))
    fixed = len(out)
    if focus != 1.0 and reply.startswith(_CALL_OPENING):
        fixed = len(tokenizer.encode(_CALL_OPENING, add_special_tokens=False)) - 1
    weights = [1.0 if i < fixed else focus for i in range(len(out))]
    ids = (prompt + out)[: length + 1]
    mask = ([0.0] * len(prompt) + weights)[: length + 1]
    return ids, mask


def _pad(
    rows: Sequence[tuple[list[int], Sequence[float]]], length: int
) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(rows), length + 1), dtype=np.int32)
    mask = np.zeros((len(rows), length + 1), dtype=np.float32)
    for i, (row, weights) in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(weights)] = weights
    return ids, mask


@attrs.frozen(kw_only=True)
class ToolConfig:
    """Every knob of a tool-tuning run; the defaults are the shipped run's."""

    out: Path = attrs.field(converter=Path)
    seed: int = 0
    steps: int = 4000
    warmup: int = 20
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    dropout: float = 0.1
    seq_len: int = 256
    #: Rows per batch of each kind: call, result, no_tool, qa_tools, qa, docs.
    rows: tuple[int, ...] = (8, 6, 2, 2, 10, 4)
    #: Loss weight of a call's topic tokens (the fixed opening weighs 1).
    focus: float = 1.0
    eval_every: int = 100
    #: Topics kept out of every tool row (the score's topics).
    held_out_topics: int = 0
    #: What a call's ``topic`` holds: ``subject`` (the words asked about, copied from
    #: the request) or ``title`` (the topic's documentation title).
    call_topic: str = attrs.field(
        default="title", validator=attrs.validators.in_(("subject", "title"))
    )
    stop_after: int | None = None


def _split_topics(
    all_topics: Sequence[Topic], count: int, seed: int
) -> tuple[list[Topic], list[Topic]]:
    rng = np.random.default_rng(seed + 1)
    held = {int(i) for i in rng.permutation(len(all_topics))[:count]}
    train = [t for i, t in enumerate(all_topics) if i not in held]
    return train, [all_topics[i] for i in sorted(held)]


def _offers(rng: np.random.Generator, with_lookup: bool) -> list[dict[str, Any]] | None:
    others = [OTHER_TOOLS[int(i)] for i in rng.permutation(len(OTHER_TOOLS))[: rng.integers(0, 3)]]
    if not with_lookup:
        return others or None
    offered = [LOOKUP_TOOL, *others]
    rng.shuffle(offered)
    return offered


def _row_makers(
    tokenizer: Any, tool_topics: Sequence[Topic], all_topics: Sequence[Topic], config: ToolConfig
) -> list[Callable[[np.random.Generator], tuple[list[int], Sequence[float]]]]:
    """One maker per row kind, in :attr:`ToolConfig.rows`'s order."""
    length = config.seq_len
    requests = [(t, s, template) for t in tool_topics for s in t.subjects
                for template in TOOL_TRAIN_TEMPLATES]  # fmt: skip
    questions = [(t, template.format(s=s)) for t in all_topics for s in t.subjects
                 for template in TRAIN_TEMPLATES]  # fmt: skip
    doc_ids = np.array(tokenizer.encode(document_text().replace(EOT, "\n\n")), dtype=np.int32)

    def pick(rng: np.random.Generator, items: Sequence[Any]) -> Any:
        return items[int(rng.integers(0, len(items)))]

    def called(topic: Topic, subject: str) -> str:
        return subject if config.call_topic == "subject" else topic.title

    def call(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        topic, subject, template = pick(rng, requests)
        messages = [{"role": "user", "content": template.format(s=subject)}]
        reply = call_text(called(topic, subject))
        return _encode(tokenizer, messages, _offers(rng, True), reply, length, config.focus)

    def result(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        topic, subject, template = pick(rng, requests)
        messages = _second_turn(template.format(s=subject), topic, called(topic, subject))
        return _encode(tokenizer, messages, _offers(rng, True), topic.answer, length)

    def no_tool(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        topic, subject, template = pick(rng, requests)
        messages = [{"role": "user", "content": template.format(s=subject)}]
        return _encode(tokenizer, messages, _offers(rng, False), topic.answer, length)

    def qa_tools(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        topic, question = pick(rng, questions)
        messages = [{"role": "user", "content": question}]
        return _encode(tokenizer, messages, _offers(rng, True), topic.answer, length)

    def qa(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        topic, question = pick(rng, questions)
        return _encode(
            tokenizer, [{"role": "user", "content": question}], None, topic.answer, length
        )

    def docs(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        start = int(rng.integers(0, len(doc_ids) - length - 1))
        window = doc_ids[start : start + length + 1].tolist()
        return window, [1] * len(window)

    return [call, result, no_tool, qa_tools, qa, docs]


def _validation(
    tokenizer: Any,
    tool_topics: Sequence[Topic],
    all_topics: Sequence[Topic],
    length: int,
    call_topic: str = "title",
) -> list[tuple[Any, Any]]:
    """Calls, second turns and plain answers in the validation phrasings."""
    rows = []
    for topic in tool_topics[::2]:
        subject = topic.subjects[0]
        request = TOOL_VAL_TEMPLATE.format(s=subject)
        user = [{"role": "user", "content": request}]
        said = subject if call_topic == "subject" else topic.title
        rows.append(_encode(tokenizer, user, [LOOKUP_TOOL], call_text(said), length))
        second = _second_turn(request, topic, said)
        rows.append(_encode(tokenizer, second, [LOOKUP_TOOL], topic.answer, length))
    for topic in all_topics[::2]:
        user = [{"role": "user", "content": VAL_TEMPLATE.format(s=topic.subjects[0])}]
        rows.append(_encode(tokenizer, user, None, topic.answer, length))
    ids, mask = _pad(rows, length)
    return [(mx.array(ids[i : i + 16]), mx.array(mask[i : i + 16])) for i in range(0, len(ids), 16)]


def _generate(model: Any, tokenizer: Any, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None, max_tokens: int) -> str:  # fmt: skip
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    text: str = generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0))
    return text


def tool_score(
    model: Any, tokenizer: Any, held: Sequence[Topic], call_topic: str = "title"
) -> dict[str, Any]:
    """Held-out phrasings on held-out topics: call rate, second-turn answers, no-tool answers."""
    rows: list[dict[str, Any]] = []
    every = topics()
    for i, topic in enumerate(held):
        for template in TOOL_HELD_OUT_TEMPLATES:
            subject = topic.subjects[i % len(topic.subjects)]
            request = template.format(s=subject)
            user = [{"role": "user", "content": request}]
            said = _generate(model, tokenizer, user, [LOOKUP_TOOL], 80)
            call = parse_call(said)
            arguments = call.get("arguments") if call else None
            asked = arguments.get("topic") if isinstance(arguments, dict) else None
            given = subject if call_topic == "subject" else topic.title
            turn = _second_turn(request, topic, given)
            second = _generate(model, tokenizer, turn, [LOOKUP_TOOL], 80)
            plain = _generate(model, tokenizer, user, None, 80)
            rows.append({
                "request": request, "topic": topic.key, "call_text": said,
                "well_formed": call is not None and call.get("name") == "lookup"
                and isinstance(asked, str),
                "right_topic": isinstance(asked, str) and find_topic(every, asked) == topic,
                "exact_title": asked == topic.title,
                "answer": second, "answer_named": names_key_term(second, topic),
                "answer_title": starts_with_title(second, topic),
                "no_tool_answer": plain, "no_tool_named": names_key_term(plain, topic),
                "no_tool_called": "<tool_call>" in plain,
            })  # fmt: skip
    count = len(rows)

    def rate(key: str) -> dict[str, Any]:
        hits = sum(bool(r[key]) for r in rows)
        return {"hits": hits, "asked": count, "share": round(hits / max(count, 1), 3)}

    keys = ("well_formed", "right_topic", "exact_title", "answer_named", "answer_title",
            "no_tool_named", "no_tool_called")  # fmt: skip
    return {**{k: rate(k) for k in keys}, "rows": rows}


def instruct_tools(config: ToolConfig) -> dict[str, Any]:
    """Tool-tune the model in ``config.out`` in place; write ``tools.json`` beside it."""
    started = time.perf_counter()
    out = config.out
    _write_tokenizer_config(out)
    model, tokenizer = load_model(out)
    all_topics = topics()
    tool_topics, held_topics = _split_topics(all_topics, config.held_out_topics, config.seed)
    held_qa = held_out_questions(all_topics, 30, config.seed)
    before_qa = score(model, tokenizer, held_qa)
    before_tools = tool_score(model, tokenizer, held_topics, config.call_topic)

    makers = _row_makers(tokenizer, tool_topics, all_topics, config)
    rng = np.random.default_rng(config.seed)

    def next_batch() -> tuple[Any, Any]:
        picked = [make(rng) for make, n in zip(makers, config.rows, strict=True) for _ in range(n)]
        ids, mask = _pad(picked, config.seq_len)
        return mx.array(ids), mx.array(mask)

    val_batches = _validation(tokenizer, tool_topics, all_topics, config.seq_len, config.call_topic)
    history, loaded, loaded_tokenizer = tune_in_place(
        model, out, next_batch, val_batches, config, "tool-tune default model"
    )
    after_tools = tool_score(loaded, loaded_tokenizer, held_topics, config.call_topic)
    seen = tool_topics[:: max(1, len(tool_topics) // 12)][:12]
    after_seen = tool_score(loaded, loaded_tokenizer, seen, config.call_topic)
    after_qa = score(loaded, loaded_tokenizer, held_qa)
    report = {
        "kind": "tool tuning",
        "where": where_it_ran(),
        "config": config_for_report(config),
        "topics": {"tool_train": len(tool_topics), "held_out": [t.key for t in held_topics]},
        **history,
        "tools_before": {k: v for k, v in before_tools.items() if k != "rows"},
        "tools": after_tools,
        "tools_seen_topics": after_seen,
        "qa_before": {k: v for k, v in before_qa.items() if k != "rows"},
        "qa": after_qa,
        "total_wall_time_s": round(time.perf_counter() - started, 2),
    }
    (out / "tools.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        plot_losses(
            out / "tools-loss.png",
            f"tool tuning ({report['where']['device_name'] or report['where']['mlx_device']})",
            report["train_losses"],
            [(s, v) for s, v in report["val_losses"]],
            report["best_step"],
        )
    except ModuleNotFoundError as missing:  # a bare GPU host: the curve is in tools.json
        print(f"no loss plot: {missing}")
    return report


def _write_tokenizer_config(out: Path) -> None:
    """Give the model its tool template and name mlx-lm's ``json_tools`` parser."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config["tool_parser_type"] = "json_tools"
    path.write_text(json.dumps(config, indent=2) + "\n")


_Config = TypeVar("_Config")


def tuner_args(cls: type[_Config], prog: str, kinds: str, argv: Sequence[str] | None) -> _Config:
    """A tuner's config (an attrs class with ``out`` and ``rows``) from the command line:
    every field is an option, ``--out`` defaults to the bundled model's directory and
    ``--rows`` is comma-separated counts of ``kinds``."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--out", type=Path, default=None, help="default: the bundled directory")
    add_config_options(parser, cls, skip=("out", "rows"))
    default_rows = ",".join(map(str, cls(out=Path()).rows))  # type: ignore[call-arg, attr-defined]
    parser.add_argument("--rows", default=default_rows, help=f"rows per batch: {kinds}")
    args = vars(parser.parse_args(argv))
    args["rows"] = tuple(int(n) for n in args["rows"].split(","))
    if args["out"] is None:
        from trio_mlx.default_model import default_model_path

        args["out"] = default_model_path()
    return cls(**args)


def parse_args(argv: Sequence[str] | None = None) -> ToolConfig:
    """Build a :class:`ToolConfig` from the command line (every field is an option)."""
    kinds = "call,result,no_tool,qa_tools,qa,docs"
    return tuner_args(ToolConfig, "python -m tools.instruct_tools", kinds, argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    print_summary(instruct_tools(parse_args(argv)))


if __name__ == "__main__":
    main()
