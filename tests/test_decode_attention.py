"""The fused decode attention (CUDA only) against MLX's masked attention, and its gates."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_mlx._accel import decode_attention as _decode_attention


def test_install_leaves_the_model_alone_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA (this CI's CPU) the model's attention stays mlx-lm's."""
    import mlx_lm.models.llama as llama

    before = llama.scaled_dot_product_attention
    model: Any = llama.Model.__new__(llama.Model)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert _decode_attention.install(model) is False
    assert llama.scaled_dot_product_attention is before


def test_install_is_refused_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRIO_MLX_DECODE_KERNEL=0`` keeps mlx-lm's attention even where CUDA is."""
    import mlx_lm.models.llama as llama

    before = llama.scaled_dot_product_attention
    model: Any = llama.Model.__new__(llama.Model)
    monkeypatch.setenv("TRIO_MLX_DECODE_KERNEL", "0")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert _decode_attention.install(model) is False
    assert llama.scaled_dot_product_attention is before


def test_only_single_query_batch_calls_are_taken() -> None:
    """Prefill (several queries), plain caches and sinks go to mlx-lm's attention."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    batch = BatchKVCache([0, 2])
    q1 = mx.zeros((2, 8, 1, 64))
    q4 = mx.zeros((2, 8, 4, 64))
    kv = mx.zeros((2, 2, 16, 64))
    assert _decode_attention._takes(q1, kv, kv, batch, None)
    assert not _decode_attention._takes(q4, kv, kv, batch, None)
    assert not _decode_attention._takes(q1, kv, kv, KVCache(), None)
    assert not _decode_attention._takes(q1, kv, kv, batch, mx.zeros((8,)))
    assert not _decode_attention._takes(mx.zeros((2, 8, 1, 80)), kv, kv, batch, None)
    # 32 query heads per KV head at dim 64: 64 registers of query and sum per lane, too many.
    assert not _decode_attention._takes(mx.zeros((2, 64, 1, 64)), kv, kv, batch, None)
    assert _decode_attention._takes(mx.zeros((2, 32, 1, 64)), kv, kv, batch, None)


def test_warps_fill_few_blocks_and_fit_shared_memory() -> None:
    """Few (row, KV head) blocks get more warps; a block's merge buffers fit in 48 KiB."""
    assert _decode_attention._warps(blocks=64, group=4, dim=64) == 16
    assert _decode_attention._warps(blocks=512, group=4, dim=64) == 8
    for group in (1, 2, 4, 8, 16):
        for dim in (32, 64, 128, 256):
            most = _decode_attention._max_warps(group, dim)
            assert most * group * (dim + 2) * 4 <= 48 * 1024
            for blocks in (1, 255, 256, 4096):
                warps = _decode_attention._warps(blocks, group, dim)
                assert 1 <= warps <= most  # the merge buffers are sized for ``most``


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on CUDA only")
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    kv_heads=st.sampled_from([1, 2, 8]),
    group=st.sampled_from([1, 4, 8]),
    dim=st.sampled_from([64, 128]),
    length=st.integers(1, 600),
    spare=st.integers(0, 300),
    warps=st.sampled_from([None, 1, 4, 8, 16]),
    stopped=st.booleans(),
    data=st.data(),
)
def test_kernel_equals_masked_attention(
    rows: int,
    kv_heads: int,
    group: int,
    dim: int,
    length: int,
    spare: int,
    warps: int | None,
    stopped: bool,
    data: st.DataObject,
) -> None:
    """Each row attends to its keys from its left padding on, as MLX's masked call does.

    The keys and values are views of a longer buffer, as the cache passes them,
    and the warps that split a row's keys range from one to sixteen. With
    ``stopped`` the kernel gets the whole buffer and a ``stop`` at ``length``
    (the traced decode step's call), which must read as the view does.
    """
    start = mx.array(data.draw(st.lists(st.integers(0, length - 1), min_size=rows, max_size=rows)))
    q = mx.random.normal((rows, kv_heads * group, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows, kv_heads, length + spare, dim)).astype(mx.bfloat16)
    v = mx.random.normal((rows, kv_heads, length + spare, dim)).astype(mx.bfloat16)
    buffer_k, buffer_v = k, v
    k, v = k[..., :length, :], v[..., :length, :]
    mask = (mx.arange(length)[None] >= start[:, None])[:, None, None, :]
    scale = dim**-0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    _decode_attention.WARPS = warps
    try:
        if stopped:
            stop = mx.array([length], dtype=mx.int32)
            got = _decode_attention.decode_attention(q, buffer_k, buffer_v, start, scale, stop=stop)
        else:
            got = _decode_attention.decode_attention(q, k, v, start, scale)
    finally:
        _decode_attention.WARPS = None
    assert mx.allclose(got, want, atol=3e-2, rtol=3e-2).item()


