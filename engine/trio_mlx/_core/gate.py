"""Which lane runs a request: the continuous batch, or alone (pure, no I/O)."""

from __future__ import annotations

import enum

import attrs

from trio_mlx._params import SamplingParams

__all__ = ["Lane", "LaneName", "choose_lane"]


class LaneName(enum.StrEnum):
    """Where a request runs; the value is the ``/metrics`` label and statistics key part."""

    BATCH = "batch"
    SERIAL = "serial"
    #: An exclusive job (mount, unmount): not a generation, never chosen by the gate.
    JOB = "job"
    #: An embedding request: a row of the batch that only prefills (never chosen by the gate).
    EMBED = "embed"


@attrs.frozen
class Lane:
    """A lane decision: batch or serial, and why a request cannot batch."""

    name: LaneName
    reason: str | None = None

    @property
    def batch(self) -> bool:
        """Whether the request joins the continuous batch."""
        return self.name is LaneName.BATCH


BATCH = Lane(LaneName.BATCH)


def choose_lane(
    params: SamplingParams,
    *,
    max_batch: int,
    caches_merge: bool,
    adapter_reason: str | None = None,
) -> Lane:
    """Batch everything mlx-lm's ``BatchGenerator`` can batch per row; the rest runs alone.

    ``caches_merge`` is mlx-lm's test: every cache of ``make_prompt_cache(model)``
    has ``merge``. ``adapter_reason`` says why the mounted adapter that
    ``params.adapter`` names cannot batch (None: it is a plain LoRA adapter the
    batch stacks, see :mod:`trio_mlx._adapters.multilora`).
    """
    if max_batch <= 1:
        return Lane(LaneName.SERIAL, "max_batch=1")
    if not caches_merge:
        return Lane(LaneName.SERIAL, "the model's caches cannot merge into a batch")
    if params.seed is not None:
        return Lane(LaneName.SERIAL, "seed")
    if params.kv_bits is not None:
        return Lane(LaneName.SERIAL, "kv_bits")
    if params.adapter is not None and adapter_reason is not None:
        return Lane(LaneName.SERIAL, f"adapter: {adapter_reason}")
    return BATCH
