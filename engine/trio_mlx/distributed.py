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

from trio_mlx._dist.follower import follow
from trio_mlx._dist.leader import exit_status, follower_rank, launched

__all__ = ["exit_status", "follow", "follower_rank", "launched"]
