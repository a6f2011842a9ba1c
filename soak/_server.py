"""A ``trio-mlx serve`` subprocess on 127.0.0.1, its URL read back from its log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import attrs
import httpx

_SERVING = re.compile(r"serving \S+ on (http://\S+)")
#: The log kept in memory: enough for the last few thousand access lines.
_LOG_LIMIT = 4 * 1024 * 1024


@attrs.define(eq=False)
class ServerProcess:
    """A running server: its process, its URL, and the tail of its log."""

    process: subprocess.Popen[bytes]
    url: str = ""
    _log: bytearray = attrs.field(factory=bytearray)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def log(self) -> str:
        """What the server wrote to stderr (the last few MiB)."""
        with self._lock:
            return self._log.decode(errors="replace")

    def rss_bytes(self) -> int:
        """The resident set size of the server process, from ``/proc``."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        assert match is not None, status
        return int(match.group(1)) * 1024

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; SIGKILL after ``timeout``. Return the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in iter(self.process.stderr.readline, b""):
            with self._lock:
                self._log += line
                if len(self._log) > _LOG_LIMIT:
                    del self._log[: len(self._log) - _LOG_LIMIT]


def model_env() -> dict[str, str]:
    """This environment with an optimized BLAS preloaded (what ``nox`` sets)."""
    from trio_mlx._start.blas import preload_env

    return preload_env(dict(os.environ))


@contextmanager
def serve(
    *args: str, model: Path | None = None, startup_timeout: float = 120.0
) -> Iterator[ServerProcess]:
    """Run ``trio-mlx serve --port 0 ARGS`` until the block ends (SIGTERM, then SIGKILL)."""
    command: list[str] = [sys.executable, "-m", "trio_mlx_http", "serve", "--port", "0"]
    if model is not None:
        command += ["--model", str(model)]
    # The BLAS comes preloaded through the environment: no re-exec, one pid to watch.
    command += ["--no-fast-blas", *args]
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=model_env(),
    )  # fmt: skip
    server = ServerProcess(process)
    threading.Thread(target=server._drain, name="soak-server-log", daemon=True).start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not (match := _SERVING.search(server.log)):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{server.log[-4000:]}")
            time.sleep(0.05)
        server.url = match.group(1)
        yield server
    finally:
        if process.poll() is None:
            with suppress(subprocess.TimeoutExpired):
                server.terminate()


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """``GET /metrics``: every unlabelled sample, by name."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values
