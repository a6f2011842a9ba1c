"""The prompt cache's disk tier: checkpoints kept as safetensors files across restarts.

One entry is two files in the folder: ``NAME.safetensors`` (mlx-lm's
``save_prompt_cache``: every cache kind's state and meta state) and its index
``NAME.json`` (the model identity, the tokens' length and digest, the data
file's size and CRC-32). ``NAME`` is derived from the identity and the tokens,
so two servers on one folder that store the same prefix write the same name
with the same bytes. Every file is written under a temporary name and moved in
place with ``os.replace`` (the index after its data file), so a reader sees a
whole file or none, and there is no shared index file for two writers to race
on: each server reads the folder's index files.

Writes run on a writer thread of this module (the MLX thread evaluates the
arrays and hands them over; ``submit`` never waits for the disk). At most
``max_pending`` checkpoints wait for it: a newer one drops the oldest waiting
(an agent's turns come faster than a 1.3 GB file is written, and each waiting
checkpoint holds its arrays in memory; the newest is the one the next turn
extends). Reads run where the prompt cache is looked up (the MLX thread): a
missing, truncated or corrupt entry (size, a CRC-32 of one of its 64 MiB
chunks, identity or digest not as its index says, or a load that fails) is
skipped with a warning and forgotten, never served. The chunks' CRCs are
checked on a pool of threads while MLX loads the file (zlib releases the GIL):
one pass over 1.4 GB was most of a restart's first token on the H200.
Eviction is least recently used by file time (a hit touches the file), to
``max_bytes`` of data files, after each write.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import queue
import sys
import threading
import zlib
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = ["DiskTier", "model_identity", "tokens_digest"]

logger = logging.getLogger("trio_mlx")

_DATA = ".safetensors"
_INDEX = ".json"
_FORMAT = 2  # 2: a CRC-32 a chunk


def tokens_digest(tokens: Sequence[int]) -> str:
    """The SHA-256 of the token ids (as little-endian 64-bit integers)."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()


def model_identity(folder: str | os.PathLike[str], *extra: str) -> str:
    """A cheap identity of the weights in ``folder``: the SHA-256 of every file's
    name, size and modification time (not their bytes, which would take a pass
    over gigabytes at each start), plus ``extra`` strings (the adapter, the
    mlx-lm version, the cache layout)."""
    digest = hashlib.sha256()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.suffix not in (".safetensors", ".json", ".npz", ".gguf"):
            continue
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    for item in extra:
        digest.update(f"{item}\n".encode())
    return digest.hexdigest()


#: Bytes of a data file under one CRC-32 of its index.
CHUNK = 64 << 20
_checkers: concurrent.futures.ThreadPoolExecutor | None = None


def _crc32(path: Path, start: int = 0, size: int = -1) -> int:
    """The CRC-32 of ``size`` bytes of ``path`` from ``start`` (-1: to its end)."""
    crc = 0
    with path.open("rb") as file:
        file.seek(start)
        left = size if size >= 0 else 1 << 62
        while left > 0 and (block := file.read(min(1 << 22, left))):
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return crc


def _chunk_crcs(path: Path) -> list[int]:
    """The CRC-32 of each ``CHUNK`` of ``path``, in order."""
    size = path.stat().st_size
    return [_crc32(path, start, CHUNK) for start in range(0, max(size, 1), CHUNK)]


def _chunk_checks(path: Path, count: int) -> list[concurrent.futures.Future[int]]:
    """The CRC-32 of each of ``path``'s first ``count`` chunks, worked out on a pool."""
    global _checkers
    if _checkers is None:
        workers = max(1, min(8, os.cpu_count() or 1))
        _checkers = concurrent.futures.ThreadPoolExecutor(workers, "trio-mlx-crc")
    return [_checkers.submit(_crc32, path, i * CHUNK, CHUNK) for i in range(count)]


def _listed(folder: Path, suffix: str) -> list[Path]:
    """The folder's entry files ending in ``suffix`` (not the dot-named ones being written)."""
    return [p for p in folder.glob(f"*{suffix}") if not p.name.startswith(".")]


