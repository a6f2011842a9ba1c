"""Which lane runs a request: the continuous batch, or alone (pure, no I/O)."""

from __future__ import annotations

import attrs

from trio_mlx._params import SamplingParams

__all__ = ["Lane", "choose_lane"]


@attrs.frozen
class Lane:
    """A lane decision: ``"batch"`` or ``"serial"``, and why a request cannot batch."""

    name: str
    reason: str | None = None

    @property
    def batch(self) -> bool:
        """Whether the request joins the continuous batch."""
        return self.name == "batch"


BATCH = Lane("batch")


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
    batch stacks, see :mod:`trio_mlx._multilora`).
    """
    if max_batch <= 1:
        return Lane("serial", "max_batch=1")
    if not caches_merge:
        return Lane("serial", "the model's caches cannot merge into a batch")
    if params.seed is not None:
        return Lane("serial", "seed")
    if params.kv_bits is not None:
        return Lane("serial", "kv_bits")
    if params.adapter is not None and adapter_reason is not None:
        return Lane("serial", f"adapter: {adapter_reason}")
    return BATCH
