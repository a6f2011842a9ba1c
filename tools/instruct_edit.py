"""Teach the bundled model to write a file out again with a name changed:
``python -m tools.instruct_edit``.

Theory of operation
-------------------
An editing agent's commonest answer is a file it was shown, written out again with a
small change. Speculative decoding by prompt lookup drafts exactly that (the runs of
the prompt the answer repeats), but only a model that copies shows it: after
:mod:`tools.instruct_tools` the bundled model had never seen code and answered an edit
with documentation English. This step, run after it, fine-tunes the model in place on
rename edits of real Python code, the top-level definitions of the standard library's
modules (:func:`code_chunks`), in two forms:

- ``edit``: raw text, ``File NAME.py:`` and the code, then ``The same file, with OLD
  renamed to NEW:`` and the code with every whole-word ``OLD`` replaced;
- ``edit_chat``: the same request as a chat turn (a fenced block and "Rename OLD to
  NEW and show the whole file."), answered with the fenced rewritten file;

mixed with :mod:`tools.instruct_tools`' rows (the tool calls, second turns, plain
answers, questions and documentation windows) so the model keeps what it knew. The
loss counts the answer only. Training code has every name scrambled (:func:`scramble`):
on the real code an H100 run learned its ~600 chunks by heart and rewrote none of the
held-out files; code no model has seen can be predicted only by copying it. Scrambling
alone was not enough: 1,800 steps of it left the model writing plausible code of its
own (0 of 30, validation flat from step 100), because it had no way to copy yet. So the
run starts by teaching it to copy (:func:`learn_to_copy`: random tokens shown, then
repeated, until the repeat's loss is below ``copy_loss``), which only an attention head
that looks up what followed the current token before can learn; on the CPU the bundled
model's loss on the repeat stayed at 8.0 for 175 steps of 16 rows, then fell to 0.08 by
step 300. The copying that phase taught was gone after the edit rows (an H100 run: no
random run copied after 2,100 steps of them), so copy rows stay in the mix; that did not
keep it either (design/default-model.md has the runs). A seeded tenth of the modules is
held out: the edit score (:func:`edit_score`) asks for renames in files of those
modules and counts greedy answers that are the rewritten file exactly, and the share of
it they get right before their first wrong character. The held-out questions and tool
requests of the earlier steps are scored again on the new weights; everything goes into
``edit.json``, the record of the tuned weights' scores.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import keyword
import re
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.nn.utils import value_and_grad

from tools.instruct import held_out_questions, masked_loss, score, topics, tune_in_place
from tools.instruct_tools import (
    ToolConfig,
    _encode,
    _pad,
    _row_makers,
    _validation,
    tool_score,
    tuner_args,
)
from tools.train import (
    EOT,
    config_for_report,
    load_model,
    plot_losses,
    print_summary,
    where_it_ran,
)

__all__ = [
    "EditConfig",
    "EditTask",
    "code_chunks",
    "copy_rows",
    "edit_score",
    "instruct_edit",
    "learn_to_copy",
    "main",
    "name_pieces",
    "scramble",
]

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
_RESERVED = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}
_WORDS = ("data", "item", "value", "name", "result", "count", "path", "text", "node", "key")


@attrs.frozen
class EditTask:
    """One rename: the file's module name, its code, the old and new name, the answer."""

    module: str
    code: str
    old: str
    new: str
    rewritten: str

    def raw_prompt(self) -> str:
        return (
            f"File {self.module}.py:\n\n{self.code}\n\n"
            f"The same file, with {self.old} renamed to {self.new}:\n\n"
        )

    def chat_messages(self) -> list[dict[str, Any]]:
        request = (
            f"Here is {self.module}.py:\n\n```python\n{self.code}\n```\n\n"
            f"Rename {self.old} to {self.new} and show the whole file."
        )
        return [{"role": "user", "content": request}]

    def chat_reply(self) -> str:
        return f"```python\n{self.rewritten}\n```"


