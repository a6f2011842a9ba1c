"""nox sessions for trio-mlx: ``nox -s tests`` is the README's test command."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import nox

# session.run's interrupt_timeout (serve's graceful Ctrl-C) and lazy uv detection.
nox.needs_version = ">=2024.3.2"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "typing"]

ROOT = Path(__file__).parent
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# Pinned: a new ruff or mypy release must not turn CI red on unchanged code.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"


def _quiet_uv_probe() -> None:
    """Without uv, tell nox so up front: its own probe logs "uv binary not found." per session.

    The values nox's probe would find (no uv); nox reads them from its module
    attributes, so setting them skips the probe. Anything unexpected: let nox probe.
    """
    if shutil.which(os.environ.get("UV", "uv")) or importlib.util.find_spec("uv"):
        return
    try:
        from nox import virtualenv
        from packaging.version import Version

        virtualenv.HAS_UV, virtualenv.UV, virtualenv.UV_VERSION = False, "uv", Version("0")
    except Exception:  # pragma: no cover - a nox without these names probes as before
        return


_quiet_uv_probe()


def _extras(*extra: str) -> str:
    # On Linux MLX needs a backend wheel: the CPU one unless asked otherwise.
    backend = [] if sys.platform == "darwin" else [os.environ.get("TRIO_MLX_BACKEND", "cpu")]
    return ",".join([*backend, *extra])


def _model_env() -> dict[str, str]:
    """Environment for processes that run MLX models: an optimized BLAS preloaded."""
    sys.path.insert(0, str(ROOT / "engine"))
    try:
        from trio_mlx._start.blas import preload_env  # no mlx import: safe in nox's own Python
    finally:
        sys.path.pop(0)
    return preload_env(dict(os.environ))


#: In a session's virtualenv: the key of the install ``_install`` made there last.
INSTALL_STAMP = "trio-mlx-install.stamp"
#: What an install of this checkout depends on, besides the extras asked for.
INSTALL_INPUTS = ("pyproject.toml", "engine/trio_mlx/_version.py")


def _install_key(extras: str) -> str:
    """A hash of what decides the install: this checkout, the extras and the project's files."""
    digest = hashlib.sha256(f"{ROOT.resolve()}\n{extras}\n".encode())
    for name in INSTALL_INPUTS:
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def _install(session: nox.Session, *extra: str) -> None:
    """Install this checkout (editable) with ``extra``, unless the session's venv has it.

    An editable install picks source changes up by itself, so a reused venv is
    installed again only when the stamp it keeps (:func:`_install_key`) differs
    or the ``trio-mlx`` command is missing: a restart then takes seconds
    instead of pip's 8-20 s. An install shows pip's output and how long it took.
    """
    extras = _extras(*extra)
    location = Path(session.virtualenv.location)
    stamp, key = location / INSTALL_STAMP, _install_key(extras)
    installed = (location / "bin" / "trio-mlx").exists()
    if installed and stamp.is_file() and stamp.read_text() == key:
        session.log(f"trio-mlx[{extras}] is installed already (pyproject.toml unchanged)")
        return
    why = "pyproject.toml or the extras changed" if installed else "first run"
    session.log(
        f"Installing trio-mlx[{extras}] with its dependencies into {_shown(location)} "
        f"({why}; a few minutes the first time, later runs skip it)"
    )
    started = time.monotonic()
    session.install("-e", f".[{extras}]", silent=False)
    session.log(f"Installed trio-mlx[{extras}] in {time.monotonic() - started:.0f} s")
    stamp.write_text(key)


def _shown(path: Path) -> Path:
    """``path`` relative to the checkout when it is inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


#: ``nox -s tests`` runs the suite in this many pytest-xdist processes, a test file to
#: each at a time (a module's fixtures are built once). Measured on a 2-core CPU: much of
#: the suite waits on subprocesses, grace periods and timeouts, which overlap.
TEST_WORKERS = 2


def tests_impl(session: nox.Session, profile: str, *default_args: str, workers: int) -> None:
    """pytest with ``default_args`` unless ``nox`` passes arguments after ``--``.

    ``workers``: the pytest-xdist processes ``default_args`` start. Each gets its share
    of the cores for OpenBLAS's threads (unless ``OPENBLAS_NUM_THREADS`` is set), so
    that the workers' BLAS threads do not outnumber the cores and spin against each other.
    """
    _install(session, "test", "vision")  # the vision tests run, never skip, here
    env = _model_env()
    env["HYPOTHESIS_PROFILE"] = profile
    # mlx ships mlx.launch: the distributed tests must run, never skip, here.
    env["TRIO_MLX_REQUIRE_LAUNCH"] = "1"
    if workers > 1 and not session.posargs and "OPENBLAS_NUM_THREADS" not in os.environ:
        env["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    session.run("pytest", *(session.posargs or default_args), env=env)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole suite, in parallel (pytest-xdist); Hypothesis at the bounded CI profile.

    Arguments after ``--`` replace the parallel run's (``nox -s tests -- tests/test_cli.py``
    runs that file in one process).
    """
    parallel = ("-n", str(TEST_WORKERS), "--dist", "loadfile")
    tests_impl(session, "ci", *parallel, workers=TEST_WORKERS)


