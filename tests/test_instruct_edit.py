"""The edit tuner's data (``tools.instruct_edit``): renames change every whole-word
occurrence and nothing else; scrambled code keeps its shape and keywords and renames
each name the same way everywhere, so a rename in it is still a rename; copy rows repeat
a run of ordinary tokens and count only the repeat."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tools.instruct_edit import _tasks, code_chunks, copy_rows, name_pieces, rename_task, scramble

CODE = '''def load_row(row, strict=False):
    """Load a row (load_rows loads many)."""
    if strict and not row:
        raise ValueError(row)
    return [load_row(part) for part in row.split(",")]
'''


def _shape(code: str) -> str:
    """``code`` with every name blanked: what scrambling must keep."""
    return re.sub(r"\b[A-Za-z_][A-Za-z0-9_]*\b", "N", code)


def test_a_rename_replaces_whole_words_only() -> None:
    for seed in range(40):
        task = rename_task("util", CODE, np.random.default_rng(seed))
        if task is None or task.old != "load_row":
            continue
        assert task.rewritten == CODE.replace("load_row(", f"{task.new}(")
        assert "load_rows" in task.rewritten  # a longer name that contains it stays
        assert task.raw_prompt().endswith(f"with load_row renamed to {task.new}:\n\n")
        return
    pytest.fail("no seed renamed load_row")


def test_scrambled_code_keeps_its_shape_keywords_and_a_consistent_renaming() -> None:
    pieces = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    out = scramble(CODE, pieces, np.random.default_rng(0))
    assert _shape(out) == _shape(CODE)
    for kept in ("def", "if", "and", "not", "raise", "ValueError", "return", "for", "in"):
        assert re.search(rf"\b{kept}\b", out), kept
    old = re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", CODE)
    new = re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", out)
    mapping = dict(zip(old, new, strict=True))
    # One new name per old one, and no two old names share one.
    assert all(mapping[o] == n for o, n in zip(old, new, strict=True))
    assert len(set(mapping.values())) == len(mapping)
    assert mapping["load_row"] != "load_row"
    assert mapping["strict"] != "strict"


def test_training_renames_are_in_scrambled_code_of_the_training_modules() -> None:
    chunks = code_chunks(1000)
    modules = sorted(chunks)[:5]
    plain = _tasks(chunks, modules, 6, seed=1)
    scrambled = _tasks(chunks, modules, 6, seed=1, pieces=name_pieces(chunks))
    originals = {c for m in modules for c in chunks[m]}
    assert all(t.code in originals for t in plain)
    assert not any(t.code in originals for t in scrambled)
    for task in scrambled:
        assert task.rewritten == re.sub(rf"\b{re.escape(task.old)}\b", task.new, task.code)
        assert task.old in task.code
        assert task.new in task.rewritten


def test_copy_rows_repeat_a_run_of_ordinary_tokens_and_count_only_the_repeat() -> None:
    ids, mask = copy_rows(np.random.default_rng(0), 5, 40, 3072)
    assert ids.shape == mask.shape == (5, 80)
    assert (ids[:, :40] == ids[:, 40:]).all()
    assert ids.min() >= 3
    assert ids.max() < 3072
    assert (mask[:, :40] == 0).all()
    assert (mask[:, 40:] == 1).all()
    assert len({tuple(row) for row in ids[:, :40]}) == 5  # each row its own run
