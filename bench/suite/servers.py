"""Servers under test, each in a process of its own on 127.0.0.1.

:func:`mlx_lm_server` runs ``python -m mlx_lm.server``; :func:`trio_mlx_server` runs
``python -m trio_mlx_http serve`` (the ``trio-mlx serve`` CLI; the module form also
works where the package is on ``PYTHONPATH`` but not installed, as on the GPU machine).
Both are context managers that yield a :class:`Server` once ``/health`` answers 200,
and stop the process (SIGINT, then SIGKILL after a grace period) on exit.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

_TICKS = os.sysconf("SC_CLK_TCK")


@attrs.define(eq=False)
class Server:
    """A running server process and how to reach it."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    #: The ``model`` field requests send; None to leave it out.
    model: str | None = None

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS

    def log_size(self) -> int:
        """Bytes in the server's log so far (a mark for :meth:`log_lines`)."""
        return self.log.stat().st_size if self.log.exists() else 0

    def log_lines(self, since: int, marker: str) -> list[str]:
        """Lines of the log written after byte ``since`` that contain ``marker``."""
        if not self.log.exists():
            return []
        with self.log.open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return [line for line in text.splitlines() if marker in line]

    def memory(self) -> dict[str, int]:
        """Current and peak resident set size in bytes (``VmRSS``, ``VmHWM``)."""
        out = {}
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(server: Server, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{tail}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{server.name} did not become healthy within {timeout:.0f} s")


@contextlib.contextmanager
def _serve(
    name: str, command: Sequence[str], env: dict[str, str], log_dir: Path, timeout: float
) -> Iterator[Server]:
    port = free_port()
    command = [arg.replace("{port}", str(port)) for arg in command]
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") + ".log")
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    server = Server(name, f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_ready(server, timeout)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextlib.contextmanager
def mlx_lm_server(
    model_dir: Path, *, max_batch: int, env: dict[str, str], log_dir: Path, timeout: float = 300
) -> Iterator[Server]:
    """``mlx_lm.server`` on ``model_dir`` decoding up to ``max_batch`` requests together."""
    command = [
        sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", "{port}",
        "--decode-concurrency", str(max_batch),
        "--log-level", "WARNING",
    ]  # fmt: skip
    with _serve("mlx_lm.server", command, env, log_dir, timeout) as server:
        yield server


def trio_mlx_help(env: dict[str, str]) -> str | None:
    """``trio-mlx serve --help``'s text, or None while the command does not exist."""
    result = subprocess.run(
        [sys.executable, "-m", "trio_mlx_http", "serve", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if result.returncode != 0 or "--model" not in result.stdout:
        return None
    return result.stdout


@contextlib.contextmanager
def trio_mlx_server(
    model_dir: Path,
    *,
    max_batch: int,
    env: dict[str, str],
    log_dir: Path,
    drain_timeout: float | None = 1.0,
    extra: Sequence[str] = (),
    timeout: float = 300,
) -> Iterator[Server]:
    """``trio-mlx serve`` on ``model_dir``; ``drain_timeout`` None means never preempt rows."""
    command = [
        sys.executable, "-m", "trio_mlx_http", "serve", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", "{port}", "--max-batch", str(max_batch),
    ]  # fmt: skip
    # The CLI takes a number only: an infinite timeout is the engine's None (wait for the rows).
    command += ["--drain-timeout", "inf" if drain_timeout is None else str(drain_timeout)]
    command += list(extra)
    name = f"trio-mlx (drain {drain_timeout})"
    with _serve(name, command, env, log_dir, timeout) as server:
        server.model = _first_model(server)
        yield server


def _first_model(server: Server) -> Any:
    import httpx

    try:
        data = httpx.get(server.url + "/v1/models", timeout=5.0).json()["data"]
        return data[0]["id"] if data else None
    except (httpx.HTTPError, KeyError, ValueError, IndexError):
        return None
