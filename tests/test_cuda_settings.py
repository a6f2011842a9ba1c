"""The MLX CUDA settings the engine chooses: only on CUDA, never over the user's own."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from trio_mlx import _cuda_settings


def test_cuda_gets_cudnn_attention_off_when_unset() -> None:
    """On CUDA, an unset ``MLX_CUDA_USE_CUDNN_SDPA`` becomes ``0`` (prefill plans per shape)."""
    environ: dict[str, str] = {"PATH": "/bin"}
    chosen = _cuda_settings.apply(environ, cuda=True)
    assert chosen == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
    assert environ == {"PATH": "/bin", "MLX_CUDA_USE_CUDNN_SDPA": "0"}


@pytest.mark.parametrize("value", ["1", "0", ""])
def test_a_value_the_user_set_is_kept(value: str) -> None:
    """Exporting the variable (even empty) wins over the engine's default."""
    environ = {"MLX_CUDA_USE_CUDNN_SDPA": value}
    assert _cuda_settings.apply(environ, cuda=True) == {}
    assert environ == {"MLX_CUDA_USE_CUDNN_SDPA": value}


def test_other_backends_are_left_alone() -> None:
    """On the CPU or Metal nothing is set: the variables mean nothing there."""
    environ: dict[str, str] = {}
    assert _cuda_settings.apply(environ, cuda=False) == {}
    assert environ == {}


def test_this_machines_backend_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``cuda=``, MLX says whether its CUDA backend is there; ``os.environ`` is the target."""
    # setenv first records the variable's state, so teardown undoes what apply() sets.
    monkeypatch.setenv("MLX_CUDA_USE_CUDNN_SDPA", "placeholder")
    monkeypatch.delenv("MLX_CUDA_USE_CUDNN_SDPA")
    chosen = _cuda_settings.apply()
    if mx.cuda.is_available():
        assert chosen == {"MLX_CUDA_USE_CUDNN_SDPA": "0"}
        assert os.environ["MLX_CUDA_USE_CUDNN_SDPA"] == "0"
    else:
        assert chosen == {}
        assert "MLX_CUDA_USE_CUDNN_SDPA" not in os.environ
