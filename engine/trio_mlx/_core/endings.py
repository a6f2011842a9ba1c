"""How a request ends before its work does: cancelled by its caller, or closed with
the engine.

Both are synchronous bookkeeping on the Trio thread: the arbiter hears of the
end, the step planner takes a running row out at the next step, and the
:class:`~trio_mlx._core.ledger.Ledger` ends the request (once). A running
exclusive job cannot be stopped from here: it sees the request's
``cancel_flag`` (a serial generation stops within a token).
"""

from __future__ import annotations

import outcome

from trio_mlx._core.arbiter import Arbiter, Outcome, State
from trio_mlx._core.gate import LaneName
from trio_mlx._core.ledger import Ledger
from trio_mlx._core.planner import StepPlanner
from trio_mlx._core.request import Ending, Phase, Request
from trio_mlx._errors import EngineClosed
from trio_mlx._lanes.output import RowEvent

__all__ = ["cancel", "close_all"]


def cancel(
    request: Request, now: float, arbiter: Arbiter, planner: StepPlanner, books: Ledger
) -> bool:
    """Withdraw a live request wherever it is; a running row leaves at the next step.

    Returns whether the request was live (False: it had ended already)."""
    if request.phase is Phase.DONE or request.id not in books:
        return False
    request.cancel_flag.set()
    if request.phase is Phase.INBOX:
        # Never reached the arbiter; the inbox skips it.
        books.end(request, Ending.CANCELLED)
    elif request.lane is LaneName.EMBED:
        if request.phase is Phase.RUNNING:
            arbiter.row_ended(request.id, Outcome.CANCELLED, now)
        else:
            arbiter.cancel_row(request.id, now)
        planner.drop_embed(request.id)
        books.end(request, Ending.CANCELLED)
    elif request.lane is LaneName.BATCH:
        if request.phase is Phase.RUNNING:
            arbiter.row_ended(request.id, Outcome.CANCELLED, now)
            planner.withdraw(request.id)
        else:
            arbiter.cancel_row(request.id, now)
            if request.inserted:
                planner.remove(request.id)
        books.end(request, Ending.CANCELLED)
    elif request.phase is Phase.PENDING:
        arbiter.cancel_job(request.id, now)
        books.end(request, Ending.CANCELLED)
    return True


def close_all(arbiter: Arbiter, books: Ledger, reason: str, now: float) -> None:
    """Close the arbiter and end every live request with :class:`~trio_mlx.EngineClosed`."""
    if arbiter.state is not State.CLOSED:
        for item_id in arbiter.close(now):
            request = books.get(item_id)
            if request is not None:
                _close(request, books, reason)
    for request in books:
        _close(request, books, reason)


def _close(request: Request, books: Ledger, reason: str) -> None:
    request.cancel_flag.set()
    error = EngineClosed(reason)
    if request.phase is Phase.INBOX:
        request.rejection = error
    request.result = outcome.Error(error)
    request.outbox.put(RowEvent(request.id, error=error))
    books.end(request, Ending.CLOSED)
