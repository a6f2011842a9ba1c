"""Sibling projections stacked into one matmul: same outputs, same parameters, never stale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from trio_mlx._accel import fused_projections as _fused_projections
from trio_mlx._adapters.registry import checksum

OFF = {"TRIO_MLX_FUSED_PROJECTIONS": "0"}
PROMPT = mx.array([[5, 17, 42, 99, 7, 3, 250, 11]])


def _load(path: Path, fused: bool) -> Any:
    model, _ = mlx_lm.load(str(path))
    stacked = _fused_projections.install(model, {} if fused else OFF)
    assert stacked == (2 * len(model.layers) if fused else 0)
    return model


def _logits(model: Any, prompt: Any = PROMPT, steps: int = 4) -> list[Any]:
    """Prefill, then a few greedy decode steps: every step's logits."""
    cache = make_prompt_cache(model)
    out = [model(prompt, cache=cache)[:, -1, :]]
    for _ in range(steps):
        token = mx.argmax(out[-1], axis=-1)[:, None]
        out.append(model(token, cache=cache)[:, -1, :])
    mx.eval(out)
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    """Equal up to float32 rounding: BLAS may block a wider matmul differently."""
    return all(mx.allclose(x, y, rtol=1e-4, atol=1e-4).item() for x, y in zip(a, b, strict=True))


def test_stacked_model_computes_what_the_plain_one_does(tiny_model_path: Path) -> None:
    """Every group of every layer is stacked, and prefill and decode logits are unchanged."""
    plain, fused = _load(tiny_model_path, False), _load(tiny_model_path, True)
    assert _same(_logits(plain), _logits(fused))
    layer = fused.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "FusedLinear"
    assert isinstance(layer.mlp.up_proj, nn.Linear)  # adapters and checks still see a Linear


def test_parameters_keep_their_names_shapes_and_values(tiny_model_path: Path) -> None:
    """Each member's weight is its rows of the stacked matrix: nothing new is a parameter."""
    plain, fused = _load(tiny_model_path, False), _load(tiny_model_path, True)
    before = {k: v.shape for k, v in tree_flatten(plain.parameters())}  # type: ignore[union-attr]
    after = {k: v.shape for k, v in tree_flatten(fused.parameters())}  # type: ignore[union-attr]
    assert before == after
    assert checksum(plain) == checksum(fused)


def test_a_replaced_weight_is_used_not_the_stacked_copy(tiny_model_path: Path) -> None:
    """A weight set after stacking (a load, a merge) turns its group off: no stale matmul."""
    plain, fused = _load(tiny_model_path, False), _load(tiny_model_path, True)
    for model in (plain, fused):
        attention = model.layers[0].self_attn
        attention.k_proj.weight = attention.k_proj.weight * 3.0
        mlp = model.layers[-1].mlp
        mlp.update({"up_proj": {"weight": mlp.up_proj.weight + 0.5}})
    assert _same(_logits(plain), _logits(fused))


class _Doubled(nn.Module):
    """A wrapper that computes with its layer's weight and never calls the layer (as DoRA does)."""

    def __init__(self, linear: Any) -> None:
        super().__init__()
        self.linear = linear

    def __call__(self, x: Any) -> Any:
        return 2.0 * (x @ self.linear.weight.T)


def test_a_member_behind_a_wrapper_that_skips_it_turns_the_group_off(
    tiny_model_path: Path,
) -> None:
    """Its siblings then run their own matmuls, and no stacked output is left waiting."""
    plain, fused = _load(tiny_model_path, False), _load(tiny_model_path, True)
    for model in (plain, fused):
        attention = model.layers[0].self_attn
        attention.v_proj = _Doubled(attention.v_proj)
    assert _same(_logits(plain), _logits(fused))
    group = fused.layers[0].self_attn.q_proj._fusion
    assert group.stash == {}
    assert group.stash_input is None


def test_the_stash_answers_only_for_the_same_input(tiny_model_path: Path) -> None:
    """A sibling called with another input computes afresh; taken outputs leave the stash."""
    plain, fused = _load(tiny_model_path, False), _load(tiny_model_path, True)
    x = mx.random.normal((2, 3, plain.args.hidden_size), key=mx.random.key(1))
    y = mx.random.normal((2, 3, plain.args.hidden_size), key=mx.random.key(2))
    p, f = plain.layers[0].self_attn, fused.layers[0].self_attn
    assert mx.allclose(f.q_proj(x), p.q_proj(x), atol=1e-5).item()
    assert mx.allclose(f.k_proj(y), p.k_proj(y), atol=1e-5).item()  # not x's k
    assert mx.allclose(f.v_proj(x), p.v_proj(x), atol=1e-5).item()  # x's v, from the stash
    assert mx.allclose(f.k_proj(x), p.k_proj(x), atol=1e-5).item()
    assert mx.allclose(f.q_proj(x), p.q_proj(x), atol=1e-5).item()
    group = f.q_proj._fusion
    assert group.stash == {}
    assert group.stash_input is None


