"""The engine's statistics, gathered from the parts that keep them.

:func:`engine_statistics` reads the arbiter's state and counters, the
:class:`~trio_mlx._core.ledger.Ledger`'s request and token counts, the step
planner's measurements and the worker's liveness into one frozen
:class:`~trio_mlx._core.request.EngineStatistics`. It only reads.
"""

from __future__ import annotations

from trio_mlx._core.arbiter import Arbiter
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.planner import StepPlanner
from trio_mlx._core.request import EngineStatistics
from trio_mlx._core.worker import Worker

__all__ = ["engine_statistics"]


def engine_statistics(
    arbiter: Arbiter,
    books: Ledger,
    planner: StepPlanner,
    worker: Worker,
    *,
    adapters: tuple[str, ...],
    ranks: int,
) -> EngineStatistics:
    """A frozen snapshot: arbiter state, counters, worker liveness."""
    arb = arbiter.statistics()
    return EngineStatistics(
        state=arb.state.name,
        running_rows=arb.running_rows,
        queued_rows=arb.queued_rows,
        parked_rows=arb.parked_rows,
        waiting_jobs=arb.waiting_jobs,
        running_jobs=int(arb.running_job is not None),
        worker_alive=worker.alive,
        worker_busy_seconds=worker.busy_seconds,
        batch_rows=books.batch_rows,
        adapters=adapters,
        requests=books.requests(),
        prompt_tokens=books.tokens("prompt"),
        cached_prompt_tokens=books.tokens("cached"),
        generated_tokens=books.tokens("generated"),
        drains=arb.drains,
        preemptions=arb.preemptions,
        steps=arb.steps,
        arbiter=arb,
        ranks=ranks,
        admissions=planner.admissions,
        prefill_chunk=planner.last_chunk,
        decode_step_seconds=planner.decode_seconds,
        prompt_token_seconds=planner.token_seconds,
        adapter_requests=books.adapter_requests(),
        adapter_rows=books.adapter_rows(),
        kv_memory_budget=arb.kv_bytes_budget or 0,
        kv_memory_reserved=arb.kv_bytes_reserved,
        embedding_inputs=books.tokens("embedding_inputs"),
        embedding_tokens=books.tokens("embedding"),
    )
