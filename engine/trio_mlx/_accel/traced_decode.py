"""A decode step traced once per batch shape by ``mx.compile`` (MLX thread only).

Theory of operation
===================

On the H200 a decode step of a 64-row batch is set by its host work, not the
GPU (busy a quarter of the time): Python builds the model's graph anew every
step, and MLX launches each of its small kernels one by one. ``mx.compile``
traces the step once and replays the graph, fusing elementwise kernels; but a
traced graph is fixed, and mlx-lm's ``BatchKVCache`` writes each step's keys at
a Python int and returns a slice that grows by one: every step would be a new
graph.

:class:`TracedDecode` runs the same model over the same ``BatchKVCache``
buffers with the positions as arrays instead: each layer's cache is a
:class:`TracedCache` whose write is ``mx.put_along_axis`` at an array index
(``mx.slice_update`` at an array index copies the whole buffer on CUDA), and
whose attention reads the whole buffer with the unwritten tail left out (the
fused decode kernel's ``stop`` on CUDA, a boolean mask elsewhere). So consecutive steps are one graph until the
batch's row count or its buffer length changes; a step the traced graph cannot
take (caches of another kind, a row mid-prefill) runs eagerly, as before.

A full buffer is grown by the traced step itself, by one cache step (256
positions) at its end, as mlx-lm's own step would grow it, and the step is
traced at the new length. It used to run eagerly, and on the H200 that one
eager step was the long-prompt stall: at 64 rows it met kernels the process
had compiled for nothing else (the fused decode attention's unstopped variant
at that row count, first of all), 1.5-2.9 s of NVRTC in one served step
(design/performance.md). A full buffer no longer makes a
step eager.

Shapes that repeat
==================

Each new (rows, buffer length) is a new trace: the model's Python runs again
and MLX compiles the graph (13-14 ms on the H200 for a new row count, against
a 4-6 ms step). mlx-lm grows a buffer in steps of 256 positions, but its
``BatchKVCache.filter`` trims the left padding every row shares, so after a
removal the length is anything; served traffic removes rows every few steps,
and nearly every removal would be a new trace. So before a traced step the
buffers are padded at their end (unused positions) to the next multiple of
the cache's step: the lengths the traced step meets are few, and a batch
decoding between removals and arrivals replays one graph. ``mx.compile`` keeps
every shape's graph for the life of the compiled function; after
:data:`MAX_SHAPES` traces a fresh one starts, so a server that meets many
shapes does not hold them all.

After the traced step the caches are what mlx-lm's own step leaves: the new
buffers, ``offset`` one further, ``_idx`` one further. So removal, joins,
parking and prefix caching see nothing different.

The traced graph holds the model's weight arrays as they were when it was
traced. An exclusive job is user code that may change them (``model.update``,
LoRA layers put on): after each one the lane compares the model's arrays with
the traced step's (:func:`weights`) and, if they differ, traces and checks
again before the next step.

It is used only where it is checked: :func:`build` compares one traced step
with mlx-lm's on a small padded batch (logits and greedy tokens) and refuses
(None) on any difference or error. The lane uses it on CUDA (:func:`wanted`;
elsewhere only when asked, ``TRIO_MLX_TRACED_DECODE=1``), and then not while
per-row adapters are on the model (their layers are swapped in for the step)
nor in distributed mode. On the CPU it rarely pays: attention
over the whole buffer costs more there than the host work it saves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_SHAPES", "TracedCache", "TracedDecode", "build", "wanted"]

logger = logging.getLogger("trio_mlx")

#: Traces kept by one compiled function before a fresh one starts (see the notes).
MAX_SHAPES = 512


class TracedCache:
    """One layer's keys and values inside a traced step: positions are arrays.

    ``idx`` (one int32) is the position written this step, ``offset`` each
    row's position for RoPE, ``left_padding`` each row's first real key,
    ``stop`` the keys' end (``idx + 1``) and ``mask`` the same as a boolean
    mask over the whole buffer, for attention that takes no ``stop``.
    """

    __slots__ = ("idx", "keys", "left_padding", "mask", "offset", "stop", "values")

    def __init__(
        self, keys: Any, values: Any, idx: Any, offset: Any, left_padding: Any, mask: Any
    ) -> None:
        self.keys, self.values, self.idx = keys, values, idx
        self.offset, self.left_padding, self.mask = offset, left_padding, mask
        self.stop = idx + 1

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        at = mx.broadcast_to(self.idx.reshape(1, 1, 1, 1), keys.shape)
        self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
        self.values = mx.put_along_axis(self.values, at, values, axis=2)
        return self.keys, self.values

    def make_mask(self, n: int, **kwargs: Any) -> Any:
        return self.mask


class TracedDecode:
    """The model's decode step over a batch's ``BatchKVCache``s, traced per shape."""

    def __init__(self, model: Any) -> None:
        import mlx.core as mx

        self.model = model
        self.layers = len(model.layers)
        #: Decode steps run traced and left to the model's own step (a full buffer,
        #: another cache kind, a failed trace).
        self.traced_steps = 0
        self.eager_steps = 0
        #: Graphs traced (one per new batch shape), buffers padded to the step and
        #: full buffers grown by a step.
        self.traces = 0
        self.padded = 0
        self.grown = 0
        #: Set once a trace failed: every later step runs eagerly.
        self.failed = False
        self._compiled = mx.compile(self._step)
        self._kept = 0  # traces held by ``_compiled``
        #: The model's arrays when traced: the graph holds these, not what the model holds later.
        self.weights = weights(model)

    def _step(self, tokens: Any, idx: Any, offset: Any, left_padding: Any, *kv: Any) -> list[Any]:
        import mlx.core as mx

        self.traces += 1  # this Python runs only while tracing
        self._kept += 1
        positions = mx.arange(kv[0].shape[2], dtype=mx.int32)[None]
        mask = (positions >= left_padding[:, None]) & (positions <= idx)
        mask = mask[:, None, None, :]
        caches = [
            TracedCache(kv[2 * i], kv[2 * i + 1], idx, offset, left_padding, mask)
            for i in range(self.layers)
        ]
        logits = self.model(tokens[:, None], cache=caches)[:, -1, :]
        return [logits, *(a for c in caches for a in (c.keys, c.values))]

    def takes(self, caches: list[Any]) -> bool:
        """Whether a traced step can run over ``caches`` (else the caller's eager step)."""
        from mlx_lm.models.cache import BatchKVCache

        if len(caches) != self.layers:
            return False
        first: Any = caches[0]
        keys: Any = getattr(first, "keys", None)
        if type(first) is not BatchKVCache or keys is None:
            return False
        if getattr(first, "_right_padding", None) is not None:
            return False  # mid-prefill
        return all(type(c) is BatchKVCache for c in caches)

    def logits(self, tokens: Any, caches: list[Any]) -> Any | None:
        """The last position's logits of one decode step; the caches moved one step on.

        ``tokens`` (rows,) are the step's inputs. None where the traced step
        does not take it (the caller runs the model's own step): where
        :meth:`takes` says no, and for good once tracing a new shape raised
        (the rows never see the failure: the caches are changed only after the
        traced call returns).
        """
        import mlx.core as mx

        if self.failed or not self.takes(caches):
            self.eager_steps += 1
            return None
        first = caches[0]
        self._pad_to_step(caches)
        if self._kept >= MAX_SHAPES:
            self._compiled, self._kept = mx.compile(self._step), 0
        idx = mx.array([first._idx], dtype=mx.int32)
        kv = [a for c in caches for a in (c.keys, c.values)]
        try:
            logits, *kv = self._compiled(tokens, idx, first.offset, first.left_padding, *kv)
        except Exception:  # tracing a new shape failed: the caches are untouched
            logger.warning("the traced decode step is off: a new shape failed", exc_info=True)
            self.failed = True
            self.eager_steps += 1
            return None
        offset = first.offset + 1
        for i, cache in enumerate(caches):
            cache.keys, cache.values = kv[2 * i], kv[2 * i + 1]
            cache.offset = offset
            cache._idx += 1
        self.traced_steps += 1
        return logits

    def summary(self) -> str:
        """What the traced step did, for the log at shutdown."""
        return (
            f"{self.traced_steps} steps traced, {self.eager_steps} eager, "
            f"{self.traces} shapes traced, {self.padded} buffers padded to the step, "
            f"{self.grown} full ones grown by a step"
        )

    def _pad_to_step(self, caches: list[Any]) -> None:
        """Pad every layer's buffers at their end to a multiple of the cache's step,
        and a full buffer (this step's key has no slot) by one step more."""
        import mlx.core as mx

        first: Any = caches[0]
        size = first.keys.shape[2]
        step = int(getattr(first, "step", 256))
        want = -(-size // step) * step
        if first._idx >= want:
            want = (first._idx // step + 1) * step
            self.grown += 1
        elif want > size:
            self.padded += 1
        if want == size:
            return
        for cache in caches:
            for name in ("keys", "values"):
                a = getattr(cache, name)
                tail = mx.zeros((*a.shape[:2], want - size, a.shape[3]), a.dtype)
                setattr(cache, name, mx.concatenate([a, tail], axis=2))


def weights(model: Any) -> tuple[int, ...]:
    """The identities of the model's parameter arrays: MLX arrays do not change in
    place, so a job that changed a weight or added a layer changed this."""
    from mlx.utils import tree_flatten

    pairs: Any = tree_flatten(model.parameters())
    return tuple(id(array) for _name, array in pairs)


def wanted(environ: Mapping[str, str], *, cuda: bool) -> bool:
    """Whether the lane should trace its decode steps: on MLX's CUDA backend unless
    ``TRIO_MLX_TRACED_DECODE=0``; elsewhere only with ``TRIO_MLX_TRACED_DECODE=1``.

    On the H200, served with both servers up and rounds alternating, the traced
    step (its buffers padded to the cache's step) read 1.13-1.31x the eager one
    in each of five rounds at 32 streams and 0.98-1.45x at 64, its GPU busier
    (design/performance.md). On the CPU it rarely pays: attention
    over the whole buffer costs more there than the host work it saves.
    """
    setting = environ.get("TRIO_MLX_TRACED_DECODE", "")
    return setting == "1" or (cuda and setting != "0")


def build(model: Any) -> TracedDecode | None:
    """A :class:`TracedDecode` for ``model`` once one traced step matched mlx-lm's; else None.

    The check: three rows with different left padding are prefilled twice, then
    one decode step runs eagerly over one copy and traced over the other; the
    logits must agree (to bfloat16's precision) and pick the same tokens. It
    also traces and compiles the step once, at load rather than at the first
    request.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    # A model with other caches (sliding window, linear attention, convolution
    # state) never batches into BatchKVCaches only: an expected case, said once.
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)} - {"KVCache"})
    if kinds:
        logger.info(
            "the traced decode step is off for this model: it traces KVCache layers only, "
            "and the model also has %s",
            ", ".join(kinds),
        )
        return None
    try:
        traced = TracedDecode(model)
        padding = [0, 2, 5]
        prompt = mx.array([[(7 * r + 3 * i) % 50 + 1 for i in range(8)] for r in range(3)])

        def filled() -> list[Any]:
            caches = [BatchKVCache(padding) for _ in range(traced.layers)]
            mx.eval(model(prompt, cache=caches))
            return caches

        step = mx.array([11, 12, 13])
        want = model(step[:, None], cache=filled())[:, -1, :].astype(mx.float32)
        caches = filled()
        if not traced.takes(caches):
            logger.info("the traced decode step is off: the model's caches are not BatchKVCaches")
            return None
        got = traced.logits(step, caches)
        if got is None:
            return None  # the trace raised: its warning said why
        got = got.astype(mx.float32)
        scale = float(mx.abs(want).max()) or 1.0
        close = bool(mx.allclose(got, want, atol=2e-2 * scale, rtol=2e-2).item())
        same = bool(mx.array_equal(mx.argmax(got, axis=-1), mx.argmax(want, axis=-1)).item())
        if not (close and same):
            logger.warning("the traced decode step is off: it did not match the model's own step")
            return None
    except Exception:  # a model whose step cannot be traced, say: the eager step as before
        logger.warning("the traced decode step is off: it failed its check", exc_info=True)
        return None
    traced.traced_steps = traced.eager_steps = traced.padded = traced.grown = 0
    logger.info(
        "decode steps are traced once per batch shape (TRIO_MLX_TRACED_DECODE=0 turns it off)"
    )
    return traced
