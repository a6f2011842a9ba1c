"""A draft model's drafts for every speculating row at once: one forward a draft step.

:class:`DraftBatch` keeps one cache for all of the lane's draft-model rows: per layer a
buffer of columns, and per row the columns that hold its tokens (``valid``). A draft of
K tokens for B rows is K batched forwards, not B x K one-row ones (each of those was a
whole host-bound step on a GPU).

Rows differ in what they feed: a row that took every draft feeds the last one with its
pending token, a row that skipped steps (paused, not eligible, a plain step) feeds the
tokens it made meanwhile. One forward takes them all, right-aligned: a shorter row's left
columns are padding it never attends to. A rejected draft's column is marked invalid
rather than cut out, so nothing is copied per step; each row's positions are its own
count of tokens (the rotary offset is per row). When the holes outgrow the tokens the
buffer is squeezed (each row's valid columns gathered right-aligned). A row that joins,
started over or fell far behind is prefilled alone in a plain cache and inserted.

Drafts only decide what the target verifies, never what it emits: a draft that a bug
made wrong would be rejected, at a cost in speed only. Every call runs on the MLX
thread; nothing here reads an array back (the step's one evaluation does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CATCH_UP", "DraftBatch"]

#: A row this many tokens further behind than the least behind row catches up alone (a
#: plain cache, prefill chunks) rather than widening every row's forward.
CATCH_UP = 32
#: Columns the buffer grows by.
STEP = 256
#: Tokens a lone catch-up feeds per forward.
CHUNK = 512


class _Layer:
    """One layer's keys and values for every row, in the calls mlx-lm's attention
    makes of a cache: the rotary offset, the update, the mask."""

    __slots__ = ("batch", "keys", "values")

    def __init__(self, batch: DraftBatch) -> None:
        self.batch = batch
        self.keys: Any = None
        self.values: Any = None

    @property
    def offset(self) -> Any:
        return self.batch.positions

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        start = self.batch.idx
        end = start + keys.shape[2]
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.batch.mask

    @property
    def state(self) -> tuple[Any, Any]:
        return self.keys, self.values


class DraftBatch:
    """The draft model's cache for the lane's rows (uids), and their drafts."""

    def __init__(self, model: Any) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.layers = [_Layer(self) for _ in make_prompt_cache(model)]
        #: The rows, in the buffer's order, and the tokens each one's columns hold.
        self.uids: list[int] = []
        self.fed: list[int] = []
        #: ``(rows, capacity)`` booleans: which columns hold a row's tokens; None while
        #: every row holds exactly the columns up to ``idx`` (one row, or rows that
        #: took as many drafts): then a forward needs no mask and one offset.
        self.valid: Any = None
        #: Columns in use, and allocated.
        self.idx = 0
        self.capacity = 0
        #: The running forward's per-row rotary offsets and attention mask.
        self.positions: Any = None
        self.mask: Any = None
        #: The last draft's tokens in the target's row order, ``(rows, length)``.
        self.block: Any = None
        #: The last draft: its length, and the rows that drafted.
        self._length = 0
        self._drafted: set[int] = set()

    def draft(
        self, rows: int, members: Sequence[tuple[int, int, Sequence[int], int]], pending: Any
    ) -> list[Any]:
        """Drafts for a step of ``rows`` target rows. ``members``: (the target row, its
        uid, its tokens before the pending one, how many drafts it takes: 0 feeds it
        only) for every draft-model row; ``pending``: the batch's lazy pending tokens.
        Returns, per target row, a lazy array of its drafts, or ``[]``."""
        import mlx.core as mx

        length = max(limit for *_, limit in members)
        out: list[Any] = [[] for _ in range(rows)]
        self._drafted = set()
        self._length = 0
        self.block = None
        if length <= 0:
            return out
        self._admit(members)
        where = {uid: i for i, uid in enumerate(self.uids)}
        order = [0] * len(self.uids)
        known: list[Sequence[int]] = [()] * len(self.uids)
        for e, uid, history, _ in members:
            i = where[uid]
            order[i] = e
            known[i] = history[self.fed[i] :]
        while max(map(len, known)) > CHUNK:  # rows far behind together: chunks first
            longest = max(map(len, known))
            takes = [max(0, len(k) - (longest - CHUNK)) for k in known]
            pads = [CHUNK - t for t in takes]
            chunk = [[0] * p + list(k[:t]) for p, k, t in zip(pads, known, takes, strict=True)]
            self._forward(mx.array(chunk, dtype=pending.dtype), pads)
            self.fed = [f + t for f, t in zip(self.fed, takes, strict=True)]
            known = [k[t:] for k, t in zip(known, takes, strict=True)]
        width = 1 + max(map(len, known))
        pads = [width - 1 - len(k) for k in known]
        head = mx.array(
            [[0] * p + list(k) for p, k in zip(pads, known, strict=True)], dtype=pending.dtype
        )
        tail = mx.take(pending, mx.array(order))[:, None]
        inputs = mx.concatenate([head, tail], axis=1) if width > 1 else tail
        logits = self._forward(inputs, pads)
        for i, k in enumerate(known):
            self.fed[i] += len(k) + 1
        out_steps = [mx.argmax(logits, axis=-1).astype(pending.dtype)]
        while len(out_steps) < length:
            logits = self._forward(out_steps[-1][:, None], [0] * len(self.uids))
            self.fed = [f + 1 for f in self.fed]
            out_steps.append(mx.argmax(logits, axis=-1).astype(pending.dtype))
        drafts = mx.stack(out_steps, axis=1)
        self._length = length
        self._drafted = set(where)
        for e, uid, _, limit in members:
            if limit > 0:
                out[e] = drafts[where[uid], :limit]
        # Every target row's drafts in one array (zeros for rows without), so the
        # verification's input is one concatenation, not one per row.
        rows_of = [len(self.uids)] * rows
        for e, uid, _, _ in members:
            rows_of[e] = where[uid]
        padded = mx.concatenate([drafts, mx.zeros((1, length), drafts.dtype)])
        self.block = mx.take(padded, mx.array(rows_of), axis=0)
        return out

    def settle(self, taken: Mapping[int, int]) -> None:
        """The target took ``taken[uid]`` of the last drafts of each row (absent: none):
        the columns of the drafts it did not take are let go."""
        import mlx.core as mx

        fed_drafts = self._length - 1
        if fed_drafts <= 0 or not self._drafted:
            return
        drop = [
            fed_drafts - min(taken.get(uid, 0), fed_drafts) if uid in self._drafted else 0
            for uid in self.uids
        ]
        self._drafted, self._length = set(), 0
        self.fed = [f - d for f, d in zip(self.fed, drop, strict=True)]
        cut = min(drop)
        self.idx -= cut
        extra = [d - cut for d in drop]
        span = max(extra)
        if span:
            valid = self._dense()
            start = self.idx - span
            keep = mx.arange(span)[None, :] < mx.array([span - x for x in extra])[:, None]
            valid[:, start : self.idx] = valid[:, start : self.idx] & keep
        if self.idx > 2 * max(self.fed) + STEP:
            self._squeeze()

    def part(self, uid: int) -> None:
        """Row ``uid`` left the lane: its columns go."""
        if uid in self.uids:
            self._keep([i for i, u in enumerate(self.uids) if u != uid])

    # -- the buffer --------------------------------------------------------------------

    def _forward(self, inputs: Any, pads: Sequence[int]) -> Any:
        """Run ``inputs`` (rows, width), right-aligned after each row's ``pads``, through
        the model into the buffer; the logits at the last column."""
        import mlx.core as mx

        width = inputs.shape[1]
        self._reserve(width)
        start = self.idx
        end = start + width
        if self.valid is None and not any(pads):
            self.positions = start
            self.mask = None if width == 1 else "causal"
        else:
            valid = self._dense()
            pad = mx.array(list(pads))
            valid[:, start:end] = mx.arange(width)[None, :] >= pad[:, None]
            self.positions = mx.array(list(self.fed)) - pad
            causal = mx.arange(end)[None, :] <= (start + mx.arange(width))[:, None]
            self.mask = valid[:, None, None, :end] & causal[None, None]
        logits = self.model(inputs, cache=self.layers)[:, -1, :]
        self.idx = end
        self.positions = self.mask = None
        return logits

    def _dense(self) -> Any:
        """``valid`` as an array (made from the rows' lengths where it was implicit)."""
        import mlx.core as mx

        if self.valid is None:
            held = mx.arange(self.capacity)[None, :] < self.idx
            self.valid = held & mx.ones((len(self.uids), 1), mx.bool_)
        return self.valid

    def _reserve(self, width: int) -> None:
        """Room for ``width`` more columns."""
        if self.idx + width <= self.capacity:
            return
        self._pad(max(STEP, self.idx + width - self.capacity), left=False)

    def _pad(self, more: int, *, left: bool) -> None:
        """``more`` empty columns on the buffer's left (every row moves right) or right."""
        import mlx.core as mx

        for layer in self.layers:
            for name in ("keys", "values"):
                buffer = getattr(layer, name)
                b, h, _, d = buffer.shape
                room = mx.zeros((b, h, more, d), buffer.dtype)
                setattr(
                    layer, name, mx.concatenate([room, buffer] if left else [buffer, room], axis=2)
                )
        if left or self.valid is not None:
            valid = self._dense()
            empty = mx.zeros((len(self.uids), more), mx.bool_)
            self.valid = mx.concatenate([empty, valid] if left else [valid, empty], axis=1)
        self.capacity += more

    def _admit(self, members: Sequence[tuple[int, int, Sequence[int], int]]) -> None:
        """The buffer holds exactly ``members``' rows: others leave; new and restarted
        rows come in, and so do rows more than :data:`CATCH_UP` tokens further behind
        than the least behind (rows behind together catch up together)."""
        wanted = {uid: history for _, uid, history, _ in members}
        self._keep([i for i, uid in enumerate(self.uids) if uid in wanted])
        behind = {
            uid: len(wanted[uid]) - fed
            for uid, fed in zip(self.uids, self.fed, strict=True)
            if fed <= len(wanted[uid])
        }
        floor = min(behind.values(), default=0)
        alone: dict[int, list[Any] | None] = {}
        for at, uid in enumerate(self.uids):
            if uid not in behind:  # started over
                alone[uid] = None
            elif behind[uid] > floor + CATCH_UP:
                alone[uid] = self._row(at)
        alone.update((uid, None) for uid in wanted if uid not in self.uids)
        if alone:
            self._keep([i for i, uid in enumerate(self.uids) if uid not in alone])
        for uid, caches in alone.items():
            history = wanted[uid]
            self._insert(uid, self._prefill(history, caches), len(history))

    def _row(self, at: int) -> list[Any]:
        """Row ``at``'s tokens as plain mlx-lm caches (its valid columns, in order)."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        fed = self.fed[at]
        picked = mx.arange(self.idx)
        if self.valid is not None:
            rank = mx.where(self.valid[at, : self.idx], picked, -1)
            picked = mx.argsort(rank)[self.idx - fed :]
        caches = []
        for layer in self.layers:
            cache = KVCache()  # type: ignore[no-untyped-call]
            keys = mx.take(layer.keys[at : at + 1, :, : self.idx], picked, axis=2)
            values = mx.take(layer.values[at : at + 1, :, : self.idx], picked, axis=2)
            cache.update_and_fetch(keys, values)  # type: ignore[no-untyped-call]
            caches.append(cache)
        return caches

    def _prefill(self, history: Sequence[int], caches: list[Any] | None) -> list[Any]:
        """Plain caches holding ``history``: ``caches`` (its first tokens) fed the rest."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        if caches is None:
            caches = make_prompt_cache(self.model)
        at = caches[0].offset
        while at < len(history):
            chunk = mx.array([list(history[at : at + CHUNK])])
            self.model(chunk, cache=caches)
            at += chunk.shape[1]
        return caches

    def _insert(self, uid: int, caches: list[Any], count: int) -> None:
        """Add a row whose ``count`` tokens ``caches`` hold, its columns ending at ``idx``."""
        import mlx.core as mx

        if not self.uids:
            self.idx = count
            self.capacity = count + STEP
            for layer, cache in zip(self.layers, caches, strict=True):
                for name in ("keys", "values"):
                    part = getattr(cache, name)[..., :count, :]
                    b, h, _, d = part.shape
                    room = mx.zeros((b, h, STEP, d), part.dtype)
                    setattr(layer, name, mx.concatenate([part, room], axis=2))
            self.valid = None
            self.uids, self.fed = [uid], [count]
            return
        if count > self.idx:  # every row moves right to make room on the left
            more = count - self.idx
            self._pad(more, left=True)
            self.idx += more
        start = self.idx - count
        for layer, cache in zip(self.layers, caches, strict=True):
            for name in ("keys", "values"):
                buffer = getattr(layer, name)
                part = getattr(cache, name)[..., :count, :]
                _, h, _, d = buffer.shape
                row = mx.concatenate(
                    [
                        mx.zeros((1, h, start, d), buffer.dtype),
                        part.astype(buffer.dtype),
                        mx.zeros((1, h, self.capacity - self.idx, d), buffer.dtype),
                    ],
                    axis=2,
                )
                setattr(layer, name, mx.concatenate([buffer, row], axis=0))
        if start or self.valid is not None:
            columns = mx.arange(self.capacity)[None, :]
            row_valid = (columns >= start) & (columns < self.idx)
            self.valid = mx.concatenate([self._dense(), row_valid], axis=0)
        self.uids.append(uid)
        self.fed.append(count)

    def _keep(self, rows: Sequence[int]) -> None:
        """Only rows ``rows`` (indices, in order) stay."""
        import mlx.core as mx

        if len(rows) == len(self.uids):
            return
        if not rows:
            for layer in self.layers:
                layer.keys = layer.values = None
            self.valid, self.idx, self.capacity = None, 0, 0
            self.uids, self.fed = [], []
            return
        index = mx.array(list(rows))
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        if self.valid is not None:
            self.valid = self.valid[index]
        self.uids = [self.uids[i] for i in rows]
        self.fed = [self.fed[i] for i in rows]

    def _squeeze(self) -> None:
        """Gather each row's valid columns, right-aligned: the holes go."""
        import mlx.core as mx

        if not self.uids:
            return
        if self.valid is None:
            return
        longest = max(self.fed)
        columns = mx.arange(self.idx)
        rank = mx.where(self.valid[:, : self.idx], columns[None, :], -1)
        picked = mx.argsort(rank, axis=1)[:, self.idx - longest :]
        index = picked[:, None, :, None]
        for layer in self.layers:
            for name in ("keys", "values"):
                used = getattr(layer, name)[..., : self.idx, :]
                b, h, _, d = used.shape
                gathered = mx.take_along_axis(
                    used, mx.broadcast_to(index, (b, h, longest, d)), axis=2
                )
                room = mx.zeros((b, h, STEP, d), used.dtype)
                setattr(layer, name, mx.concatenate([gathered, room], axis=2))
        self.idx, self.capacity = longest, longest + STEP
        columns = mx.arange(self.capacity)[None, :]
        starts = mx.array([longest - f for f in self.fed])[:, None]
        full = all(f == longest for f in self.fed)
        self.valid = None if full else (columns >= starts) & (columns < longest)
