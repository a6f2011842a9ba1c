"""Properties of the host's residency rules: which idle model makes room, and never one
in use; a stateful run of loads, uses, releases and idle checks keeps the bounds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_mlx._host.residency import Resident, evictions, expired, fits_alone

NAMES = [f"m{i}" for i in range(6)]

residents = st.lists(
    st.builds(
        Resident,
        name=st.sampled_from(NAMES),
        weight_bytes=st.integers(0, 100),
        leases=st.integers(0, 2),
        last_used=st.floats(0, 100),
        evictable=st.booleans(),
    ),
    unique_by=lambda r: r.name,
    max_size=6,
)
bounds = st.tuples(st.none() | st.integers(1, 6), st.none() | st.integers(1, 400))


def _room(
    kept: list[Resident], incoming: int, max_models: int | None, max_bytes: int | None
) -> bool:
    count_ok = max_models is None or len(kept) + 1 <= max_models
    return count_ok and (
        max_bytes is None or sum(r.weight_bytes for r in kept) + incoming <= max_bytes
    )


@given(residents, st.integers(0, 100), bounds)
def test_evictions_choose_idle_models_least_recently_used_first_and_as_few_as_needed(
    resident: list[Resident], incoming: int, limits: tuple[int | None, int | None]
) -> None:
    max_models, max_bytes = limits
    chosen = evictions(resident, incoming, max_models=max_models, max_bytes=max_bytes)
    idle = sorted((r for r in resident if r.leases == 0 and r.evictable), key=lambda r: r.last_used)
    if chosen is None:
        # Not even unloading every idle model gives room.
        busy = [r for r in resident if r not in idle]
        assert not _room(busy, incoming, max_models, max_bytes)
        return
    by_name = {r.name: r for r in resident}
    assert all(by_name[n].leases == 0 and by_name[n].evictable for n in chosen)
    assert list(chosen) == [r.name for r in idle[: len(chosen)]]  # the LRU prefix
    kept = [r for r in resident if r.name not in chosen]
    assert _room(kept, incoming, max_models, max_bytes)
    if chosen:  # one fewer would not have been enough
        fewer = [r for r in resident if r.name not in chosen[:-1]]
        assert not _room(fewer, incoming, max_models, max_bytes)


@given(residents, st.floats(0, 200), st.none() | st.floats(0.01, 100))
def test_expired_models_are_idle_past_the_period(
    resident: list[Resident], now: float, idle_unload: float | None
) -> None:
    gone = set(expired(resident, now, idle_unload))
    for r in resident:
        due = idle_unload is not None and r.leases == 0 and r.evictable
        assert (r.name in gone) == (due and now - r.last_used >= idle_unload)  # type: ignore[operator]


class HostModel(RuleBasedStateMachine):
    """A host as the rules drive it: the loaded models, their leases and clock."""

    def __init__(self) -> None:
        super().__init__()
        self.max_models = 2
        self.max_bytes = 250
        self.sizes = {name: 40 * (i + 1) for i, name in enumerate(NAMES)}  # 40..240
        self.loaded: dict[str, Resident] = {}
        self.now = 0.0
        self.ever_evicted_in_use = False

    def _residents(self) -> list[Resident]:
        return list(self.loaded.values())

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        self.now += 1
        if name not in self.loaded:
            assert fits_alone(self.sizes[name], self.max_bytes)
            chosen = evictions(
                self._residents(),
                self.sizes[name],
                max_models=self.max_models,
                max_bytes=self.max_bytes,
            )
            if chosen is None:
                return  # the request waits
            for victim in chosen:
                self.ever_evicted_in_use |= self.loaded[victim].leases > 0
                del self.loaded[victim]
            self.loaded[name] = Resident(name, self.sizes[name], 0, self.now)
        r = self.loaded[name]
        self.loaded[name] = Resident(name, r.weight_bytes, r.leases + 1, r.last_used)

    @precondition(lambda self: any(r.leases for r in self.loaded.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.now += 1
        held = sorted(n for n, r in self.loaded.items() if r.leases)
        name = data.draw(st.sampled_from(held))
        r = self.loaded[name]
        self.loaded[name] = Resident(name, r.weight_bytes, r.leases - 1, self.now)

    @rule(seconds=st.floats(0, 10))
    def idle_check(self, seconds: float) -> None:
        self.now += seconds
        for name in expired(self._residents(), self.now, 5.0):
            self.ever_evicted_in_use |= self.loaded[name].leases > 0
            del self.loaded[name]

    @invariant()
    def bounds_hold(self) -> None:
        assert len(self.loaded) <= self.max_models
        assert sum(r.weight_bytes for r in self.loaded.values()) <= self.max_bytes

    @invariant()
    def no_model_in_use_was_unloaded(self) -> None:
        assert not self.ever_evicted_in_use


TestHostModel = HostModel.TestCase
