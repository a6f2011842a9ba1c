"""Serving one model sharded over an ``mx.distributed`` group (experimental).

Under ``mlx.launch`` every rank loads its shard (:func:`load_shard`: tensor
parallel where the architecture has ``shard``, e.g. llama; pipeline parallel
where it has ``model.pipeline``, e.g. qwen2; ``parallel`` picks).
Rank 0 runs the engine as usual; every other rank runs
:func:`trio_mlx.distributed.follow`: no HTTP, no arbiter, just a loop that
receives rank 0's worker commands and makes the same MLX calls in the same
order, so the collectives inside the sharded model line up.

The seam: this module is all of distributed mode below the worker boundary.
:func:`trio_mlx._start.loading.load` builds a :class:`MirroredLane` and rank 0's
:class:`Leader`; the engine makes one call, :meth:`Leader.attach` (the
watchdog, the heartbeat task, the lost-group hook), and hands serial work to
:meth:`Leader.run_serial`. The actor and the arbiter never see it.

The command stream
------------------
Rank 0's :class:`Leader` broadcasts, on its MLX thread and before making the
call itself, every state-changing call as a :class:`Command`: the batch lane's
step (a :class:`~trio_mlx._lanes.batch.StepPlan`: inserts, resumes, removes and
the burst length, the lane call's one argument),
park, discard, fail_all and close (:class:`MirroredLane`), and each serial
generation (its :class:`RowSpec`). On the wire a command is its short string
value and its arguments (a step plan as its four fields), so a message stays
as small as before the enum.
A message is a pickle in a fixed 1 KiB frame summed with ``all_sum`` (one
collective; a longer one takes a second), as ``mlx_lm.server`` shares its
requests, on mlx-lm's generation stream: on one stream the channel's and the
model's collectives keep program order on every rank.

A burst's length cannot depend on rank 0's clock or doorbell, which the
followers do not see: rank 0 fixes it up front, in the step command (the
steps that fit the actor's time budget at the measured step time), and every
rank ends it early only on what the tokens say (a row finished, failed or got
its first token). So no message passes between the steps of a burst, and
each rank queues its next step while the last one runs, as a bare mlx-lm loop
does; a message between steps would make the followers wait for the stream
to drain first (a frame's collective queues behind the step in flight). The
price: a doorbell (a cancel, a submission) during a distributed burst waits
for its end: about the time budget (20 ms; sized from the measured step
time, so a sudden slowdown can stretch one burst, never past 16 steps).

Whether a serial generation takes its next token is agreed token by token
with a one-frame ``go`` message (rank 0 sees cancellations). Everything else
(EOS, max_tokens, stop strings, a processor's failure) is computed alike on
every rank from the same tokens; sampling agrees because every rank seeds
``mx.random`` alike and the sampled logits are identical after the
collectives.

Not mirrored, refused with :class:`~trio_mlx.InvalidRequest`: LoRA adapters
(mounts, ``--adapter-path``, requests naming one) and ``run_exclusive`` (an
arbitrary function cannot be replayed on other ranks).

Liveness
--------
On a dead peer a collective blocks (NCCL; often the ring backend) or raises
(the ring backend, sometimes). Rank 0 runs a watchdog thread: a mirrored call
(or a serial token) that takes more than ``TRIO_MLX_DISTRIBUTED_TIMEOUT``
seconds, like one that raised, closes the engine (pending requests end with
:class:`~trio_mlx.EngineClosed`) and ends the process with status 1. While idle, rank 0 sends a heartbeat every :data:`HEARTBEAT`
seconds; a follower that hears nothing for the timeout exits with status 1.

Nothing here runs in a single-process engine: :func:`launched` only reads the
environment ``mlx.launch`` sets, and ``mx.distributed.init`` is called only
when it is true.
"""

from __future__ import annotations

import atexit
import enum
import logging
import math
import os
import pickle
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn, Protocol, TypeVar

import attrs
import trio

from trio_mlx._errors import EngineClosed
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.output import RowEvent
from trio_mlx._lanes.records import DECODE, RowSpec, StepPlan, StepResult


