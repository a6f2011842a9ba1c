"""Shared fixtures: Hypothesis profiles and a tiny real MLX model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, stateful_step_count=50, deadline=None, print_blob=True
)
settings.register_profile(
    "heavy",
    max_examples=5000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run only where MLX's CUDA backend is (the GPU lane)."""
    import mlx.core as mx

    if mx.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs MLX's CUDA backend (tools/gpu_tests.sh)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight llama directory that ``mlx_lm.load`` loads (built once per run)."""
    from trio_mlx.testing import make_random_llama

    return make_random_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_adapter_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA adapter for the tiny model (built once per run; tests only read it)."""
    from engine_helpers import make_adapter

    return make_adapter(tiny_model_path, tmp_path_factory.mktemp("adapters") / "shout")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: Path) -> tuple[Any, Any]:
    """The tiny model and its tokenizer, loaded with ``mlx_lm.load``."""
    import mlx_lm

    return mlx_lm.load(str(tiny_model_path))  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def tool_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model rewired to answer every chat with one json_tools call (tests/tool_model.py)."""
    from tool_model import make_tool_model

    return make_tool_model(tiny_model_path, tmp_path_factory.mktemp("models") / "tool-llama")


@pytest.fixture(scope="session")
def json_tools_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as it is, its tokenizer naming mlx-lm's ``json_tools`` parser.

    Its own output is free text: a forced ``tool_choice`` is what makes it call.
    """
    import json
    import shutil

    path = tmp_path_factory.mktemp("models") / "tiny-tools"
    shutil.copytree(tiny_model_path, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tool_parser_type"] = "json_tools"
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def long_tiny_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a million-token context: a long request ends only at a deadline.

    On the tiny model's own 2,048-token context a fast machine can finish a "long"
    request inside a test's grace period (``trio_mlx.testing.with_context``).
    """
    from trio_mlx.testing import with_context

    return with_context(tiny_model_path, tmp_path_factory.mktemp("models") / "long-tiny", 10**6)


@pytest.fixture(scope="session")
def endless_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model rewired to answer "a" forever: a row that never ends on its own."""
    from tool_model import make_tool_model

    path = tmp_path_factory.mktemp("models") / "endless-llama"
    return make_tool_model(tiny_model_path, path, answer="endless")


@pytest.fixture(scope="session")
def text_call_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model rewired to answer every chat with the text "a", then one json_tools call."""
    from tool_model import make_tool_model

    path = tmp_path_factory.mktemp("models") / "text-call-llama"
    return make_tool_model(tiny_model_path, path, answer="text-call")
