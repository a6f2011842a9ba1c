"""The repository's skeleton: packaging, source roots and the fixture model."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio_mlx
import trio_mlx_http

ROOT = Path(__file__).parent.parent


def _installed() -> bool:
    """Whether pip installed the project (the GPU lane runs it from the source roots)."""
    try:
        importlib.metadata.distribution("trio-mlx")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_source_roots_do_not_shadow_the_standard_library_http() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import http.client, trio_mlx, trio_mlx_http; print(http.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "trio_mlx" not in out
    assert Path(out.strip()).parent.name == "http"
    assert not (ROOT / "http" / "__init__.py").exists()
    assert not (ROOT / "engine" / "__init__.py").exists()


def test_cli_reports_version_as_module_and_console_script() -> None:
    commands = [[sys.executable, "-m", "trio_mlx_http", "--version"]]
    if _installed():  # the console script exists once pip installed the project
        commands.append(["trio-mlx", "--version"])
    for cmd in commands:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"trio-mlx {trio_mlx.__version__}"
    assert trio_mlx_http.__version__ == trio_mlx.__version__


def test_engine_never_imports_the_web_stack() -> None:
    forbidden = ("quart", "hypercorn", "trio_mlx_http")
    for path in (ROOT / "engine").rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in forbidden, f"{path}: {line}"


def test_fixture_model_loads_and_generates(tiny_model: tuple[Any, Any]) -> None:
    from mlx_lm import stream_generate

    model, tokenizer = tiny_model
    prompt = tokenizer.encode("The with statement")
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=12)]
    assert len(tokens) == 12 or tokens[-1] in tokenizer.eos_token_ids
    text = tokenizer.decode(tokens)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(prompt) == "The with statement"


def test_fixture_model_has_chat_template_and_eos(tiny_model: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_model
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert set(tokenizer.eos_token_ids) == {0, 2}


def test_fixture_model_is_deterministic(tmp_path: Path, tiny_model_path: Path) -> None:
    from trio_mlx.testing import make_random_llama

    again = make_random_llama(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_path / name).read_bytes()
