"""Distributed mode for a program started by ``mlx.launch`` (experimental).

Rank 0 runs :func:`trio_mlx.open_engine` as usual: under ``mlx.launch`` it loads
its shard and mirrors its MLX calls to the other ranks by itself. Every other
rank runs :func:`follow` instead (no engine, no HTTP)::

    if trio_mlx.distributed.follower_rank() is not None:
        status = trio_mlx.distributed.follow(model)
    else:
        status = trio.run(serve, model)
    os._exit(trio_mlx.distributed.exit_status(status))

:func:`exit_status` keeps a rank that gave its group up (a peer died or hung)
from reporting success. How it works: ``design/engine.md`` and
``design/distributed.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from trio_mlx._dist import follower
from trio_mlx._dist.leader import exit_status, follower_rank, launched
from trio_mlx._start.loading import load, resolve_model
from trio_mlx._start.settings import EngineSettings

__all__ = ["exit_status", "follow", "follower_rank", "launched"]


def follow(
    model: str | os.PathLike[str] | None,
    *,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Run a follower rank until rank 0 closes its lane; returns an exit status.

    Loads the same shard layout as rank 0 (rank 0's settings arrive over the
    channel first), then executes rank 0's commands in order.
    """
    loaded = load(resolve_model(model), EngineSettings(), distributed=True)
    assert loaded.channel is not None
    return follower.serve(loaded, loaded.channel, on_ready=on_ready)