@nox.session(python=PYTHON)
def props(session: nox.Session) -> None:
    """The property tests only, at the heavy Hypothesis profile."""
    tests_impl(session, "heavy", "-m", "props", "-p", "no:cacheprovider", workers=1)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typing(session: nox.Session) -> None:
    """mypy --strict on the engine and the HTTP packages."""
    _install(session, "test")
    session.install(MYPY)
    session.run("mypy")


@nox.session(python=PYTHON)
def serve(session: nox.Session) -> None:
    """Install trio-mlx and start the OpenAI-compatible server on the bundled model.

    Options after ``--`` go to ``trio-mlx serve`` (``nox -s serve -- --help``).
    """
    location = Path(session.virtualenv.location)
    _install(session)
    session.log(
        f"The trio-mlx command is in {location / 'bin'}: "
        f"`source {_shown(location) / 'bin' / 'activate'}` puts it on PATH"
    )
    # Ctrl-C reaches the server and nox alike; nox then sends SIGTERM after
    # interrupt_timeout, and a second signal makes the server cancel at once.
    # Give the server its whole graceful period (plus the engine's shutdown) first.
    grace = _serve_option(session.posargs, "graceful_timeout")
    session.run(
        "trio-mlx",
        "serve",
        *session.posargs,
        env=_model_env(),
        interrupt_timeout=float(grace) + 5.0,
        terminate_timeout=5.0,
    )


def _serve_option(posargs: list[str], name: str) -> object:
    """The value ``trio-mlx serve POSARGS`` gets for ``name`` (the CLI's parser, no MLX import)."""
    sys.path.insert(0, str(ROOT / "http"))
    try:
        from trio_mlx_http._cli import build_parser
    finally:
        sys.path.pop(0)
    args, _ = build_parser().parse_known_args(["serve", *posargs])
    return getattr(args, name)


@nox.session(python=PYTHON, name="train-default-model")
def train_default_model(session: nox.Session) -> None:
    """Re-train the bundled default model in place (``TRIO_MLX_BACKEND=cuda`` for a GPU).

    Options after ``--`` go to ``python -m tools.train``
    (``--out DIR`` to write elsewhere). Then ``nox -s instruct-default-model``, then
    ``nox -s train-adapter``: the shipped model went through all three.
    """
    _install(session, "train")
    session.run("python", "-m", "tools.train", *session.posargs, env=_model_env())


@nox.session(python=PYTHON, name="instruct-default-model")
def instruct_default_model(session: nox.Session) -> None:
    """Instruction-tune the bundled default model in place (``python -m tools.instruct``).

    The defaults are the shipped run's (4,000 steps: about a minute on an H200, hours on a
    2-core CPU). Options after ``--`` go to ``python -m tools.instruct``.
    """
    _install(session, "train")
    session.run("python", "-m", "tools.instruct", *session.posargs, env=_model_env())


@nox.session(python=PYTHON, name="tool-tune-default-model")
def tool_tune_default_model(session: nox.Session) -> None:
    """Teach the bundled model the ``lookup`` tool in place (``python -m tools.instruct_tools``).

    Run after ``instruct-default-model``. Options after ``--`` go to the tool.
    """
    _install(session, "train")
    session.run("python", "-m", "tools.instruct_tools", *session.posargs, env=_model_env())


@nox.session(python=PYTHON, name="edit-tune-default-model")
def edit_tune_default_model(session: nox.Session) -> None:
    """Teach the bundled model to rewrite a file with a name changed, in place
    (``python -m tools.instruct_edit``). Run after ``tool-tune-default-model``."""
    _install(session, "train")
    session.run("python", "-m", "tools.instruct_edit", *session.posargs, env=_model_env())


@nox.session(python=PYTHON, name="train-adapter")
def train_adapter(session: nox.Session) -> None:
    """Re-train the bundled "shout" LoRA adapter in place on the bundled default model."""
    _install(session, "train")
    session.run("python", "-m", "tools.train_adapter", *session.posargs, env=_model_env())


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """Reliability soak: load, disconnect storm, faults, hostile input, security, SIGTERM.

    Bounded (444 s measured on a loaded 2-core CPU); ``-- --quick`` runs a tenth of every count.
    Prints a summary table and writes ``.nox/soak-report.json``; exits 1 when a scenario fails.
    """
    _install(session, "test")
    session.run("python", "-m", "soak", *session.posargs, env=_model_env())


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark suite: trio-mlx vs bare mlx-lm vs mlx_lm.server (``-- --quick``: < 10 min)."""
    _install(session, "test", "train")  # httpx for the load clients, matplotlib for the plots
    session.run("python", "-m", "bench.suite", *session.posargs, env=_model_env())
