"""Instruction-tune the bundled model: ``python -m tools.instruct``.

Theory of operation
-------------------
The base model (:mod:`tools.train`) continues Python
documentation but does not answer: asked "What is a tuple?" it wanders. This
step fine-tunes it, in place, on chat question/answer pairs built from the same
``pydoc_data.topics``: for each topic, questions in many phrasings about the
topic's subject ("What is the with statement?", "Explain lambdas.", ...), each
answered with the topic's title and opening sentences, then ``<|im_end|>``.
The prompt is the model's own ChatML rendering (what the server sends); the loss
counts the answer tokens only. A quarter of every batch is plain documentation
windows, so the model keeps writing documentation English (and the ``shout``
adapter keeps its footing).

Status: **applied to the shipped model.** The defaults below are the shipped
run's settings (4,000 steps of 32 rows on an NVIDIA H200, 43 s for the loop):
the held-out score went from 3/30 to 26/30, and the ``shout`` adapter was then
retrained on the result. See ``design/default-model.md``. ``--draft`` tunes the
bundled draft model the same way, shorter: its drafts are then accepted on the
model's chat answers, not only on plain documentation.

Phrasings are split three ways: the training templates, one validation
template (early stopping, as in the base trainer), and three held-out
templates scored at the end: 30 held-out questions (one topic each) are answered
greedily and an answer counts when it names the topic's key term (``with`` for
the with statement). The score goes into ``instruct.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from tools.train import (
    EOT,
    add_config_options,
    add_dropout,
    config_for_report,
    document_text,
    fit,
    fit_settings,
    load_model,
    plot_losses,
    print_summary,
    remove_dropout,
    where_it_ran,
)

__all__ = [
    "DRAFT",
    "HELD_OUT_TEMPLATES",
    "TRAIN_TEMPLATES",
    "InstructConfig",
    "Topic",
    "held_out_questions",
    "instruct",
    "main",
    "names_key_term",
    "topics",
    "tune_in_place",
]

#: Question phrasings the model trains on ({s}: the subject, e.g. "the with statement").
TRAIN_TEMPLATES = (
    "What is {s}?",
    "What are {s}?",
    "Explain {s}.",
    "Tell me about {s}.",
    "How does {s} work?",
    "Describe {s}.",
    "Can you explain {s}?",
    "I have a question about {s}.",
    "{s}",
    "What does the documentation say about {s}?",
    "Help me understand {s}.",
    "explain {s} please",
)
#: The phrasing that picks the kept weights (early stopping).
VAL_TEMPLATE = "Please describe {s}."
#: Phrasings never trained on: the score's questions.
HELD_OUT_TEMPLATES = (
    "Give me a short overview of {s}.",
    "What should I know about {s}?",
    "Could you summarize {s} for me?",
)

#: Key terms and extra subjects where the title alone does not give them.
_EXTRA: dict[str, tuple[str, tuple[str, ...]]] = {
    "async": ("coroutine", ("coroutines", "async functions", "async def")),
    "atom-identifiers": ("identifier", ("names in expressions",)),
    "attribute-access": ("attribute", ("__getattr__", "attribute access")),
    "bltin-null-object": ("none", ("None", "the None object")),
    "bltin-ellipsis-object": ("ellipsis", ("Ellipsis", "the ellipsis literal")),
    "class": ("class", ("classes", "the class statement")),
    "context-managers": ("context manager", ("context managers", "__enter__ and __exit__")),
    "debugger": ("pdb", ("pdb", "the debugger", "debugging")),
    "dict": ("dictionar", ("dict displays", "dictionary literals")),
    "exceptions": ("exception", ("exceptions",)),
    "formatstrings": ("format", ("format strings", "str.format")),
    "function": ("function", ("functions", "def", "the def statement")),
    "lambda": ("lambda", ("lambda", "lambda expressions", "anonymous functions")),
    "lists": ("list", ("list displays", "list literals")),
    "operator-summary": ("precedence", ("operator precedence",)),
    "string-methods": ("string", ("string methods", "str methods")),
    "strings": ("string", ("string literals", "bytes literals")),
    "truth": ("truth", ("truth value testing", "truthiness")),
    "typesmapping": ("dict", ("dictionaries", "dict", "mappings")),
    "typesseq": ("sequence", ("lists and tuples", "tuples", "sequence types", "range")),
    "typesseq-mutable": ("mutable", ("mutable sequences",)),
    "with": ("with", ("the with statement", "with")),
    "yield": ("yield", ("the yield statement", "yield", "generators")),
}


@attrs.frozen
class Topic:
    """One documentation topic as the question/answer data sees it."""

    key: str
    title: str
    term: str
    subjects: tuple[str, ...]
    answer: str


def _title_and_body(text: str) -> tuple[str, str]:
    lines = text.strip().splitlines()
    title = lines[0].strip()
    body = "\n".join(line for line in lines[1:] if not re.fullmatch(r"[*=\-]{3,}", line.strip()))
    return title, body.strip()


def _opening(body: str, limit: int) -> str:
    """The first paragraph(s) of ``body``, cut at a sentence end within ``limit`` chars."""
    paragraphs = [p.strip() for p in body.split("\n\n") if p.strip()]
    text = ""
    for paragraph in paragraphs:
        joined = " ".join(paragraph.split())
        candidate = f"{text} {joined}".strip()
        if len(candidate) > limit:
            if not text:
                cut = candidate[:limit]
                end = cut.rfind(". ")
                text = cut[: end + 1] if end > limit // 3 else cut.rsplit(" ", 1)[0]
            break
        text = candidate
    return text


def topics(answer_chars: int = 320) -> list[Topic]:
    """Every ``pydoc_data`` topic with its key term, subjects and answer."""
    from pydoc_data.topics import topics as docs

    found: list[Topic] = []
    for key in sorted(docs):
        title, body = _title_and_body(docs[key])
        quoted = re.search(r'"([^"]+)"', title)
        term, extra = _EXTRA.get(key, ("", ()))
        if not term:
            term = quoted.group(1) if quoted else title.split()[0].strip(",:").lower()
        if quoted and "statement" in title:
            subjects: tuple[str, ...] = (f"the {quoted.group(1)} statement", quoted.group(1))
        else:
            subjects = (title.lower().replace('"', "").removeprefix("the "),)
        subjects = tuple(dict.fromkeys((*subjects, *extra)))
        answer = f"{title}\n\n{_opening(body, answer_chars)}"
        found.append(Topic(key, title, term.lower(), subjects, answer))
    return found


def names_key_term(answer: str, topic: Topic) -> bool:
    """Whether ``answer`` names the topic's key term (case-insensitive)."""
    return topic.term in answer.lower()