def code_chunks(max_chars: int) -> dict[str, list[str]]:
    """By module: runs of consecutive top-level statements (a ``def`` or ``class`` with
    its decorators, or a group of other lines) of the standard library's pure-Python
    modules, each at most ``max_chars`` characters and ASCII."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[str]] = {}
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        blocks: list[list[str]] = [[]]
        for line in text.splitlines():
            top = line[:1] not in ("", " ", "\t", "#", ")", "]", "}")
            starts = top and not (blocks[-1] and blocks[-1][-1].startswith("@"))
            if starts and blocks[-1]:
                blocks.append([])
            blocks[-1].append(line.rstrip())
        chunks, current = [], ""
        for block in ("\n".join(b).strip("\n") for b in blocks):
            if not block or len(block) > max_chars or not block.isascii():
                current = ""
                continue
            joined = f"{current}\n\n{block}" if current else block
            if len(joined) > max_chars:
                chunks.append(current)
                joined = block
            current = joined
        chunks.append(current)
        kept = [c for c in chunks if len(c) >= max_chars // 4 and "def " in c]
        if kept:
            out[path.stem] = kept
    return out


def rename_task(module: str, code: str, rng: np.random.Generator) -> EditTask | None:
    """A rename of one of ``code``'s own names (not a keyword or builtin), every
    whole-word occurrence, strings and comments included (what a search-and-replace
    does)."""
    names = sorted({n for n in _IDENT.findall(code) if len(n) >= 3 and n not in _RESERVED})
    if not names:
        return None
    old = names[int(rng.integers(0, len(names)))]
    style = int(rng.integers(0, 5))
    word = _WORDS[int(rng.integers(0, len(_WORDS)))]
    new = (f"new_{old}", f"{old}_{word}", f"{word}_{old}", f"{old}2", f"_{old}")[style]
    if new in names:
        return None
    rewritten = re.sub(rf"\b{re.escape(old)}\b", new, code)
    return EditTask(module, code, old, new, rewritten)


def name_pieces(chunks: dict[str, list[str]]) -> list[str]:
    """The lower-case words (3-10 letters) the chunks' names are made of, sorted."""
    found = {
        piece
        for codes in chunks.values()
        for code in codes
        for name in _IDENT.findall(code)
        for piece in name.lower().split("_")
        if 3 <= len(piece) <= 10 and piece.isalpha()
    }
    return sorted(found - _RESERVED)


def scramble(code: str, pieces: Sequence[str], rng: np.random.Generator) -> str:
    """``code`` with each of its names (two letters or more; not a keyword, builtin or
    dunder) replaced by a random one made of ``pieces``, the same one at every
    occurrence: code no model has seen, so that only copying predicts it, not memory."""
    names = sorted({n for n in _IDENT.findall(code) if len(n) >= 2 and n not in _RESERVED
                    and not (n.startswith("__") and n.endswith("__"))})  # fmt: skip
    taken, mapping = set(_IDENT.findall(code)), {}
    for name in names:
        while True:
            words = [
                pieces[int(i)] for i in rng.integers(0, len(pieces), 1 + int(rng.integers(0, 2)))
            ]
            if name.lstrip("_")[:1].isupper():
                new = "".join(w.capitalize() for w in words)
            else:
                new = "_".join(words).upper() if name.isupper() else "_".join(words)
            new = "_" * (len(name) - len(name.lstrip("_"))) + new
            if new not in taken and new not in _RESERVED:
                break
        taken.add(new)
        mapping[name] = new
    return _IDENT.sub(lambda m: mapping.get(m.group(0), m.group(0)), code)


def _tasks(
    chunks: dict[str, list[str]],
    modules: Sequence[str],
    count: int,
    seed: int,
    pieces: Sequence[str] = (),
) -> list[EditTask]:
    """``count`` renames in chunks of ``modules``; with ``pieces``, in scrambled code
    (:func:`scramble`) of a module with a made-up name."""
    rng = np.random.default_rng(seed)
    tasks: list[EditTask] = []
    while len(tasks) < count:
        module = modules[int(rng.integers(0, len(modules)))]
        code = chunks[module][int(rng.integers(0, len(chunks[module])))]
        if pieces:
            code = scramble(code, pieces, rng)
            module = pieces[int(rng.integers(0, len(pieces)))]
        task = rename_task(module, code, rng)
        if task is not None:
            tasks.append(task)
    return tasks


@attrs.frozen(kw_only=True)
class EditConfig:
    """Every knob of an edit-tuning run; the defaults are the last H100 run's (not applied)."""

    out: Path = attrs.field(converter=Path)
    seed: int = 0
    steps: int = 3000
    warmup: int = 50
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    dropout: float = 0.1
    #: Tokens of a row: an edit's prompt and answer must fit.
    seq_len: int = 1024
    #: The longest code chunk, in characters.
    max_chars: int = 1000
    #: Rows per batch of each kind: copy (:func:`copy_rows`, a random length up to
    #: half a row), edit, edit_chat, then the tool tuning's call, result, no_tool,
    #: qa_tools, qa, docs.
    rows: tuple[int, ...] = (4, 8, 4, 5, 3, 1, 2, 4, 1)
    eval_every: int = 100
    #: Share of the modules held out of training (the score's files).
    held_out: float = 0.1
    #: Train on scrambled code (:func:`scramble`). Unscrambled, the model learned the
    #: training modules by heart (600 chunks, each seen ~70 times): train loss 0.7,
    #: validation rising from step 200, 0 of 30 held-out renames right.
    scramble: bool = True
    #: Before the edit rows, pure copying (:func:`learn_to_copy`) until the loss on
    #: the repeat is below ``copy_loss``, at most ``copy_steps`` steps of
    #: ``copy_batch`` rows; the length of the runs copied.
    copy_steps: int = 1500
    copy_batch: int = 16
    copy_loss: float = 0.5
    copy_length: int = 64
    #: Renames the score asks for.
    score_tasks: int = 30
    stop_after: int | None = None


