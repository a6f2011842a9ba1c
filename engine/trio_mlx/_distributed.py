"""Serving one model sharded over an ``mx.distributed`` group (experimental).

Under ``mlx.launch`` every rank loads its shard with mlx-lm's ``sharded_load``
(tensor parallel where the architecture has ``shard``, e.g. llama). Rank 0
runs the engine as usual; every other rank runs :func:`follow`: no HTTP, no
arbiter, just a loop that receives rank 0's batch-lane commands and calls the
same :class:`~trio_mlx._batch.BatchLane` methods with the same arguments, so
the collectives inside the sharded model line up.

The command stream is rank 0's :class:`MirroredLane`: before running a lane
method on its MLX thread it broadcasts the method name and its plain-data
arguments (pickled into a uint8 array summed with ``all_sum``, as
``mlx_lm.server`` shares its requests). Only the batch lane is mirrored, one
decode step per command (no bursts); what cannot be mirrored (the serial
lane: seeds, quantized KV caches, adapters; ``run_exclusive``; adapter
mounts) is refused with :class:`~trio_mlx.InvalidRequest`.

Nothing here runs in a single-process engine: :func:`launched` only reads the
environment ``mlx.launch`` sets, and ``mx.distributed.init`` is called only
when it is true.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from trio_mlx._batch import BatchLane, RowSpec, StepResult
from trio_mlx._output import RowEvent

__all__ = ["Channel", "GroupLost", "MirroredLane", "follow", "follower_rank", "launched"]

T = TypeVar("T")

log = logging.getLogger("trio_mlx.distributed")

#: The longest one mirrored lane call may take before rank 0 gives the group up
#: (seconds; ``TRIO_MLX_DISTRIBUTED_TIMEOUT`` overrides it).
TIMEOUT = 60.0
#: Seconds between giving the group up (the engine closes) and the process exit.
EXIT_GRACE = 2.0

#: Rank 0's seed for every rank's ``mx.random``: sampled tokens must agree.
SEED = 0


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def launched() -> bool:
    """Whether this process was started by ``mlx.launch`` (or mpirun) as one of several ranks."""
    if os.environ.get("TRIO_MLX_DISTRIBUTED", "") == "0":
        return False
    size = _env_int("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    if size is not None:
        return size > 1
    # The ring backend sets MLX_RANK and a hostfile, not the world size.
    return "MLX_RANK" in os.environ and "MLX_HOSTFILE" in os.environ


def follower_rank() -> int | None:
    """This process's rank when it is a follower (rank > 0 of a launched group), else None."""
    if not launched():
        return None
    rank = _env_int("MLX_RANK", "OMPI_COMM_WORLD_RANK")
    return rank if rank else None


def group() -> Any:
    """The ``mx.distributed`` group when launched with more than one rank, else None."""
    if not launched():
        return None
    import mlx.core as mx

    world = mx.distributed.init()
    return world if world.size() > 1 else None


class GroupLost(BaseException):
    """A rank of the group is gone: the engine cannot go on (the MLX worker thread ends)."""


@attrs.define(eq=False)
class Channel:
    """Rank 0 -> every rank: pickled objects over ``all_sum`` (MLX thread only)."""

    group: Any

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    # The collectives go on mlx-lm's generation stream, the model's: on one
    # stream they run in program order, so each rank's sequence of collectives
    # is the same even while a decode step is still in flight (async_eval).

    def send(self, obj: Any) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        try:
            with mx.stream(generation_stream):
                data = mx.array(pickle.dumps(obj))  # type: ignore[arg-type]
                mx.eval(mx.distributed.all_sum(mx.array(data.size), group=self.group))
                mx.eval(mx.distributed.all_sum(data, group=self.group))
        except RuntimeError as exc:
            raise GroupLost(f"a rank of the group is gone: {exc}") from exc

    def receive(self) -> Any:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            size = int(mx.distributed.all_sum(mx.array(0), group=self.group).item())  # type: ignore[arg-type]
            data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group)
            mx.eval(data)
        return pickle.loads(bytes(memoryview(data)))  # type: ignore[arg-type]

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.rank == 0:
            self.send(obj)
            return obj
        return self.receive()


