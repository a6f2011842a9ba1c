"""The optional CUDA pool reservation: off unless asked, bad values refused, what it does."""

from __future__ import annotations

import mlx.core as mx
import pytest

from trio_mlx import _cuda_pool
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


@pytest.mark.parametrize("value", ["", " ", "0"])
def test_unset_or_zero_does_nothing(value: str) -> None:
    """No variable, an empty one or 0: no driver call, no allocation, MLX's cache untouched."""
    driver = RecordingDriver(2)
    assert _cuda_pool.keep_memory({_cuda_pool.VARIABLE: value}, cuda=True, driver=driver) == {}
    assert _cuda_pool.keep_memory({}, cuda=True, driver=driver) == {}
    assert driver.kept == []


def test_off_the_cuda_backend_it_does_nothing() -> None:
    """Asked for on a machine without CUDA: nothing at all."""
    driver = RecordingDriver(1)
    assert _cuda_pool.keep_memory({_cuda_pool.VARIABLE: "4"}, cuda=False, driver=driver) == {}
    assert driver.kept == []


@pytest.mark.parametrize("value", ["-1", "two", "1.5", "1e3"])
def test_a_value_that_is_not_a_whole_number_of_gib_is_refused(value: str) -> None:
    """A typo is an InvalidRequest naming the variable, before anything is done."""
    driver = RecordingDriver(1)
    with pytest.raises(InvalidRequest, match=_cuda_pool.VARIABLE) as caught:
        _cuda_pool.keep_memory({_cuda_pool.VARIABLE: value}, cuda=True, driver=driver)
    assert caught.value.param == _cuda_pool.VARIABLE
    assert driver.kept == []


def test_asked_for_every_device_keeps_its_memory_and_mlx_cache_is_bounded() -> None:
    """Each device's pool is told to keep memory; MLX's cache limit becomes the module's bound."""
    original = mx.set_cache_limit(0)
    mx.set_cache_limit(original)
    driver = RecordingDriver(3)
    try:
        done = _cuda_pool.keep_memory({_cuda_pool.VARIABLE: "1"}, cuda=True, driver=driver)
    finally:
        bound = mx.set_cache_limit(original)
    assert driver.kept == [0, 1, 2]
    assert bound == _cuda_pool.MLX_CACHE_BYTES
    assert done["devices"] == 3
    assert done["reserved_gib"] == 9  # what the driver reports, summed over devices
    assert done["seconds"] >= 0
    assert mx.get_cache_memory() == 0  # the reserved blocks went past MLX's cache


def test_requested_gib_reads_whole_numbers() -> None:
    assert _cuda_pool.requested_gib({}) == 0
    assert _cuda_pool.requested_gib({_cuda_pool.VARIABLE: " 24 "}) == 24