def test_every_forward_leaves_no_activation_behind(tiny_model_path: Path) -> None:
    """After a whole forward pass no group holds an input or an output."""
    fused = _load(tiny_model_path, True)
    _logits(fused)
    for layer in fused.layers:
        for group in (layer.self_attn.q_proj._fusion, layer.mlp.gate_proj._fusion):
            assert group.stash == {}
            assert group.stash_input is None


def test_quantized_members_stack_too(tiny_model_path: Path) -> None:
    """``QuantizedLinear`` groups (equal bits and group size) stack, with the same logits."""
    plain, _ = mlx_lm.load(str(tiny_model_path))
    fused, _ = mlx_lm.load(str(tiny_model_path))
    for model in (plain, fused):
        nn.quantize(model, group_size=32, bits=8)
    assert _fused_projections.install(fused, {}) == 2 * len(fused.layers)
    assert type(fused.layers[0].self_attn.q_proj).__name__ == "FusedQuantizedLinear"
    assert _same(_logits(plain), _logits(fused))


def test_mixed_kinds_are_left_alone(tiny_model_path: Path) -> None:
    """A group whose members differ in kind (one quantized) is not stacked."""
    model, _ = mlx_lm.load(str(tiny_model_path))
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith("k_proj"))
    stacked = _fused_projections.install(model, {})
    assert stacked == len(model.layers)  # the MLPs only
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear


def test_the_switch_turns_it_off(tiny_model_path: Path) -> None:
    """``TRIO_MLX_FUSED_PROJECTIONS=0`` leaves every module as mlx-lm built it."""
    model, _ = mlx_lm.load(str(tiny_model_path))
    assert _fused_projections.install(model, OFF) == 0
    kinds = {type(m) for _, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {nn.Linear}


def test_installing_twice_stacks_nothing_more(tiny_model_path: Path) -> None:
    """A second install finds every group stacked and changes nothing."""
    model = _load(tiny_model_path, True)
    assert _fused_projections.install(model, {}) == 0
    assert _same(_logits(model), _logits(_load(tiny_model_path, False)))


def test_stacking_takes_no_more_memory(tiny_model_path: Path) -> None:
    """The members' weights become views of the stacked matrix: the model's memory is unchanged."""
    import gc

    model, _ = mlx_lm.load(str(tiny_model_path))
    mx.eval(model.parameters())
    gc.collect()
    before = mx.get_active_memory()
    assert _fused_projections.install(model, {}) == 2 * len(model.layers)
    gc.collect()
    stacked = sum(
        getattr(layer, part)[name].weight.nbytes
        for layer in model.layers
        for part, names in (
            ("self_attn", ("q_proj", "k_proj", "v_proj")),
            ("mlp", ("gate_proj", "up_proj")),
        )
        for name in names
    )
    assert mx.get_active_memory() - before < stacked // 10  # a copy would add all of it


def test_a_member_behind_mlx_lms_lora_layer_keeps_the_group_stacked(tiny_model_path: Path) -> None:
    """``LoRALinear`` calls its layer on the input, so the group stays one matmul under it."""
    from mlx_lm.tuner.lora import LoRALinear

    plain, fused = _load(tiny_model_path, False), _load(tiny_model_path, True)
    for model in (plain, fused):
        attention = model.layers[0].self_attn
        lora = LoRALinear.from_base(attention.k_proj, r=4, scale=2.0)
        lora.lora_a = mx.random.normal(lora.lora_a.shape, key=mx.random.key(3)) * 0.1
        lora.lora_b = mx.random.normal(lora.lora_b.shape, key=mx.random.key(4)) * 0.1
        attention.k_proj = lora
    group = fused.layers[0].self_attn.q_proj._fusion
    assert group.intact()
    assert _same(_logits(plain), _logits(fused))
    assert not _same(_logits(plain), _logits(_load(tiny_model_path, False)))  # LoRA took part


def _q_only(attention: Any) -> None:
    """Make ``attention`` call its ``q_proj`` alone, as Gemma 3n's KV-shared layers do."""

    class QOnly(type(attention)):  # type: ignore[misc]
        def __call__(self, x: Any, mask: Any = None, cache: Any = None) -> Any:
            return self.o_proj(self.q_proj(x))

    attention.__class__ = QOnly


def test_a_group_whose_siblings_are_not_all_called_is_unstacked(tiny_model_path: Path) -> None:
    """The load-time probe pass finds it: no matmul computes outputs that nobody takes."""
    plain, _ = mlx_lm.load(str(tiny_model_path))
    fused, _ = mlx_lm.load(str(tiny_model_path))
    for model in (plain, fused):
        _q_only(model.layers[0].self_attn)
    assert _fused_projections.install(fused, {}) == 2 * len(fused.layers) - 1
    assert type(fused.layers[0].self_attn.q_proj) is nn.Linear
    assert type(fused.layers[0].mlp.up_proj).__name__ == "FusedLinear"
    assert _same(_logits(plain), _logits(fused))
