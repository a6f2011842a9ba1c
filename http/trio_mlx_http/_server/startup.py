"""Start-up of the ``trio-mlx`` command: bind the port first, explain failures briefly.

A person who mistypes a flag should read what is wrong and what to do in a
line or two, not a chained traceback: :func:`explain` turns the failures a
start-up meets (a busy port, a missing model or adapter, a Hugging Face id
without network, an engine refusal) into at most three lines. ``--debug``
shows the traceback as well. :func:`bind_socket` takes the port before the
model loads, so a busy port fails in a moment rather than after minutes of
loading.
"""

from __future__ import annotations

import errno
import socket
import sys
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TextIO

__all__ = ["StartupError", "bind_socket", "bound_socket", "explain", "report"]

#: The prefix of every line the command prints about a failure.
PREFIX = "trio-mlx: "


class StartupError(Exception):
    """A start-up failure the command line explains without a traceback."""

    def __init__(self, problem: str, remedy: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.remedy = remedy


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: connections are refused
    until the server starts), or :class:`StartupError` saying why it cannot be."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise StartupError(
            f"cannot listen on {host!r}: {error.strerror or error}",
            "--host takes an address of this machine, e.g. 127.0.0.1 or 0.0.0.0",
        ) from error
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As Hypercorn does: a server restarted at once may reuse its port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is already in use (another server is listening there)",
                "stop that server, or pick another port with --port N (--port 0: any free one)",
            ) from error
        if error.errno == errno.EACCES:
            raise StartupError(
                f"no permission to listen on {where} (ports below 1024 need privileges)",
                "pick a port above 1023 with --port N",
            ) from error
        if error.errno == errno.EADDRNOTAVAIL:
            raise StartupError(
                f"cannot listen on {host}: it is not an address of this machine",
                "--host takes an address of this machine, e.g. 127.0.0.1 or 0.0.0.0",
            ) from error
        raise StartupError(f"cannot listen on {where}: {error.strerror or error}") from error
    return sock


@asynccontextmanager
async def bound_socket(host: str, port: int) -> AsyncIterator[socket.socket]:
    """:func:`bind_socket` for the block, closed at its end unless ``detach()``-ed.

    Asynchronous only so that it shares one ``async with`` with the engine."""
    with bind_socket(host, port) as sock:
        yield sock


_REMEDIES = {
    "model": "--model takes a local folder (config.json and weights) or a Hugging Face id "
    "such as mlx-community/Qwen3-0.6B-4bit; leave it out for the bundled demo model",
    "model_not_downloadable": "pass --model a local folder, or fetch the model once where "
    "there is network (`hf download ID` does it ahead); later runs read the local cache",
    "adapter_path": "--adapter-path takes a LoRA adapter folder (adapters.safetensors and "
    "adapter_config.json, as mlx_lm.lora writes them)",
    "unsupported_in_distributed_mode": "leave that flag out under mlx.launch, "
    "or serve in one process",
}


def explain(error: BaseException) -> list[str]:
    """At most three lines that say what went wrong and, where known, what to do."""
    from trio_mlx import NotFound, TrioMLXError  # the engine's errors; light, no MLX import

    leaf = _single_leaf(error)
    if isinstance(leaf, StartupError):
        lines: list[str | None] = [leaf.problem, leaf.remedy]
    elif isinstance(leaf, TrioMLXError):
        param = leaf.param
        # By code first; by the flag only for what was not found (the folder advice).
        remedy = _REMEDIES.get(leaf.code or "")
        if remedy is None and isinstance(leaf, NotFound):
            remedy = _REMEDIES.get(param or "")
        if remedy is None and param and param.isupper():  # an environment variable
            remedy = f"check the environment variable {param}"
        elif remedy is None and param:
            remedy = f"check --{param.replace('_', '-')}"
        lines = [_first_line(leaf.message), remedy]
    elif isinstance(leaf, ImportError) and (leaf.name or "").split(".")[0] == "mlx":
        lines = [
            f"MLX cannot be imported ({_first_line(str(leaf))})",
            "install a backend: on Linux `pip install 'trio-mlx[cpu]'` (or [cuda]); "
            "on a Mac `pip install trio-mlx`",
        ]
    else:
        lines = [
            f"{type(leaf).__name__}: {_first_line(str(leaf))}",
            "unexpected; run again with --debug for the traceback",
        ]
    problem, *rest = lines
    return [f"{PREFIX}error: {problem}", *(PREFIX + line for line in rest if line)]


def report(error: BaseException, *, debug: bool, file: TextIO | None = None) -> int:
    """Print ``error`` for a person (with its traceback under ``debug``); the exit status."""
    out = file if file is not None else sys.stderr
    if debug:
        traceback.print_exception(error, file=out)
    for line in explain(error):
        print(line, file=out)
    out.flush()
    return 1


def _single_leaf(error: BaseException) -> BaseException:
    """The one exception inside (nested) groups of one, else ``error`` itself."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else "(no message)"