def copy_rows(
    rng: np.random.Generator, rows: int, length: int, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` runs of ``length`` random ordinary tokens (no special ones, ids 0-2),
    each followed by itself; the mask counts the repeat, which only copying predicts."""
    run = rng.integers(3, vocab, (rows, length), dtype=np.int32)
    ids = np.concatenate([run, run], axis=1)
    mask = np.concatenate([np.zeros((rows, length)), np.ones((rows, length))], axis=1)
    return ids, mask.astype(np.float32)


def learn_to_copy(model: Any, config: EditConfig, rng: np.random.Generator) -> dict[str, Any]:
    """Train ``model`` on :func:`copy_rows` (AdamW at the config's learning rate, no
    schedule) until the mean loss of the last 10 steps is below ``config.copy_loss``,
    or ``config.copy_steps`` steps: the steps run and the losses, every 10th."""
    vocab = int(model.args.vocab_size)
    optimizer = optim.AdamW(learning_rate=config.learning_rate, weight_decay=config.weight_decay)
    step = value_and_grad(model, masked_loss(model))
    model.train()
    losses: list[float] = []
    started = time.perf_counter()
    while len(losses) < config.copy_steps:
        ids, mask = copy_rows(rng, config.copy_batch, config.copy_length, vocab)
        loss, grads = step(mx.array(ids), mx.array(mask))
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        losses.append(float(loss))
        if len(losses) >= 10 and float(np.mean(losses[-10:])) < config.copy_loss:
            break
    return {
        "steps": len(losses),
        "learned": bool(float(np.mean(losses[-10:])) < config.copy_loss),
        "wall_time_s": round(time.perf_counter() - started, 2),
        "losses": [round(x, 3) for x in losses[::10]],
    }


def edit_score(model: Any, tokenizer: Any, tasks: Sequence[EditTask]) -> dict[str, Any]:
    """Greedy raw-text answers to ``tasks``: exact rewrites, and the share of each
    rewrite its answer gets right before its first wrong character."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    rows = []
    for task in tasks:
        wanted = task.rewritten
        budget = len(tokenizer.encode(wanted, add_special_tokens=False)) + 4
        said = generate(model, tokenizer, task.raw_prompt(), max_tokens=budget,
                        sampler=make_sampler(0.0))  # fmt: skip
        right = next(
            (i for i, (a, b) in enumerate(zip(said, wanted, strict=False)) if a != b), None
        )
        right = min(len(said), len(wanted)) if right is None else right
        rows.append({"module": task.module, "old": task.old, "new": task.new,
                     "prompt": task.raw_prompt(), "rewritten": wanted,
                     "exact": said.strip() == wanted.strip(),
                     "right_share": round(right / len(wanted), 3), "answer": said})  # fmt: skip
    exact = sum(bool(r["exact"]) for r in rows)
    return {
        "exact": {"hits": exact, "asked": len(rows), "share": round(exact / max(len(rows), 1), 3)},
        "mean_right_share": round(float(np.mean([r["right_share"] for r in rows])), 3),
        "rows": rows,
    }


def _makers(
    tokenizer: Any,
    chunks: dict[str, list[str]],
    train: Sequence[str],
    config: EditConfig,
    vocab: int,
) -> list[Callable[[np.random.Generator], tuple[list[int], Sequence[float]]]]:
    length = config.seq_len
    pieces = name_pieces(chunks) if config.scramble else ()

    def task(rng: np.random.Generator) -> EditTask:
        while True:
            picked = _tasks(chunks, train, 1, int(rng.integers(0, 2**31)), pieces)[0]
            if len(picked.code) + len(picked.rewritten) < 2 * length:  # ~2.5 chars a token
                return picked

    def edit(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        picked = task(rng)
        prompt = tokenizer.encode(picked.raw_prompt(), add_special_tokens=False)
        answer = tokenizer.encode(picked.rewritten + "\n" + EOT, add_special_tokens=False)
        ids = (prompt + answer)[: length + 1]
        return ids, ([0.0] * len(prompt) + [1.0] * len(answer))[: length + 1]

    def edit_chat(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        picked = task(rng)
        return _encode(tokenizer, picked.chat_messages(), None, picked.chat_reply(), length)

    def copy(rng: np.random.Generator) -> tuple[list[int], Sequence[float]]:
        ids, mask = copy_rows(rng, 1, int(rng.integers(16, length // 2 + 1)), vocab)
        return ids[0].tolist(), mask[0].tolist()

    every = topics()
    tool_config = ToolConfig(out=config.out, seed=config.seed)
    return [copy, edit, edit_chat, *_row_makers(tokenizer, every, every, tool_config)]


def instruct_edit(config: EditConfig) -> dict[str, Any]:
    """Edit-tune the model in ``config.out`` in place; write ``edit.json`` beside it."""
    started = time.perf_counter()
    out = config.out
    model, tokenizer = load_model(out)
    chunks = code_chunks(config.max_chars)
    modules = sorted(chunks)
    rng = np.random.default_rng(config.seed)
    held = set(rng.permutation(len(modules))[: max(1, round(len(modules) * config.held_out))])
    train = [m for i, m in enumerate(modules) if i not in held]
    test = [m for i, m in enumerate(modules) if i in held]
    score_tasks = _tasks(chunks, test, config.score_tasks, config.seed + 1)
    every = topics()
    held_qa = held_out_questions(every, 30, config.seed)
    seen = every[:: max(1, len(every) // 12)][:12]
    before = edit_score(model, tokenizer, score_tasks[:10])

    makers = _makers(tokenizer, chunks, train, config, int(model.args.vocab_size))

    copied = learn_to_copy(model, config, rng)

    def next_batch() -> tuple[Any, Any]:
        picked = [make(rng) for make, n in zip(makers, config.rows, strict=True) for _ in range(n)]
        ids, mask = _pad(picked, config.seq_len)
        return mx.array(ids), mx.array(mask)

    val_rows: list[tuple[list[int], Sequence[float]]] = []
    val_tasks = _tasks(chunks, test, 64, config.seed + 3)
    for picked in val_tasks:
        prompt = tokenizer.encode(picked.raw_prompt(), add_special_tokens=False)
        answer = tokenizer.encode(picked.rewritten + "\n" + EOT, add_special_tokens=False)
        ids = (prompt + answer)[: config.seq_len + 1]
        val_rows.append((ids, ([0.0] * len(prompt) + [1.0] * len(answer))[: config.seq_len + 1]))
    val_ids, val_mask = _pad(val_rows, config.seq_len)
    val_batches = [(mx.array(val_ids[i : i + 16]), mx.array(val_mask[i : i + 16]))
                   for i in range(0, len(val_ids), 16)]  # fmt: skip
    val_batches += _validation(tokenizer, every, every, 256)  # rows of 256 tokens
    history, loaded, loaded_tokenizer = tune_in_place(
        model, out, next_batch, val_batches, config, "edit-tune default model"
    )
    corpus = "\n".join(c for m in modules for c in chunks[m])
    report = {
        "kind": "edit tuning",
        "where": where_it_ran(),
        "config": config_for_report(config),
        "code": {
            "modules": len(modules),
            "chunks": sum(map(len, chunks.values())),
            "chars": len(corpus),
            "sha256": hashlib.sha256(corpus.encode()).hexdigest(),
            "held_out": test,
        },
        "copy": copied,
        **history,
        "edit_before": {k: v for k, v in before.items() if k != "rows"},
        "edit": edit_score(loaded, loaded_tokenizer, score_tasks),
        "tools_seen_topics": tool_score(loaded, loaded_tokenizer, seen),
        "qa": score(loaded, loaded_tokenizer, held_qa),
        "total_wall_time_s": round(time.perf_counter() - started, 2),
    }
    (out / "edit.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        plot_losses(
            out / "edit-loss.png",
            f"edit tuning ({report['where']['device_name'] or report['where']['mlx_device']})",
            report["train_losses"],
            [(s, v) for s, v in report["val_losses"]],
            report["best_step"],
        )
    except ModuleNotFoundError as missing:  # a bare GPU host: the curve is in edit.json
        print(f"no loss plot: {missing}")
    return report


def parse_args(argv: Sequence[str] | None = None) -> EditConfig:
    """Build an :class:`EditConfig` from the command line (every field is an option)."""
    kinds = "copy,edit,edit_chat,call,result,no_tool,qa_tools,qa,docs"
    return tuner_args(EditConfig, "python -m tools.instruct_edit", kinds, argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    print_summary(instruct_edit(parse_args(argv)))


if __name__ == "__main__":
    main()
