"""``noxfile.py``'s install step: once per change of what decides it, never on a restart.

The test process has no nox (the sessions' venvs do not install it), so the noxfile is
loaded with a stand-in for the ``nox`` module: only the names it uses at import time.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

ROOT = Path(__file__).parent.parent


def _load_noxfile(monkeypatch: pytest.MonkeyPatch) -> Any:
    stand_in = types.ModuleType("nox")
    stand_in.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    stand_in.Session = object  # type: ignore[attr-defined]

    def session(*args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        return lambda function: function

    stand_in.session = session  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nox", stand_in)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@attrs.define
class _Session:
    """What ``_install`` uses of a nox session: its venv's location, ``log`` and ``install``."""

    location: Path
    logs: list[str] = attrs.field(factory=list)
    installs: list[tuple[str, ...]] = attrs.field(factory=list)

    @property
    def virtualenv(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(location=str(self.location))

    def log(self, message: str) -> None:
        self.logs.append(message)

    def install(self, *args: str, silent: bool = True) -> None:
        assert not silent, "pip's output is shown while it installs"
        self.installs.append(args)
        (self.location / "bin").mkdir(parents=True, exist_ok=True)
        (self.location / "bin" / "trio-mlx").touch()


@pytest.fixture
def noxfile(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TRIO_MLX_BACKEND", "cpu")
    return _load_noxfile(monkeypatch)


def test_a_second_run_skips_the_install_and_says_so(noxfile: Any, tmp_path: Path) -> None:
    session = _Session(tmp_path)
    noxfile._install(session, "test")
    assert len(session.installs) == 1
    assert session.logs[0].startswith("Installing trio-mlx[")
    assert "first run" in session.logs[0]
    assert session.logs[1].startswith("Installed trio-mlx[")
    assert session.logs[1].endswith(" s")
    session.logs.clear()
    noxfile._install(session, "test")
    assert len(session.installs) == 1
    assert session.logs == [
        f"trio-mlx[{noxfile._extras('test')}] is installed already (pyproject.toml unchanged)"
    ]


def test_other_extras_or_a_missing_command_install_again(
    noxfile: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _Session(tmp_path)
    asked: list[str] = []

    def install(*extra: str) -> None:
        asked.append(f".[{noxfile._extras(*extra)}]")
        noxfile._install(session, *extra)

    install("test")
    install()  # other extras: the venv may lack what they bring
    monkeypatch.setenv("TRIO_MLX_BACKEND", "cuda")  # another backend (Linux)
    install()
    (tmp_path / "bin" / "trio-mlx").unlink()
    install()
    expected = asked if sys.platform.startswith("linux") else asked[:2] + asked[3:]
    assert [args[-1] for args in session.installs] == expected


def test_the_install_key_follows_pyproject_and_the_extras(
    noxfile: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = noxfile._install_key("cpu,test")
    assert key == noxfile._install_key("cpu,test")
    assert key != noxfile._install_key("cpu")
    copy = tmp_path / "checkout"
    for name in noxfile.INSTALL_INPUTS:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((ROOT / name).read_bytes())
    monkeypatch.setattr(noxfile, "ROOT", copy)
    moved = noxfile._install_key("cpu,test")
    assert moved != key  # another checkout: its own install
    (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + "\n# x\n")
    assert noxfile._install_key("cpu,test") != moved


@attrs.define
class _TestsSession(_Session):
    """A session the ``tests`` session itself runs in: ``posargs`` and ``run`` too."""

    posargs: list[str] = attrs.field(factory=list)
    runs: list[tuple[str, ...]] = attrs.field(factory=list)
    envs: list[dict[str, str]] = attrs.field(factory=list)

    def run(self, *args: str, env: dict[str, str] | None = None, **_: Any) -> None:
        self.runs.append(args)
        self.envs.append(dict(env or {}))


def test_the_tests_session_installs_the_vision_extra(
    noxfile: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vision tests skip without mlx-vlm; in ``nox -s tests`` they must run."""
    session = _TestsSession(tmp_path)
    monkeypatch.setattr(noxfile, "_model_env", dict)
    noxfile.tests(session)
    (extras,) = {args[-1] for args in session.installs}
    assert extras == f".[{noxfile._extras('test', 'vision')}]"
    assert [args[0] for args in session.runs] == ["pytest"]


def test_the_tests_session_runs_in_workers_with_a_share_of_the_cores_each(
    noxfile: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(noxfile, "_model_env", dict)
    monkeypatch.setattr(noxfile.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    parallel = _TestsSession(tmp_path)
    noxfile.tests(parallel)
    (args,) = parallel.runs
    assert args == ("pytest", "-n", str(noxfile.TEST_WORKERS), "--dist", "loadfile")
    # The workers' OpenBLAS threads together match the cores.
    assert parallel.envs[0]["OPENBLAS_NUM_THREADS"] == str(8 // noxfile.TEST_WORKERS)
    # Arguments after ``--`` replace the parallel run's, and one process keeps every core.
    chosen = _TestsSession(tmp_path, posargs=["tests/test_cli.py"])
    noxfile.tests(chosen)
    assert chosen.runs == [("pytest", "tests/test_cli.py")]
    assert "OPENBLAS_NUM_THREADS" not in chosen.envs[0]
    # A thread count set by hand is kept.
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    pinned = _TestsSession(tmp_path)
    noxfile.tests(pinned)
    assert "OPENBLAS_NUM_THREADS" not in pinned.envs[0]  # _model_env passes it on as it is