def starts_with_title(answer: str, topic: Topic) -> bool:
    """Whether ``answer`` opens with the topic's own title (the right topic, stricter)."""
    return answer.strip().startswith(topic.title)


def held_out_questions(
    all_topics: Sequence[Topic], count: int, seed: int
) -> list[tuple[str, Topic]]:
    """``count`` questions in held-out phrasings, one topic each, chosen by ``seed``."""
    rng = np.random.default_rng(seed)
    picks = rng.permutation(len(all_topics))[:count]
    return [
        (HELD_OUT_TEMPLATES[i % len(HELD_OUT_TEMPLATES)].format(s=all_topics[k].subjects[0]),
         all_topics[int(k)])
        for i, k in enumerate(picks)
    ]  # fmt: skip


@attrs.frozen(kw_only=True)
class InstructConfig:
    """Every knob of an instruction-tuning run; the defaults are the shipped run's."""

    out: Path = attrs.field(converter=Path)
    seed: int = 0
    steps: int = 4000
    warmup: int = 20
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    dropout: float = 0.1
    batch_size: int = 32
    doc_rows: int = 8
    seq_len: int = 160
    answer_chars: int = 320
    eval_every: int = 100
    held_out: int = 30
    stop_after: int | None = None


def _encode_pair(
    tokenizer: Any, question: str, answer: str, length: int
) -> tuple[list[int], list[int]]:
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    ))  # fmt: skip
    reply = list(tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False))
    ids = (prompt + reply)[: length + 1]
    mask = ([0] * len(prompt) + [1] * len(reply))[: length + 1]
    return ids, mask


def _pad(rows: Sequence[tuple[list[int], list[int]]], length: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(rows), length + 1), dtype=np.int32)
    mask = np.zeros((len(rows), length + 1), dtype=np.float32)
    for i, (row, weights) in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(weights)] = weights
    return ids, mask


def masked_loss(model: Any) -> Any:
    """Mean next-token cross-entropy over the tokens whose mask is 1."""

    def loss(tokens: Any, mask: Any) -> Any:
        logits = model(tokens[:, :-1])
        ce = nn.losses.cross_entropy(logits, tokens[:, 1:])
        weights = mask[:, 1:]
        return mx.sum(ce * weights) / mx.maximum(mx.sum(weights), 1.0)

    return loss


def tune_in_place(
    model: Any,
    out: Path,
    next_batch: Callable[[], tuple[Any, Any]],
    val_batches: list[tuple[Any, Any]],
    config: Any,
    desc: str,
) -> tuple[dict[str, Any], Any, Any]:
    """Fine-tune ``model`` on the masked loss (``config``: seed, dropout, steps and the
    optimizer's settings), save its weights into ``out`` and load them back: the loss
    history, and the saved model and tokenizer (what the scores must read)."""
    mx.random.seed(config.seed)
    if config.dropout:
        add_dropout(model, config.dropout)
    model.train()
    history = fit(
        model,
        masked_loss(model),
        next_batch,
        val_batches,
        **fit_settings(config),
        desc=desc,
    )
    if config.dropout:
        remove_dropout(model)
    model.eval()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    loaded, tokenizer = load_model(out)
    return history, loaded, tokenizer