class Worker(Protocol):
    """What the leader needs of the engine's MLX worker (``trio_mlx._core.worker.Worker``)."""

    async def run(self, fn: Callable[[], Any]) -> Any: ...

    def call_soon_in_trio(self, fn: Callable[..., Any], *args: Any) -> None: ...


__all__ = [
    "PARALLEL",
    "Channel",
    "Command",
    "GroupLost",
    "Leader",
    "MirroredLane",
    "ProtocolError",
    "exit_status",
    "follower_rank",
    "launched",
    "load_shard",
    "replay",
    "timeout",
    "watch_follower",
]

T = TypeVar("T")

log = logging.getLogger("trio_mlx.distributed")

#: How the model is split over the ranks: mlx-lm's choice, or forced.
PARALLEL = ("auto", "tensor", "pipeline")

#: The longest one mirrored call (or one serial token) may take before rank 0
#: gives the group up, and the longest a follower waits for a command
#: (seconds; ``TRIO_MLX_DISTRIBUTED_TIMEOUT`` overrides it).
TIMEOUT = 60.0
#: Seconds of quiet after which an idle rank 0 sends a heartbeat (at most a
#: quarter of the timeout).
HEARTBEAT = 5.0
#: Seconds between giving the group up (the engine closes) and the process exit.
EXIT_GRACE = 2.0
#: Bytes of a channel frame: most messages fit one; a longer one takes a second collective.
FRAME = 1024
_LENGTH = struct.Struct("<I")

#: Rank 0's seed for every rank's ``mx.random``: sampled tokens must agree.
SEED = 0


#: The longest a rank waits at start-up for the others to start, or to load
#: their shards (seconds; ``TRIO_MLX_DISTRIBUTED_START_TIMEOUT`` overrides it):
#: a rank that died before the first collective must not leave the rest waiting.
START_TIMEOUT = 600.0


class Command(enum.Enum):
    """What rank 0 tells the followers; the value is what travels (a short string)."""

    #: A batch-lane step: a :class:`~trio_mlx._lanes.batch.StepPlan`.
    STEP = "step"
    #: ``BatchLane.park(ids)``, ``discard(ids)``, ``fail_all(error)``.
    PARK = "park"
    DISCARD = "discard"
    FAIL_ALL = "fail_all"
    #: A serial generation: its :class:`~trio_mlx._lanes.batch.RowSpec`.
    SERIAL = "serial"
    #: Whether the running serial generation takes its next token.
    GO = "go"
    #: A heartbeat (also: "is the group whole?" after a failed step).
    PING = "ping"
    #: The last command: the followers' loops end.
    CLOSE = "close"


def replay(lane: BatchLane, plan: StepPlan) -> StepResult:
    """Make ``plan``'s step on ``lane`` as every rank does: no clock, no interrupt."""
    return BatchLane.step(lane, plan, seconds=math.inf)


def _seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def timeout() -> float:
    """The liveness bound in seconds (``TRIO_MLX_DISTRIBUTED_TIMEOUT``, default :data:`TIMEOUT`)."""
    return _seconds("TRIO_MLX_DISTRIBUTED_TIMEOUT", TIMEOUT)


def start_timeout() -> float:
    """The start-up bound (``TRIO_MLX_DISTRIBUTED_START_TIMEOUT``, default :data:`START_TIMEOUT`)."""
    return _seconds("TRIO_MLX_DISTRIBUTED_START_TIMEOUT", START_TIMEOUT)


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