@attrs.define(eq=False)
class MirroredLane(BatchLane):
    """A batch lane whose every state change is broadcast first (rank 0, once ``channel`` is set).

    Followers hold the same class with ``channel`` None and are driven by
    :func:`follow`. A step is always one decode step: a burst's length depends
    on the clock and on the actor's doorbell, which the followers cannot see.
    """

    channel: Channel | None = None
    #: Rank 0: called (from any thread) with a reason when the group is lost or stuck.
    on_lost: Callable[[str], None] | None = None
    #: perf_counter() when the running mirrored call began (None: none runs); the watchdog reads it.
    busy_since: float | None = None

    def _mirror(self, name: str, *args: Any) -> None:
        if self.channel is None:
            return
        self.busy_since = time.perf_counter()
        try:
            self.channel.send((name, args))
        except GroupLost as exc:
            self.lost(str(exc))
            raise

    def _done(self, result: T) -> T:
        self.busy_since = None
        return result

    def lost(self, reason: str) -> None:
        """Give the group up: close the engine now, end the process soon (non-zero)."""
        log.error("distributed group lost: %s; exiting in %.0f s", reason, EXIT_GRACE)
        if self.on_lost is not None:
            self.on_lost(reason)

        def bye() -> None:
            time.sleep(EXIT_GRACE)
            os._exit(1)

        threading.Thread(target=bye, name="trio-mlx-group-lost", daemon=True).start()

    def watch(self, timeout: float | None = None) -> None:
        """Start the watchdog: a mirrored call that runs past ``timeout`` loses the group."""
        if timeout is None:
            timeout = float(os.environ.get("TRIO_MLX_DISTRIBUTED_TIMEOUT", TIMEOUT))
        limit = timeout

        def run() -> None:
            while self.channel is not None:
                time.sleep(min(1.0, limit / 4))
                since = self.busy_since
                if since is not None and time.perf_counter() - since > limit:
                    self.lost(f"a collective call has not returned in {limit:g} s")
                    return

        threading.Thread(target=run, name="trio-mlx-watchdog", daemon=True).start()

    def step(
        self,
        inserts: Sequence[RowSpec] = (),
        resumes: Sequence[int] = (),
        removes: Sequence[int] = (),
        *,
        steps: int = 1,
        seconds: float = 0.0,
        interrupt: Callable[[], bool] | None = None,
    ) -> StepResult:
        args = (tuple(inserts), tuple(resumes), tuple(removes))
        self._mirror("step", *args)
        result = BatchLane.step(self, *args)
        if any(event.error is not None for event in result.events):
            # A collective inside the model may have failed: check the group is whole.
            self._mirror("ping")
        return self._done(result)

    def discard(self, ids: Sequence[int]) -> int:
        self._mirror("discard", tuple(ids))
        return self._done(BatchLane.discard(self, ids))

    def park(self, ids: Sequence[int]) -> None:
        self._mirror("park", tuple(ids))
        BatchLane.park(self, ids)
        self._done(None)

    def fail_all(self, error: BaseException) -> list[RowEvent]:
        self._mirror("fail_all", RuntimeError(str(error)))
        return self._done(BatchLane.fail_all(self, error))

    def close(self) -> None:
        self._mirror("close")
        self.channel = None
        BatchLane.close(self)
        self._done(None)

    def ping(self) -> None:
        """Nothing (followers receive it as a command: the group is whole)."""


def follow(
    model: str | os.PathLike[str] | None,
    *,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Run a follower rank until rank 0 closes its lane; returns an exit status.

    Loads the same shard layout as rank 0 (rank 0's batch settings arrive over
    the channel), then executes rank 0's lane commands in order.
    """
    from trio_mlx._engine import _load, _resolve_model

    loaded = _load(_resolve_model(model), None, 1, 0, 1, 1, distributed=True)
    lane = loaded.lane
    channel = Channel(loaded.group)
    if on_ready is not None:
        on_ready()
    while True:
        name, args = channel.receive()
        if name == "ping":
            continue
        try:
            getattr(BatchLane, name)(lane, *args)
        except Exception:  # rank 0 saw the same error on the same command
            log.exception("rank %d: lane command %s failed", channel.rank, name)
        if name == "close":
            return 0