def _masked(
    q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float, stop: Any = None
) -> mx.array:
    positions = mx.arange(k.shape[2])[None]
    mask = positions >= start[:, None]
    if stop is not None:
        mask = mask & (positions < stop)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask[:, None, None, :])


def _installed(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> tuple[Any, list[tuple[int, bool]]]:
    """mlx-lm llama's attention with the wrapper installed around a stand-in ``kernel``."""
    import mlx_lm.models.llama as llama

    calls: list[tuple[int, bool]] = []  # (rows, whether a stop was passed) per call

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append((args[0].shape[0], len(args) > 5 or kwargs.get("stop") is not None))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_decode_attention, "_works", lambda: True)
    monkeypatch.setattr(_decode_attention, "decode_attention", counted)
    monkeypatch.delenv("TRIO_MLX_DECODE_KERNEL", raising=False)
    assert _decode_attention.install(llama.Model.__new__(llama.Model)) is True
    return llama.scaled_dot_product_attention, calls


def _decode_call() -> tuple[mx.array, mx.array, mx.array, Any, mx.array]:
    from mlx_lm.models.cache import BatchKVCache

    cache = BatchKVCache([3, 0])
    q = mx.random.normal((2, 8, 1, 64))
    k = mx.random.normal((2, 2, 10, 64))
    v = mx.random.normal((2, 2, 10, 64))
    mask = (mx.arange(10)[None] >= cache.left_padding[:, None])[:, None, None, :]
    return q, k, v, cache, mask


def _answers_three_times_as_masked(
    attention: Any, q: mx.array, k: mx.array, v: mx.array, cache: Any, mask: mx.array
) -> None:
    """Three decode calls through ``attention``, each equal to MLX's masked attention."""
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    for _ in range(3):
        got = attention(q, k, v, cache=cache, scale=0.125, mask=mask)
        assert mx.allclose(got, want, atol=1e-4).item()


def test_decode_calls_go_to_the_kernel_once_it_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode call with a batch cache takes the kernel (checked against mlx-lm's at
    first, once per head shape); a prefill call stays with mlx-lm's attention."""
    attention, calls = _installed(monkeypatch, _masked)
    q, k, v, cache, mask = _decode_call()
    _answers_three_times_as_masked(attention, q, k, v, cache, mask)
    assert calls == [(2, False), (2, False), (2, False)]
    prefill = mx.random.normal((2, 8, 4, 64))
    attention(prefill, k, v, cache=cache, scale=0.125, mask="causal")
    assert len(calls) == 3  # several queries: mlx-lm's attention


def test_a_traced_steps_call_goes_to_the_kernel_with_its_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The traced decode step's cache: the kernel reads its keys up to ``stop`` only."""
    from trio_mlx._accel.traced_decode import TracedCache

    attention, calls = _installed(monkeypatch, _masked)
    q, k, v, batch, _ = _decode_call()
    idx = mx.array([6], dtype=mx.int32)  # keys 7..9 are a buffer's unwritten tail
    positions = mx.arange(10)[None]
    mask = ((positions >= batch.left_padding[:, None]) & (positions <= idx))[:, None, None, :]
    cache = TracedCache(k, v, idx, idx - batch.left_padding, batch.left_padding, mask)
    _answers_three_times_as_masked(attention, q, k, v, cache, mask)
    assert calls == [(2, True), (2, True), (2, True)]


def test_a_kernel_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose first answer differs from mlx-lm's is dropped for that shape."""
    attention, calls = _installed(
        monkeypatch, lambda q, k, v, start, scale, stop=None: mx.zeros_like(q)
    )
    _answers_three_times_as_masked(attention, *_decode_call())
    assert calls == [(2, False)]  # checked once, then mlx-lm's