def load_shard(path: str, group: Any, parallel: str = "auto") -> tuple[Any, Any, dict[str, Any]]:
    """This rank's shard of the model at ``path``: (model, tokenizer, config), with
    ``mx.random`` seeded as on every rank.

    What mlx-lm's ``sharded_load`` does for a local folder, less its closing
    barrier: that is an ``all_sum`` on the CPU stream, which MLX's NCCL
    backend cannot run (on CUDA it fails with "There is no Stream(gpu, N) in
    current thread"). The caller syncs the ranks on the channel instead.
    ``parallel``: ``"tensor"`` (the architecture's ``shard``), ``"pipeline"``
    (``model.pipeline``: each rank keeps a slice of the layers) or ``"auto"``
    (tensor where the architecture has it, else pipeline, as mlx-lm picks).
    """
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    from trio_mlx._errors import InvalidRequest

    folder = Path(path)
    if not folder.exists():  # a Hugging Face repo id
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(path))
    model, config = load_model(folder, lazy=True, strict=False)
    inner = getattr(model, "model", None)
    tensor, pipeline = hasattr(model, "shard"), hasattr(inner, "pipeline")
    if parallel == "auto":
        parallel = "tensor" if tensor else "pipeline"
    if parallel == "tensor" and tensor:
        model.shard(group)
    elif parallel == "pipeline" and pipeline:
        assert inner is not None
        inner.pipeline(group)
    else:
        raise InvalidRequest(
            f"cannot shard the model: its architecture ({config.get('model_type')}) "
            f"does not support {parallel} parallelism",
            param="parallel",
        )
    mx.eval(model.parameters())
    # Sampled tokens feed the next step on every rank: their random streams must agree.
    mx.random.seed(SEED)
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        folder, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id")
    )
    return model, tokenizer, config


class GroupLost(BaseException):
    """A rank of the group is gone: the engine cannot go on (the MLX worker thread ends)."""


class ProtocolError(RuntimeError):
    """A follower received a message it did not expect: it has left rank 0's program."""


@attrs.define(eq=False)
class Channel:
    """Rank 0 -> every rank: pickled objects over ``all_sum`` (MLX thread only)."""

    group: Any
    #: perf_counter() when this rank began waiting for a message (None: not waiting).
    waiting_since: float | None = None

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    # The collectives go on mlx-lm's generation stream, the model's: on one
    # stream they run in program order, so each rank's sequence of collectives
    # is the same even while a decode step is still in flight (async_eval).

    def send(self, obj: Any) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        data = pickle.dumps(obj)
        head = _LENGTH.pack(len(data)) + data[: FRAME - _LENGTH.size]
        rest = data[FRAME - _LENGTH.size :]
        try:
            with mx.stream(generation_stream):
                frame = mx.array(memoryview(head.ljust(FRAME, b"\0")), dtype=mx.uint8)  # type: ignore[arg-type]
                mx.eval(mx.distributed.all_sum(frame, group=self.group))
                if rest:
                    tail = mx.array(memoryview(rest), dtype=mx.uint8)  # type: ignore[arg-type]
                    mx.eval(mx.distributed.all_sum(tail, group=self.group))
        except RuntimeError as exc:
            raise GroupLost(f"a rank of the group is gone: {exc}") from exc

    def receive(self) -> Any:
        self.waiting_since = time.perf_counter()
        try:
            return pickle.loads(self._receive())
        except RuntimeError as exc:  # the ring backend: a peer closed its connection
            raise GroupLost(f"a rank of the group is gone: {exc}") from exc
        finally:
            self.waiting_since = None

    def _receive(self) -> bytes:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            frame = mx.distributed.all_sum(mx.zeros(FRAME, dtype=mx.uint8), group=self.group)
            head = bytes(memoryview(frame))  # type: ignore[arg-type]
            (size,) = _LENGTH.unpack_from(head)
            data = head[_LENGTH.size : _LENGTH.size + size]
            if size > len(data):
                zeros = mx.zeros(size - len(data), dtype=mx.uint8)
                tail = mx.distributed.all_sum(zeros, group=self.group)
                data += bytes(memoryview(tail))  # type: ignore[arg-type]
        return data

    def share(self, obj: Any, *, limit: float | None = None) -> Any:
        """Rank 0's ``obj`` on every rank.

        With ``limit``, a rank still waiting after ``limit`` seconds (another
        rank never got here) ends its process with status 1.
        """
        timer = None
        if limit is not None:

            def give_up() -> None:
                log.error("rank %d: the other ranks did not answer in %g s", self.rank, limit)
                _end_process(1)

            timer = threading.Timer(limit, give_up)
            timer.daemon = True
            timer.start()
        try:
            if self.rank == 0:
                self.send(obj)
                return obj
            return self.receive()
        finally:
            if timer is not None:
                timer.cancel()


