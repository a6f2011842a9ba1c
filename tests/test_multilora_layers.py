"""The stacked multi-LoRA layer: every method equals each row's own LoRALinear."""

from __future__ import annotations

from typing import Any

import pytest

from trio_mlx._adapters.multilora import METHODS, AdapterLayers, AdapterStack, RowPlan


def test_a_row_plan_sorts_adapted_rows_by_slot_and_puts_them_back() -> None:
    plan = RowPlan.build([0, 2, 1, 2, 0])
    assert plan.order.tolist() == [2, 1, 3]  # slot 1's row, then slot 2's, base rows left out
    assert plan.sorted_ids.tolist() == [1, 2, 2]
    assert plan.groups == ((1, 0, 1), (2, 1, 3))
    # Base rows take the zero row appended after the adapted ones (index 3).
    assert plan.restore.tolist() == [3, 1, 0, 2, 3]
    in_order = RowPlan.build([1, 1, 2])
    assert in_order.order is None
    assert in_order.restore is None


class _Net:
    """A model-shaped holder of two linear layers, as ``named_modules`` and the stack see it."""

    def __init__(self) -> None:
        import mlx.nn as nn

        class Net(nn.Module):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.layers = [nn.Linear(16, 12, bias=False), nn.Linear(16, 6, bias=True)]

        self.module = Net()


def _lora(seed: int, rank: int, layers: list[int], scale: float) -> AdapterLayers:
    import mlx.core as mx

    mx.random.seed(seed)
    dims = {0: (16, 12), 1: (16, 6)}
    return AdapterLayers(
        {
            f"layers.{i}": (
                mx.random.normal((dims[i][0], rank)),
                mx.random.normal((rank, dims[i][1])),
                scale,
            )
            for i in layers
        }
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("length", [1, 5])  # a decode step, a prefill chunk
def test_every_method_adds_each_rows_own_adapter(method: str, length: int) -> None:
    import mlx.core as mx
    from mlx_lm.tuner.lora import LoRALinear

    net = _Net().module
    # Ranks 4 and 2; the second adapter leaves layer 0 alone, the third layer 1.
    adapters = [
        ("a", 1, _lora(1, 4, [0, 1], 2.0)),
        ("b", 2, _lora(2, 2, [1], 0.5)),
        ("c", 3, _lora(3, 4, [0], 3.0)),
    ]
    stack = AdapterStack.build(net, adapters, method)
    slots = [0, 2, 1, 3, 2, 0, 1]
    x = mx.random.normal((len(slots), length, 16), key=mx.random.key(7))

    def expected(layer: int) -> Any:
        base = net.layers[layer]
        rows = []
        for i, slot in enumerate(slots):
            entry = adapters[slot - 1][2].layers.get(f"layers.{layer}") if slot else None
            if entry is None:
                rows.append(base(x[i : i + 1]))
                continue
            lora = LoRALinear.from_base(base, r=entry[0].shape[1], scale=entry[2])
            lora.lora_a, lora.lora_b = entry[0], entry[1]
            rows.append(lora(x[i : i + 1]))
        return mx.concatenate(rows)

    want = [expected(0), expected(1)]
    with stack.on(net):
        assert net.layers[0] is stack.modules["layers.0"]
        stack.set_rows(slots)
        got = [net.layers[0](x), net.layers[1](x)]
        stack.set_rows([0] * len(slots))  # all base: the base layer's own output
        plain = net.layers[1](x)
    assert net.layers[0] is stack.modules["layers.0"].base  # the base modules are back
    for g, w in zip(got, want, strict=True):
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-4).item()
    assert mx.array_equal(plain, net.layers[1](x)).item()


def test_an_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        AdapterStack.build(_Net().module, [], "loop")


@pytest.mark.parametrize("method", METHODS)
def test_a_bfloat16_layer_keeps_its_dtype_with_float32_adapters(method: str) -> None:
    import mlx.core as mx

    net = _Net().module
    net.set_dtype(mx.bfloat16)
    stack = AdapterStack.build(net, [("a", 1, _lora(1, 4, [0], 2.0))], method)
    x = mx.random.normal((3, 1, 16), key=mx.random.key(3)).astype(mx.bfloat16)
    base = net.layers[0](x)
    with stack.on(net):
        stack.set_rows([1, 0, 1])
        y = net.layers[0](x)
    assert y.dtype == mx.bfloat16
    assert mx.array_equal(y[1], base[1]).item()  # the base row: the base layer's output
    assert not mx.array_equal(y[0], base[0]).item()


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["gather", "sorted"])
def test_on_cuda_the_gathering_methods_are_built_dense(method: str) -> None:
    # MLX's CUDA gather_mm faults on these shapes (examples/upstream/gather_mm_cuda.py).
    stack = AdapterStack.build(_Net().module, [("a", 1, _lora(1, 4, [0], 2.0))], method)
    assert stack.method == "dense"
