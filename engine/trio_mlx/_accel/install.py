"""The device paths' one way in: what the loader calls, before and after the model loads.

Each device path is a module of its own, switchable by a ``TRIO_MLX_*`` switch
that :class:`~trio_mlx.EngineSettings` read once (``settings.switches``):
MLX's CUDA settings (:mod:`.settings`), the CUDA memory pool (:mod:`.pool`),
sibling projections stacked into one matmul (:mod:`.fused_projections`), the
fused decode attention kernel (:mod:`.decode_attention`) and the traced decode
step (:mod:`.traced_decode`). The loader reaches them through this module only:

- :func:`prepare` before the model loads (MLX reads its settings once, and the
  pool must keep what it maps before the weights are mapped);
- :func:`install` once the model is loaded: the model patched, and the choices
  the batch lane is built with (:class:`DevicePaths`).

The CUDA warm-up drives the lane itself, so it lives with the loader
(``_start/warmup.py``): the lanes import this room, not the other way round.
Any settings object with ``switches`` and ``traced_decode`` will do (the
engine passes its :class:`~trio_mlx.EngineSettings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from trio_mlx._accel import (
    decode_attention,
    fused_projections,
    pool,
    quantized_attention,
    traced_decode,
)
from trio_mlx._accel import settings as cuda_settings

__all__ = ["DevicePaths", "DeviceSettings", "install", "on_cuda", "prepare"]


class DeviceSettings(Protocol):
    """What the device paths read of the engine's settings."""

    @property
    def switches(self) -> Mapping[str, str]: ...
    @property
    def traced_decode(self) -> bool | None: ...


@attrs.frozen
class DevicePaths:
    """The device choices the batch lane is built with."""

    #: Decode a row alone over plain caches (``TRIO_MLX_SOLO_DECODE=0``: off).
    solo_decode: bool
    #: Trace decode steps once per batch shape (see :mod:`.traced_decode`).
    traced_decode: bool


def on_cuda(cuda: bool | None = None) -> bool:
    """``cuda`` if given (the tests' override), else whether MLX's CUDA backend is available."""
    return cuda_settings.on_cuda(cuda)


def prepare(settings: DeviceSettings) -> None:
    """Before the model loads: MLX's CUDA settings chosen, the memory pool kept mapped."""
    cuda_settings.apply()  # before any attention call: MLX reads them once
    pool.keep_memory(settings.switches)  # before the model's buffers: memory stays mapped


def install(model: Any, settings: DeviceSettings, *, distributed: bool = False) -> DevicePaths:
    """Patch the loaded ``model`` with the device paths its switches allow; the lane's choices.

    ``distributed``: the model is one rank's shard; no traced decode there (every
    rank would have to trace and check alike).
    """
    switches = settings.switches
    fused_projections.install(model, switches)  # sibling projections: one matmul per group
    decode_attention.install(model, switches)  # CUDA only: the padded batch's decode attention
    quantized_attention.install(on_cuda())  # CUDA only: kv_bits attention over dequantized K/V
    traced = settings.traced_decode
    if traced is None:
        traced = traced_decode.wanted(switches, cuda=on_cuda())
    return DevicePaths(
        solo_decode=switches.get("TRIO_MLX_SOLO_DECODE", "1") != "0",
        traced_decode=traced and not distributed,
    )
