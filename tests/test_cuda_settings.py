"""The MLX CUDA settings the engine chooses: only on CUDA, never over the user's own."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from trio_mlx._accel import settings as _cuda_settings

SERVER = {"MLX_CUDA_USE_CUDNN_SDPA": "0", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}


def test_cuda_gets_cudnn_attention_and_the_thrashing_check_off_when_unset() -> None:
    """On CUDA, unset variables get the engine's values: no plans per shape, no fatal misses."""
    environ: dict[str, str] = {"PATH": "/bin"}
    chosen = _cuda_settings.apply(environ, cuda=True)
    assert chosen == SERVER
    assert environ == {"PATH": "/bin", **SERVER}


@pytest.mark.parametrize("name", sorted(SERVER))
@pytest.mark.parametrize("value", ["1", "0", ""])
def test_a_value_the_user_set_is_kept(name: str, value: str) -> None:
    """Exporting a variable (even empty) wins over the engine's default; the other is set."""
    environ = {name: value}
    chosen = _cuda_settings.apply(environ, cuda=True)
    assert chosen == {k: v for k, v in SERVER.items() if k != name}
    assert environ == {**SERVER, name: value}


def test_other_backends_are_left_alone() -> None:
    """On the CPU or Metal nothing is set: the variables mean nothing there."""
    environ: dict[str, str] = {}
    assert _cuda_settings.apply(environ, cuda=False) == {}
    assert environ == {}


def test_this_machines_backend_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``cuda=``, MLX says whether its CUDA backend is there; ``os.environ`` is the target."""
    # setenv first records the variable's state, so teardown undoes what apply() sets.
    for name in SERVER:
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    chosen = _cuda_settings.apply()
    if mx.cuda.is_available():
        assert chosen == SERVER
        assert all(os.environ[name] == value for name, value in SERVER.items())
    else:
        assert chosen == {}
        assert not set(SERVER) & set(os.environ)