@attrs.define(eq=False)
class Leader:
    """Rank 0's end of the command stream, with its watchdog and heartbeat (MLX thread calls)."""

    channel: Channel
    #: Called (from any thread) with a reason when the group is lost or stuck.
    on_lost: Callable[[str], None] | None = None
    #: perf_counter() when the running mirrored call last sent (None: none runs); the watchdog reads it.
    busy_since: float | None = None
    #: perf_counter() of the last message sent.
    last_sent: float = attrs.field(factory=time.perf_counter)
    #: Seconds of quiet before an idle rank 0 sends a heartbeat.
    interval: float = attrs.field(factory=lambda: min(HEARTBEAT, timeout() / 4))
    closed: bool = False

    @property
    def ranks(self) -> int:
        """How many processes the model is sharded over."""
        return int(self.channel.group.size())

    def command(self, command: Command, *args: Any) -> None:
        """Broadcast a call that is about to run (the call is busy until :meth:`idle`)."""
        if self.closed:
            return
        self.busy_since = self.last_sent = time.perf_counter()
        try:
            self.channel.send((command.value, args))
        except GroupLost as exc:
            self.lost(str(exc))
            raise

    def agree(self, go_on: bool) -> bool:
        """Tell the followers whether the running call goes on; returns ``go_on``."""
        self.command(Command.GO, go_on)
        return go_on

    def idle(self) -> None:
        """The running mirrored call is over."""
        self.busy_since = None

    def quiet(self) -> bool:
        """Whether nothing was sent for a heartbeat interval."""
        return time.perf_counter() - self.last_sent >= self.interval

    def heartbeat(self) -> None:
        """A no-op command when nothing was sent for a while (MLX thread)."""
        if not self.closed and self.quiet():
            self.command(Command.PING)
            self.idle()

    def close(self) -> None:
        """Send the last command: the followers' loops end."""
        if not self.closed:
            self.command(Command.CLOSE)
            self.closed = True
            self.idle()

    def lost(self, reason: str) -> None:
        """Give the group up: close the engine now, end the process soon (non-zero)."""
        self.closed = True
        log.error("distributed group lost: %s; exiting in %.0f s", reason, EXIT_GRACE)
        if self.on_lost is not None:
            self.on_lost(reason)
        _exit_soon(1)

    def watch(self, limit: float | None = None) -> None:
        """Start the watchdog: a mirrored call that runs past ``limit`` loses the group."""
        bound = timeout() if limit is None else limit

        def stuck() -> None:
            self.lost(f"a collective call has not returned in {bound:g} s")

        _watchdog("trio-mlx-watchdog", bound, lambda: self.busy_since, stuck, lambda: self.closed)

    def attach(self, nursery: trio.Nursery, worker: Worker, close: Callable[[], None]) -> None:
        """Join rank 0's engine: a lost group calls ``close`` (on the Trio thread); start the
        watchdog and heartbeat."""
        self.on_lost = partial(worker.call_soon_in_trio, close)
        self.watch()
        nursery.start_soon(self.keep_alive, worker)

    async def keep_alive(self, worker: Worker) -> None:
        """Keep the followers hearing from an idle rank 0 (a Trio task; ends when closed)."""
        while not self.closed:
            await trio.sleep(self.interval / 2)
            if self.quiet():
                try:
                    await worker.run(self.heartbeat)
                except EngineClosed:  # the worker is gone; the actor closes the engine
                    return

    def run_serial(self, spec: RowSpec, run: Callable[..., T]) -> T:
        """Run a serial generation ``run(agree=...)`` mirrored: the followers run it too,
        and each token is agreed on (MLX thread)."""
        self.command(Command.SERIAL, spec)
        try:
            return run(agree=self.agree)
        except Exception:
            # Followers waiting for this token's go/stop get a stop; one that
            # failed alike ignores it.
            self.agree(False)
            raise
        finally:
            self.idle()


def _watchdog(
    name: str,
    bound: float,
    since: Callable[[], float | None],
    stuck: Callable[[], None],
    done: Callable[[], bool] = lambda: False,
) -> None:
    """A daemon thread that calls ``stuck()`` once ``since()`` (a perf_counter
    start, None when nothing waits) is more than ``bound`` seconds ago; it ends
    then, or once ``done()``."""

    def run() -> None:
        while not done():
            time.sleep(min(1.0, bound / 4))
            start = since()
            if start is not None and time.perf_counter() - start > bound:
                stuck()
                return

    threading.Thread(target=run, name=name, daemon=True).start()


