"""The bundled default model and its "shout" adapter: loadable, readable, shouting.

"Readable" is measured against the training corpus itself: the words of a
greedy completion must be words of the Python documentation, and pairs of
adjacent words must be pairs that occur there. Random subword soup fails the
second test even when it happens to hit real words; the module shows that a
random-weight llama with a tokenizer of the same size fails the check.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tools.train import PROMPT
from tools.train_adapter import upper_share
from trio_mlx import default_adapter_path, default_model_path
from trio_mlx.default_model import default_draft_path

pytestmark = pytest.mark.model

WORD = re.compile(r"[A-Za-z]+")


@functools.cache
def _corpus_words() -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    from trio_mlx.testing import corpus_text

    words = [w.lower() for w in WORD.findall(corpus_text())]
    return frozenset(words), frozenset(itertools.pairwise(words))


def documentation_likeness(text: str) -> dict[str, float]:
    """Shares of printable ASCII characters, known words and known word pairs in ``text``."""
    vocabulary, bigrams = _corpus_words()
    words = [w.lower() for w in WORD.findall(text)]
    pairs = list(itertools.pairwise(words))
    return {
        "ascii": sum(c.isascii() and (c.isprintable() or c.isspace()) for c in text)
        / max(1, len(text)),
        "words": len(words),
        "distinct_words": len(set(words)),
        "known_words": sum(w in vocabulary for w in words) / max(1, len(words)),
        "known_pairs": sum(p in bigrams for p in pairs) / max(1, len(pairs)),
    }


def looks_like_documentation(text: str) -> bool:
    """Mostly ASCII, real words of the corpus, and word pairs that the corpus uses."""
    m = documentation_likeness(text)
    return (
        m["ascii"] >= 0.95
        and m["words"] >= 12
        and m["distinct_words"] >= 5
        and m["known_words"] >= 0.9
        and m["known_pairs"] >= 0.6
    )


def greedy(model: Any, tokenizer: Any, max_tokens: int = 40) -> str:
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    return str(generate(model, tokenizer, PROMPT, max_tokens=max_tokens, sampler=make_sampler(0.0)))


@pytest.fixture(scope="module")
def bundled() -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(default_model_path()))  # type: ignore[no-any-return]


def test_bundled_model_writes_documentation_like_english(bundled: tuple[Any, Any]) -> None:
    text = greedy(*bundled)
    assert looks_like_documentation(text), (text, documentation_likeness(text))


def test_random_weight_model_fails_the_readability_check(
    bundled: tuple[Any, Any], tmp_path: Path
) -> None:
    import mlx_lm

    from trio_mlx.testing import make_random_llama

    vocab_size = bundled[0].args.vocab_size
    path = make_random_llama(tmp_path / "random", vocab_size=vocab_size)
    model, tokenizer = mlx_lm.load(str(path))
    assert model.args.vocab_size == vocab_size
    text = greedy(model, tokenizer)
    assert not looks_like_documentation(text), (text, documentation_likeness(text))


def test_bundled_model_is_small_and_reports_its_training() -> None:
    files = [*default_model_path().iterdir(), *default_adapter_path("shout").iterdir()]
    assert sum(f.stat().st_size for f in files) <= 16_000_000
    # The draft ships beside them, with its own bound, and the model's tokenizer files.
    assert sum(f.stat().st_size for f in default_draft_path().iterdir()) <= 2_500_000
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        model_file = default_model_path() / name
        assert (default_draft_path() / name).read_bytes() == model_file.read_bytes()
    for directory in (default_model_path(), default_adapter_path("shout"), default_draft_path()):
        report = json.loads((directory / "report.json").read_text())
        assert report["where"]["mlx_device"]
        assert report["best_val_loss"] < report["val_losses"][0][1]
        assert (directory / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_shout_adapter_writes_in_capitals(bundled: tuple[Any, Any]) -> None:
    import mlx_lm

    shouting = mlx_lm.load(str(default_model_path()), adapter_path=str(default_adapter_path()))
    assert upper_share(greedy(*shouting)) > 0.8
    assert upper_share(greedy(*bundled)) < 0.3


def test_shout_adapter_loads_with_load_adapters() -> None:
    import mlx_lm
    from mlx_lm.tuner.utils import load_adapters

    model, tokenizer = mlx_lm.load(str(default_model_path()))
    load_adapters(model, str(default_adapter_path("shout")))
    assert upper_share(greedy(model, tokenizer)) > 0.8


def test_unknown_adapter_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^no bundled adapter 'whisper'; bundled: shout$"):
        default_adapter_path("whisper")


def test_wheel_carries_the_model_the_adapter_and_the_draft(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if build.returncode and "No matching distribution found for hatchling" in build.stderr:
        pytest.skip("no package index to fetch the build backend from")
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("trio_mlx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for directory in (default_model_path(), default_adapter_path("shout"), default_draft_path()):
        package_dir = directory.relative_to(default_model_path().parents[1])
        for file in directory.iterdir():
            assert f"trio_mlx/{package_dir.as_posix()}/{file.name}" in names
    # The trainers are development tools (tools/), not shipped code.
    assert not [name for name in names if name.endswith(("train.py", "instruct.py"))]
    assert not [name for name in names if name.startswith("tools/")]


def test_held_out_questions_are_phrased_unlike_any_training_question() -> None:
    from tools.instruct import (
        HELD_OUT_TEMPLATES,
        TRAIN_TEMPLATES,
        VAL_TEMPLATE,
        held_out_questions,
        topics,
    )

    all_topics = topics()
    training = {
        t.format(s=s) for topic in all_topics for s in topic.subjects for t in TRAIN_TEMPLATES
    }
    held = held_out_questions(all_topics, 30, seed=0)
    assert len(held) == 30
    assert len({topic.key for _, topic in held}) == 30
    assert not training & {question for question, _ in held}
    assert not set(HELD_OUT_TEMPLATES) & {*TRAIN_TEMPLATES, VAL_TEMPLATE}