def answer(model: Any, tokenizer: Any, question: str, max_tokens: int = 80) -> str:
    """The model's greedy chat answer to ``question`` (as the server renders it)."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    text: str = generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0))
    return text


def score(model: Any, tokenizer: Any, questions: Sequence[tuple[str, Topic]]) -> dict[str, Any]:
    """The share of ``questions`` whose greedy answer names the topic's key term."""
    rows: list[dict[str, Any]] = []
    for question, topic in questions:
        reply = answer(model, tokenizer, question)
        rows.append({"question": question, "topic": topic.key, "term": topic.term,
                     "named": names_key_term(reply, topic),
                     "title": starts_with_title(reply, topic), "answer": reply})  # fmt: skip
    named = sum(r["named"] for r in rows)
    titled = sum(r["title"] for r in rows)
    return {
        "named": named,
        "asked": len(rows),
        "share": round(named / len(rows), 3),
        "title_share": round(titled / len(rows), 3),
        "rows": rows,
    }


def instruct(config: InstructConfig) -> dict[str, Any]:
    """Fine-tune the model in ``config.out`` in place; write ``instruct.json`` beside it."""
    started = time.perf_counter()
    out = config.out
    model, tokenizer = load_model(out)
    all_topics = topics(config.answer_chars)
    held = held_out_questions(all_topics, config.held_out, config.seed)
    before = score(model, tokenizer, held)

    pairs = [
        _encode_pair(tokenizer, template.format(s=subject), topic.answer, config.seq_len)
        for topic in all_topics
        for subject in topic.subjects
        for template in TRAIN_TEMPLATES
    ]
    val_pairs = [
        _encode_pair(
            tokenizer, VAL_TEMPLATE.format(s=topic.subjects[0]), topic.answer, config.seq_len
        )
        for topic in all_topics
    ]
    doc_ids = np.array(tokenizer.encode(document_text().replace(EOT, "\n\n")), dtype=np.int32)
    rng = np.random.default_rng(config.seed)
    qa_rows = config.batch_size - config.doc_rows

    def next_batch() -> tuple[Any, Any]:
        picked = [pairs[int(i)] for i in rng.integers(0, len(pairs), qa_rows)]
        for start in rng.integers(0, len(doc_ids) - config.seq_len - 1, config.doc_rows):
            window = doc_ids[int(start) : int(start) + config.seq_len + 1].tolist()
            picked.append((window, [1] * len(window)))
        ids, mask = _pad(picked, config.seq_len)
        return mx.array(ids), mx.array(mask)

    val_ids, val_mask = _pad(val_pairs, config.seq_len)
    val_batches = [
        (mx.array(val_ids[i : i + 32]), mx.array(val_mask[i : i + 32]))
        for i in range(0, len(val_ids), 32)
    ]
    history, loaded, loaded_tokenizer = tune_in_place(
        model, out, next_batch, val_batches, config, "instruction-tune default model"
    )
    after = score(loaded, loaded_tokenizer, held)
    report = {
        "kind": "instruction tuning",
        "where": where_it_ran(),
        "config": config_for_report(config),
        "pairs": {"train": len(pairs), "val": len(val_pairs), "topics": len(all_topics)},
        **history,
        "held_out_before": {k: v for k, v in before.items() if k != "rows"},
        "held_out": after,
        "samples": {
            q: answer(loaded, loaded_tokenizer, q)
            for q in ("What is the with statement?", "What is a tuple?", "Explain lambdas.")
        },
        "total_wall_time_s": round(time.perf_counter() - started, 2),
    }
    (out / "instruct.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_losses(
        out / "instruct-loss.png",
        f"instruction tuning ({report['where']['device_name'] or report['where']['mlx_device']})",
        report["train_losses"],
        [(s, v) for s, v in report["val_losses"]],
        report["best_step"],
    )
    return report


#: ``--draft``'s settings: the shipped tuning of the bundled draft (``pydoc-llama-draft``,
#: after ``python -m tools.train --draft``), short enough for a 2-core CPU (~7 minutes).
DRAFT: dict[str, Any] = {"steps": 300, "eval_every": 25, "learning_rate": 2e-3}


def parse_args(argv: Sequence[str] | None = None) -> InstructConfig:
    """Build an :class:`InstructConfig` from the command line (every field is an option;
    ``--draft``: the defaults of :data:`DRAFT` and the bundled draft's directory)."""
    from trio_mlx.default_model import default_draft_path, default_model_path

    parser = argparse.ArgumentParser(prog="python -m tools.instruct")
    parser.add_argument("--out", type=Path, default=None, help="default: the bundled directory")
    parser.add_argument("--base", type=Path, default=None, help="copy this model to --out first")
    parser.add_argument(
        "--draft", action="store_true", help="tune the bundled draft model (see DRAFT)"
    )
    add_config_options(parser, InstructConfig, skip=("out",))
    draft = parser.parse_known_args(argv)[0].draft
    if draft:
        parser.set_defaults(**DRAFT)
    args = vars(parser.parse_args(argv))
    base = args.pop("base")
    del args["draft"]
    if args["out"] is None:
        args["out"] = default_draft_path() if draft else default_model_path()
    if base is not None:
        shutil.copytree(base, args["out"], dirs_exist_ok=True)
    return InstructConfig(**args)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    print_summary(instruct(parse_args(argv)))


if __name__ == "__main__":
    main()