def _replace_atomically(path: Path, write: Any) -> None:
    """``write(temporary path)``, then move it to ``path`` in one step."""
    # A dot name (never listed as an entry) with the same suffix (MLX appends
    # ``.safetensors`` to a name without it).
    unique = f"{os.getpid()}-{threading.get_ident()}"
    temporary = path.with_name(f".{path.stem}.{unique}{path.suffix}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


@attrs.define(eq=False)
class DiskTier:
    """Checkpoints of one model in ``folder``, capped at ``max_bytes`` (see the module)."""

    folder: Path
    identity: str
    max_bytes: int
    #: Shortest checkpoint written (tokens): a shorter prompt prefills faster than
    #: its file loads (design/engine.md, "The disk tier").
    min_tokens: int = 1024
    #: Checkpoints waiting for the writer at most; a newer one drops the oldest.
    max_pending: int = 2
    #: Entries read back, written, skipped as missing or corrupt, and dropped
    #: unwritten behind newer ones (counters).
    hits: int = attrs.field(init=False, default=0)
    writes: int = attrs.field(init=False, default=0)
    failures: int = attrs.field(init=False, default=0)
    dropped: int = attrs.field(init=False, default=0)
    #: Length -> token digest -> entry name, for this identity (rebuilt when the
    #: folder changes: another server may have written or evicted entries).
    _index: dict[int, dict[str, str]] = attrs.field(init=False, factory=dict)
    _scanned: int = attrs.field(init=False, default=-1)
    _bytes: int = attrs.field(init=False, default=0)
    _queue: queue.Queue[tuple[str, int, str, list[Any]] | None] = attrs.field(
        init=False, factory=queue.Queue
    )
    _thread: threading.Thread | None = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def open(self) -> None:
        """Create the folder, read its index files and start the writer thread."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._rescan()
        self._thread = threading.Thread(
            target=self._write_loop, name="trio-mlx-prompt-disk", daemon=True
        )
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (within ``timeout`` seconds) and stop the writer."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def flush(self) -> None:
        """Wait until every write queued so far is on disk (tests)."""
        self._queue.join()

    @property
    def nbytes(self) -> int:
        """Bytes of this folder's data files at the last scan."""
        return self._bytes

    @property
    def entries(self) -> int:
        """Entries of this model at the last scan."""
        return sum(len(by_digest) for by_digest in self._index.values())

    def _name(self, digest: str) -> str:
        return hashlib.sha256(f"{self.identity}\0{digest}".encode()).hexdigest()[:40]

    def _rescan(self) -> None:
        """Read the index files again if the folder changed since the last scan."""
        try:
            changed = os.stat(self.folder).st_mtime_ns
        except OSError:
            return
        if changed == self._scanned:
            return
        index: dict[int, dict[str, str]] = {}
        total = 0
        for path in _listed(self.folder, _INDEX):
            try:
                meta = json.loads(path.read_text())
                total += int(meta["bytes"])
                if meta["format"] == _FORMAT and meta["identity"] == self.identity:
                    index.setdefault(int(meta["length"]), {})[str(meta["digest"])] = path.stem
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written or removed by another server, or not ours
        self._index, self._bytes, self._scanned = index, total, changed

    def lookup(self, tokens: Sequence[int], longer_than: int) -> tuple[list[Any], int] | None:
        """The longest stored prefix of ``tokens`` (at most all but the last token)
        longer than ``longer_than`` tokens: (its cache, its length), or None."""
        self._rescan()
        limit = len(tokens) - 1
        for length in sorted(self._index, reverse=True):
            if length > limit:
                continue
            if length <= longer_than:
                break
            name = self._index[length].get(tokens_digest(tokens[:length]))
            if name is None:
                continue
            cache = self._read(name, length)
            if cache is not None:
                return cache, length
        return None

    def _read(self, name: str, length: int) -> list[Any] | None:
        from mlx_lm.models.cache import load_prompt_cache

        data = self.folder / f"{name}{_DATA}"
        try:
            meta = json.loads((self.folder / f"{name}{_INDEX}").read_text())
            if data.stat().st_size != int(meta["bytes"]):
                raise ValueError(f"{data.stat().st_size} bytes, its index says {meta['bytes']}")
            crcs = [int(crc) for crc in meta["crc32_chunks"]]
            checks = _chunk_checks(data, len(crcs))  # beside the load; used only if they match
            cache, saved = load_prompt_cache(str(data), return_metadata=True)  # type: ignore[no-untyped-call]
            if [check.result() for check in checks] != crcs:
                raise ValueError("a CRC-32 of its chunks is not its index's")
            if saved.get("identity") != self.identity or int(saved.get("length", -1)) != length:
                raise ValueError("it was written for another model or prompt")
            os.utime(data)  # most recently used
        except Exception as exc:  # a torn, truncated or foreign file: skip it, never crash
            self.failures += 1
            logger.warning("prompt cache: skipping the disk entry %s: %s", data.name, exc)
            for by_digest in self._index.values():
                for digest in [d for d, n in by_digest.items() if n == name]:
                    del by_digest[digest]
            return None
        self.hits += 1
        return list(cache)

    def submit(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Queue ``cache`` (holding exactly ``tokens``; its arrays evaluated or
        queued for evaluation on the MLX thread) to be written; never waits."""
        if len(tokens) < self.min_tokens or self._thread is None:
            return
        digest = tokens_digest(tokens)
        if self._index.get(len(tokens), {}).get(digest) is not None:
            return  # already on disk
        while self._queue.qsize() >= self.max_pending:
            try:
                self._queue.get_nowait()  # the oldest waiting; the writer may take it first
            except queue.Empty:
                break
            self._queue.task_done()
            self.dropped += 1
        self._queue.put((self._name(digest), len(tokens), digest, cache))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as exc:
                logger.warning("prompt cache: could not write a disk entry: %s", exc)
            finally:
                self._queue.task_done()

    def _write(self, name: str, length: int, digest: str, cache: list[Any]) -> None:
        from mlx_lm.models.cache import save_prompt_cache

        data = self.folder / f"{name}{_DATA}"
        meta = {"identity": self.identity, "length": str(length), "digest": digest}
        _replace_atomically(data, lambda path: save_prompt_cache(str(path), cache, meta))
        index = {
            "format": _FORMAT,
            "identity": self.identity,
            "length": length,
            "digest": digest,
            "bytes": data.stat().st_size,
            "crc32_chunks": _chunk_crcs(data),
        }
        _replace_atomically(
            self.folder / f"{name}{_INDEX}", lambda path: path.write_text(json.dumps(index))
        )
        with self._lock:
            self.writes += 1
        self._evict()

    def _evict(self) -> None:
        """Remove the least recently used entries (of any model) past ``max_bytes``."""
        entries = []
        for data in _listed(self.folder, _DATA):
            with contextlib.suppress(OSError):
                stat = data.stat()
                entries.append((stat.st_mtime_ns, stat.st_size, data))
        total = sum(size for _, size, _ in entries)
        for _, size, data in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            for path in (data.with_suffix(_INDEX), data):  # the index first: never half-listed
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            total -= size
