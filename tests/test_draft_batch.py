"""The draft model's batched drafts equal each row's greedy drafts computed alone.

:class:`DraftBatch` drafts for every row in one forward a draft step, with rows
feeding different numbers of tokens, rejected drafts left as masked holes, rows
joining, leaving, starting over and falling far behind, and the buffer growing and
being squeezed. Whatever it does to its buffer, a row's drafts must be what the
draft model says greedily after the row's tokens alone; this checks that over a
seeded random schedule of all of those events.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest


def _alone(model: Any, tokens: list[int], count: int) -> list[int]:
    """``count`` greedy tokens after ``tokens``, from a fresh plain cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    out: list[int] = []
    while True:
        out.append(int(mx.argmax(logits, axis=-1).item()))
        if len(out) == count:
            return out
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1, :]


@pytest.mark.parametrize(("seed", "first_rows"), [(0, 4), (1, 4), (2, 1)])
def test_batched_drafts_equal_each_rows_drafts_alone(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, first_rows: int
) -> None:
    import mlx.core as mx
    from mlx_lm import load

    from trio_mlx._lanes import draft_batch
    from trio_mlx._lanes.draft_batch import CATCH_UP, DraftBatch

    # A small growth step: the buffer grows and is squeezed within a few steps.
    monkeypatch.setattr(draft_batch, "STEP", 8)
    # Short catch-up chunks: rows far behind together feed in several forwards.
    monkeypatch.setattr(draft_batch, "CHUNK", 16)
    # Counted: a far-behind row taken out to catch up alone, the buffer squeezed.
    calls: list[str] = []
    for name in ("_squeeze", "_row"):
        real = getattr(DraftBatch, name)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(DraftBatch, name, counted)
    model = load(str(tiny_model_path))[0]
    rng = random.Random(seed)
    vocab = 200
    batch = DraftBatch(model)
    rows: dict[int, list[int]] = {
        uid: [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))]
        for uid in range(first_rows)
    }
    next_uid = first_rows
    drafted = 0
    # Every kind of event, in a shuffled order each cycle of eight steps.
    kinds = ["leave", "join", "restart", "squeeze", "one behind", "all behind", "", ""]
    schedule = []
    for _ in range(4):
        rng.shuffle(kinds)
        schedule.extend(kinds)
    for step, kind in enumerate(schedule):
        if kind == "leave" and len(rows) > 1:
            uid = rng.choice(sorted(rows))
            del rows[uid]
            batch.part(uid)
        elif kind == "join":
            rows[next_uid] = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 70))]
            next_uid += 1
        elif kind == "restart":  # a shorter history under the same uid
            uid = rng.choice(sorted(rows))
            rows[uid] = rows[uid][: max(1, len(rows[uid]) // 2)]
        elif kind == "squeeze":  # as the batch does when the holes outgrow the tokens
            batch._squeeze()
        elif kind == "one behind":  # plain steps: one row far behind, the others a little
            for uid, history in rows.items():
                grow = CATCH_UP + 10 if uid == min(rows) else rng.randrange(0, 4)
                history.extend(rng.randrange(3, vocab) for _ in range(grow))
        elif kind == "all behind":  # many plain steps: every row far behind, together
            for history in rows.values():
                grow = CATCH_UP + rng.randrange(5, 30)
                history.extend(rng.randrange(3, vocab) for _ in range(grow))
        uids = sorted(rows)
        rng.shuffle(uids)  # the target's order is not the buffer's
        pending_tokens = [rng.randrange(3, vocab) for _ in uids]
        limits = [rng.choice([0, 1, 2, 3, 4]) for _ in uids]
        if not any(limits):
            limits[0] = 4
        members = [(e, uid, list(rows[uid]), limits[e]) for e, uid in enumerate(uids)]
        pending = mx.array(pending_tokens, dtype=mx.uint32)
        drafts = batch.draft(len(uids), members, pending)
        taken: dict[int, int] = {}
        for e, uid in enumerate(uids):
            history = rows[uid]
            if limits[e] == 0:
                assert drafts[e] == []
                taken[uid] = 0
                history.append(pending_tokens[e])
                continue
            got = drafts[e].tolist()
            want = _alone(model, [*history, pending_tokens[e]], limits[e])
            assert got == want, (seed, step, uid)
            drafted += 1
            # The target takes a random prefix of the drafts, as a verification would.
            n = rng.randrange(0, limits[e] + 1)
            taken[uid] = n
            history.append(pending_tokens[e])
            history.extend(got[:n])
        batch.settle(taken)
        assert sorted(batch.uids) == sorted(rows)
    assert drafted > 24
    assert "_squeeze" in calls
    assert "_row" in calls
