"""The CUDA pool that keeps memory mapped: on by default on CUDA, ``off``, N GiB, bad values."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest

from trio_mlx._accel import pool as _cuda_pool
from trio_mlx._errors import InvalidRequest


class RecordingDriver:
    """Stands in for libcuda (this machine has no GPU): records each call."""

    def __init__(self, devices: int) -> None:
        self.count = devices
        self.kept: list[int] = []

    def devices(self) -> int:
        return self.count

    def keep_mapped(self, device: int) -> None:
        self.kept.append(device)

    def reserved(self, device: int) -> int:
        return (3 << 30) if device in self.kept else 0


@pytest.fixture
def cache_limit() -> Iterator[None]:
    """MLX's cache limit is process-wide: restored after the test."""
    original = mx.set_cache_limit(0)
    mx.set_cache_limit(original)
    yield
    mx.set_cache_limit(original)


@pytest.mark.parametrize("value", [None, "", " ", "0"])
def test_by_default_every_device_keeps_memory_and_mlx_cache_is_bounded(
    value: str | None, cache_limit: None
) -> None:
    """Unset, empty or 0: each device's pool keeps its memory, MLX's cache is bounded, no block."""
    driver = RecordingDriver(2)
    environ = {} if value is None else {_cuda_pool.VARIABLE: value}
    mx.reset_peak_memory()
    done = _cuda_pool.keep_memory(environ, cuda=True, driver=driver)
    assert driver.kept == [0, 1]
    assert mx.get_peak_memory() < 1 << 30  # nothing mapped up front
    assert done["devices"] == 2
    assert done["reserved_gib"] == 6  # what the driver reports, summed over devices
    assert mx.set_cache_limit(_cuda_pool.MLX_CACHE_BYTES) == _cuda_pool.MLX_CACHE_BYTES


@pytest.mark.parametrize("value", ["off", "OFF", " off "])
def test_off_leaves_mlx_allocator_alone(value: str, cache_limit: None) -> None:
    """``off``: no driver call and MLX's cache limit untouched."""
    driver = RecordingDriver(2)
    assert _cuda_pool.keep_memory({_cuda_pool.VARIABLE: value}, cuda=True, driver=driver) == {}
    assert driver.kept == []
    assert mx.set_cache_limit(0) != _cuda_pool.MLX_CACHE_BYTES


def test_off_the_cuda_backend_it_does_nothing(cache_limit: None) -> None:
    """On a machine without CUDA: nothing at all, whatever the variable says."""
    driver = RecordingDriver(1)
    for environ in ({}, {_cuda_pool.VARIABLE: "4"}):
        assert _cuda_pool.keep_memory(environ, cuda=False, driver=driver) == {}
    assert driver.kept == []


@pytest.mark.parametrize("value", ["-1", "two", "1.5", "1e3", "no"])
def test_a_value_that_is_not_a_whole_number_of_gib_or_off_is_refused(value: str) -> None:
    """A typo is an InvalidRequest naming the variable, before anything is done."""
    driver = RecordingDriver(1)
    with pytest.raises(InvalidRequest, match=_cuda_pool.VARIABLE) as caught:
        _cuda_pool.keep_memory({_cuda_pool.VARIABLE: value}, cuda=True, driver=driver)
    assert caught.value.param == _cuda_pool.VARIABLE
    assert driver.kept == []


def test_n_gib_are_mapped_up_front_and_handed_past_mlx_cache(cache_limit: None) -> None:
    """``1``: a GiB is allocated, then freed past MLX's cache (into the pool on CUDA)."""
    driver = RecordingDriver(1)
    mx.reset_peak_memory()
    done = _cuda_pool.keep_memory({_cuda_pool.VARIABLE: "1"}, cuda=True, driver=driver)
    assert driver.kept == [0]
    assert mx.get_peak_memory() >= 1 << 30
    assert mx.get_cache_memory() == 0
    assert done["seconds"] >= 0
    assert mx.set_cache_limit(_cuda_pool.MLX_CACHE_BYTES) == _cuda_pool.MLX_CACHE_BYTES


class RefusingDriver(RecordingDriver):
    """Fault injection: the second device refuses the setting, as a driver error would."""

    def keep_mapped(self, device: int) -> None:
        if device == 1:
            raise RuntimeError("cuMemPoolSetAttribute failed with CUDA error 1")
        super().keep_mapped(device)


def test_a_driver_that_refuses_leaves_mlx_allocator_alone(
    cache_limit: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine still loads: a warning, nothing mapped, MLX's cache limit untouched."""
    driver = RefusingDriver(2)
    mx.reset_peak_memory()
    with caplog.at_level("WARNING", logger="trio_mlx"):
        done = _cuda_pool.keep_memory({_cuda_pool.VARIABLE: "1"}, cuda=True, driver=driver)
    assert done == {}
    assert "left to MLX" in caplog.text
    assert mx.get_peak_memory() < 1 << 30
    assert mx.set_cache_limit(0) != _cuda_pool.MLX_CACHE_BYTES


def test_requested_gib_reads_whole_numbers_and_off() -> None:
    assert _cuda_pool.requested_gib({}) == 0
    assert _cuda_pool.requested_gib({_cuda_pool.VARIABLE: " 24 "}) == 24
    assert _cuda_pool.requested_gib({_cuda_pool.VARIABLE: "off"}) is None