#: The exit status a lost group gave this process (None while it has not lost one).
_lost_status: int | None = None


def exit_status(status: int) -> int:
    """The status a program that reports ``status`` exits with: ``status``, unless this
    process gave its distributed group up; then that (non-zero) status."""
    return status if _lost_status is None else _lost_status


def _end_process(status: int) -> NoReturn:
    """Flush the logs and standard streams, then end the process now (``os._exit``)
    with :func:`exit_status` of ``status``: a rank's watchdogs and lost-group exits."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(exit_status(status))


def _exit_soon(status: int) -> None:
    """End the process with ``status`` in ``EXIT_GRACE`` seconds, or sooner if its program ends.

    The engine closed already; the grace lets rank 0 answer what is pending.
    A program that ends first (its engine closed cleanly because the
    collective raised instead of hanging) still exits with ``status``.
    """
    global _lost_status
    _lost_status = status

    def later() -> None:
        time.sleep(EXIT_GRACE)
        _end_process(status)

    atexit.register(_end_process, status)
    threading.Thread(target=later, name="trio-mlx-group-lost", daemon=True).start()


@attrs.define(eq=False)
class MirroredLane(BatchLane):
    """A batch lane whose every state change is broadcast first (rank 0, once ``leader`` is set).

    Followers hold the same class with ``leader`` None and are driven by
    :func:`trio_mlx.distributed.follow`. Rank 0 fixes each burst's length before it starts (see
    the module's notes), from :attr:`step_seconds`.
    """

    leader: Leader | None = None
    #: Smoothed seconds per decode step, measured on rank 0 (None: not yet).
    step_seconds: float | None = None

    def burst_length(self, steps: int, seconds: float) -> int:
        """How many steps of a burst of at most ``steps`` fit in ``seconds``."""
        if steps <= 1 or self.step_seconds is None or self.step_seconds <= 0:
            return 1
        return max(1, min(steps, int(seconds / self.step_seconds)))

    def _command(self, command: Command, *args: Any) -> None:
        if self.leader is not None:
            self.leader.command(command, *args)

    def _done(self, result: T) -> T:
        if self.leader is not None:
            self.leader.idle()
        return result

    def step(
        self,
        plan: StepPlan = DECODE,
        *,
        seconds: float = 0.0,
        interrupt: Callable[[], bool] | None = None,
    ) -> StepResult:
        # ``interrupt`` is not followed: the followers could not see it.
        if self.leader is not None:
            plan = attrs.evolve(plan, steps=self.burst_length(plan.steps, seconds))
        self._command(Command.STEP, *attrs.astuple(plan, recurse=False))
        before = self.generator_seconds
        result = replay(self, plan)
        if result.steps and not plan.inserts and not plan.resumes:  # decode steps only, no prefill
            took = (self.generator_seconds - before) / result.steps
            last = self.step_seconds
            self.step_seconds = took if last is None else 0.8 * last + 0.2 * took
        if self.leader is not None and any(event.error is not None for event in result.events):
            # A collective inside the model may have failed: check the group is whole.
            self._command(Command.PING)
        return self._done(result)

    def discard(self, ids: Sequence[int]) -> int:
        self._command(Command.DISCARD, tuple(ids))
        return self._done(BatchLane.discard(self, ids))

    def park(self, ids: Sequence[int]) -> None:
        self._command(Command.PARK, tuple(ids))
        BatchLane.park(self, ids)
        self._done(None)

    def fail_all(self, error: BaseException) -> list[RowEvent]:
        self._command(Command.FAIL_ALL, RuntimeError(str(error)))
        return self._done(BatchLane.fail_all(self, error))

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()
            self.leader = None
        BatchLane.close(self)


def watch_follower(channel: Channel, bound: float) -> None:
    """A follower that waits longer than ``bound`` for rank 0 exits with status 1."""

    def stuck() -> None:
        log.error("rank %d: nothing from rank 0 in %g s; exiting", channel.rank, bound)
        _end_process(1)

    _watchdog("trio-mlx-follower-watchdog", bound, lambda: channel.waiting_since, stuck)
