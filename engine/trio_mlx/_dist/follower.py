"""A distributed follower: a rank > 0 that replays rank 0's MLX calls (no HTTP, no actor).

It loads the same shard layout as rank 0 (:func:`trio_mlx._start.loading.load` takes rank
0's settings over the channel first), then receives rank 0's commands in order and
makes each call on its own lane: a :class:`~trio_mlx._dist.leader.Command` selects
a method of :class:`Follower` from one table, so every command rank 0 can send
has exactly one handler here. How the ranks stay in step, and why a follower
never follows a clock, is in :mod:`trio_mlx._dist.leader`.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from trio_mlx._dist.leader import (
    Channel,
    Command,
    GroupLost,
    ProtocolError,
    replay,
    timeout,
    watch_follower,
)
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.prompt_cache import PromptCache
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx._lanes.serial import run_serial

__all__ = ["Follower", "Loaded", "serve"]

log = logging.getLogger("trio_mlx.distributed")


class Loaded(Protocol):
    """What a follower needs of its loaded model (``trio_mlx._start.loading.Loaded``)."""

    model: Any
    tokenizer: Any
    lane: BatchLane
    prompt_cache: PromptCache | None


@attrs.define(eq=False)
class Follower:
    """One follower rank's lane and model: a method per command that changes state."""

    loaded: Loaded
    channel: Channel

    def step(self, *fields: Any) -> None:
        replay(self.loaded.lane, StepPlan(*fields))

    def park(self, ids: tuple[int, ...]) -> None:
        BatchLane.park(self.loaded.lane, ids)

    def discard(self, ids: tuple[int, ...]) -> None:
        BatchLane.discard(self.loaded.lane, ids)

    def fail_all(self, error: BaseException) -> None:
        BatchLane.fail_all(self.loaded.lane, error)

    def serial(self, spec: RowSpec) -> None:
        loaded = self.loaded
        run_serial(
            loaded.model,
            loaded.tokenizer,
            spec,
            cancelled=threading.Event(),
            emit=lambda events: None,
            prompt_cache=loaded.prompt_cache,
            agree=self.agree,
        )

    def agree(self, go_on: bool) -> bool:
        """The serial lane's token-by-token agreement: rank 0's go or stop (``go_on`` unused)."""
        command, args = _decode(self.channel.receive())
        if command is not Command.GO:
            raise ProtocolError(f"expected rank 0's go/stop, got {command.value}")
        return bool(args[0])


#: The state-changing commands; ``GO`` outside a serial generation (a stop that ended
#: it early) and ``PING`` (a heartbeat) change nothing; ``CLOSE`` ends the loop.
HANDLERS: dict[Command, Callable[..., None]] = {
    Command.STEP: Follower.step,
    Command.PARK: Follower.park,
    Command.DISCARD: Follower.discard,
    Command.FAIL_ALL: Follower.fail_all,
    Command.SERIAL: Follower.serial,
    Command.GO: lambda follower, *args: None,
    Command.PING: lambda follower, *args: None,
}


def _decode(message: Any) -> tuple[Command, tuple[Any, ...]]:
    try:
        name, args = message
        return Command(name), tuple(args)
    except (TypeError, ValueError):
        raise ProtocolError(f"not a command from rank 0: {message!r:.200}") from None


def _ignore_stop_signals() -> None:
    """Ctrl-C reaches every rank of a terminal's ``mlx.launch``: a follower must
    stay until rank 0 has finished its in-flight requests and sends ``close``
    (or is gone, which the follower notices by itself)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def note(signum: int, frame: Any) -> None:
        log.info("signal %d: this rank ends when rank 0 closes the group", signum)

    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, note)


def serve(loaded: Loaded, channel: Channel, *, on_ready: Callable[[], None] | None = None) -> int:
    """Run a follower rank until rank 0 closes its lane; returns an exit status.

    ``loaded`` holds the same shard layout as rank 0's (see :func:`trio_mlx.distributed.follow`);
    the rank executes rank 0's commands in order.
    """
    _ignore_stop_signals()
    follower = Follower(loaded, channel)
    watch_follower(channel, timeout())
    if on_ready is not None:
        on_ready()
    while True:
        try:
            command, args = _decode(channel.receive())
        except GroupLost:
            log.exception("rank %d: lost rank 0", channel.rank)
            return 1
        except ProtocolError:
            log.exception("rank %d: out of step with rank 0", channel.rank)
            return 1
        if command is Command.CLOSE:
            BatchLane.close(loaded.lane)
            return 0
        try:
            HANDLERS[command](follower, *args)
        except (ProtocolError, GroupLost):
            log.exception("rank %d: out of step with rank 0", channel.rank)
            return 1
        except Exception:  # rank 0 saw the same error on the same command
            log.exception("rank %d: command %s failed", channel.rank, command.value)
